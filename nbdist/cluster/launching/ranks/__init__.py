"""A rank's start: its entry (main.py), its boot (rank, device, process group), the warm process (zygote.py) and
mpiexec's stand-in for a rank forked from it (warm_stub.py). Runs on the engines."""

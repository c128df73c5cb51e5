"""torch.distributed over MPI: the process group nbdist registers with torch as "mpi4py" (the CPU default).
All of it runs on the engines (ranks/); the kernel only asks for it by name."""

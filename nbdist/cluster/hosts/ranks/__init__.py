"""A rank's side of hosts: the addresses it listens on and who may reach them (addresses.py), the rendezvous
store served over MPI (mpi_store.py). Runs on the engines."""

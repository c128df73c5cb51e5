"""What ties the engines, on this host or others, to the kernel: the lifeline (a connection whose end ends
them) and a Slurm allocation held for the cluster's life. Kernel side; ranks/: addresses and the rendezvous."""
from nbdist.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)

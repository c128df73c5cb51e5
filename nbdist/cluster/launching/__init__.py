"""Starting and stopping a cluster: the controller and the MPI engines, the files a start writes, the warm
process the ranks are forked from, MPICH's leftover files. Kernel side; ranks/ is what a rank runs at start."""
from nbdist.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)

"""nbdist: distributed PyTorch training you can run, step through and measure from a Jupyter notebook.

    %load_ext nbdist
    %dist_start          # MPI engines with torch.distributed initialised
    %%dist               # run a cell on every rank

Everything a magic does, a function here does too: `start`, `current`, `stop`, `Cluster.run`, `Cluster.execute`.
"""
from nbdist.cluster import Cluster, Status, current, start, stop
from nbdist.errors import DistError, DistUsageError

__version__ = "0.1.0"
__all__ = ["Cluster", "Status", "DistError", "DistUsageError", "current", "start", "stop", "load_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbdist`: register the magics and show nbdist's errors as one clear line."""
    from nbdist.magics import register

    register(ipython)

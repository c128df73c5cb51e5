"""Waiting on the ranks: a cell's output labelled by rank, a stuck rank freed, a failure or a death named in one
line (remote.py, tracebacks.py, deaths.py). Kernel side."""
from nbdist.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)

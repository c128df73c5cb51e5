"""A mesh laid over the ranks: named dimensions (dp, pp, tp) and the rank groups along them (mesh.py). Plain data
every floor reads; ranks/: the mesh's communicators on a rank."""
from nbdist.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)

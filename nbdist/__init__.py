"""nbdist: distributed PyTorch training you can run, step through and measure from a Jupyter notebook.

    %load_ext nbdist
    %dist_start          # MPI engines with torch.distributed initialised
    %%dist               # run a cell on every rank

Everything a magic does, a function here does too: `start`, `current`, `stop`, `Cluster.run`, `Cluster.execute`.

The package imports its parts on first use (PEP 562): `import nbdist` stays light (no ipyparallel, no torch), and
the small modules that nbdist's own processes run (`python -m nbdist.cluster.hosts.lifeline`, `python -m
nbdist.cluster.launching.ranks.main`) are not already imported by the package when Python runs them as `__main__` (which would
warn).
"""
from __future__ import annotations

import importlib

from nbdist.errors import DistError, DistInterrupt, DistUsageError
from nbdist.lazy import submodules_on_demand as _submodules_on_demand

__version__ = "0.1.0"
__all__ = [
    "Cluster",
    "Status",
    "DistError",
    "DistInterrupt",
    "DistUsageError",
    "Mesh",
    "Pipeline",
    "Stepper",
    "current",
    "pipeline",
    "start",
    "stop",
    "mesh",
    "shard",
    "Plan",
    "Trainer",
    "Layout",
    "load_ipython_extension",
]

_LAZY = {
    "Cluster": "nbdist.cluster.api",
    "Status": "nbdist.cluster.api",
    "current": "nbdist.cluster.api",
    "start": "nbdist.cluster.api",
    "stop": "nbdist.cluster.api",
    "Pipeline": "nbdist.pipeline_parallel.api",
    "Stepper": "nbdist.pipeline_parallel.stepper",
    "Mesh": "nbdist.cluster.meshes.mesh",
    "shard": "nbdist.sharding.plan",
    "Plan": "nbdist.sharding.plan",
    "Trainer": "nbdist.training.trainer",
    "Layout": "nbdist.layout",
}


def pipeline(model, stages=None, schedule="1f1b", microbatches=8, chunks=1, balance=None, **options):
    """Split `model` across `stages` ranks (or `mesh=`'s pp dimension, one pipeline per dp replica) and run
    pipeline `schedule` on them (see nbdist.pipeline_parallel.api).

    Imported on first use, so that `import nbdist` stays light (the notebook kernel needs no torch to start).
    """
    from nbdist.pipeline_parallel.api import pipeline as make_pipeline

    return make_pipeline(model, stages, schedule, microbatches, chunks, balance, **options)


def mesh(cluster=None, **dims: int):
    """Lay named dimensions (e.g. dp=2, pp=2) over the running (or given) cluster's ranks: see Cluster.mesh."""
    from nbdist.cluster.api import current

    return (cluster or current()).mesh(**dims)


_submodule = _submodules_on_demand(__name__)


def __getattr__(name: str):
    """`nbdist.start`, `from nbdist import Cluster`, `nbdist.schedules`, ...: imported when first asked for."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    return _submodule(name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbdist`: register the magics and show nbdist's errors as one clear line."""
    from nbdist.magics import register

    register(ipython)

"""nbdist: distributed PyTorch training you can run, step through and measure from a Jupyter notebook.

    %load_ext nbdist
    %dist_start          # MPI engines with torch.distributed initialised
    %%dist               # run a cell on every rank

Everything a magic does, a function here does too: `start`, `current`, `stop`, `Cluster.run`, `Cluster.execute`.
"""
from nbdist.cluster import Cluster, Status, current, start, stop
from nbdist.errors import DistError, DistUsageError

__version__ = "0.1.0"
__all__ = [
    "Cluster",
    "Status",
    "DistError",
    "DistUsageError",
    "Pipeline",
    "Stepper",
    "current",
    "pipeline",
    "start",
    "stop",
    "load_ipython_extension",
]


def pipeline(model, stages, schedule="1f1b", microbatches=8, chunks=1, balance=None, **options):
    """Split `model` across `stages` ranks and run pipeline `schedule` on them (see nbdist.pipeline_parallel.api).

    Imported on first use, so that `import nbdist` stays light (the notebook kernel needs no torch to start).
    """
    from nbdist.pipeline_parallel.api import pipeline as make_pipeline

    return make_pipeline(model, stages, schedule, microbatches, chunks, balance, **options)


def __getattr__(name: str):
    if name in ("Pipeline", "Stepper"):
        from nbdist.pipeline_parallel import api

        return getattr(api, name)
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbdist`: register the magics and show nbdist's errors as one clear line."""
    from nbdist.magics import register

    register(ipython)

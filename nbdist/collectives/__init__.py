"""Collective communication: measure it (nccl-tests conventions), build it by hand, and make CPU training faster.

sweep.py        every collective timed through torch.distributed and through MPI, with algbw/busbw and checks
costmodel.py    the alpha-beta model (latency + bytes / bandwidth) fitted to a sweep; ring vs tree predictions
costs.py        one table of steps and bytes per all-reduce algorithm: what costmodel and algorithms both charge
algorithms.py   ring, binomial-tree and recursive-doubling all-reduce over point-to-point messages, step by step
hooks.py        DDP communication hooks: all-reduce through MPI on CPU; compression (fp16, bf16, top-k, PowerSGD)
compat.py       all_gather_single / reduce_scatter_single on every supported torch (older names before 2.13)

Names are imported on first use, so `import nbdist` stays light.
"""
from importlib import import_module

_EXPORTS = {
    "benchmark": "sweep",
    "BenchmarkResult": "sweep",
    "OPS": "sweep",
    "fit_alpha_beta": "costmodel",
    "AlphaBeta": "costmodel",
    "ring_all_reduce": "algorithms",
    "tree_all_reduce": "algorithms",
    "recursive_doubling_all_reduce": "algorithms",
    "trace": "algorithms",
    "message_counts": "costs",
    "all_gather_single": "compat",
    "reduce_scatter_single": "compat",
    "mpi_allreduce_hook": "hooks",
    "register_hook": "hooks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"nbdist.collectives.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'nbdist.collectives' has no attribute {name!r}")

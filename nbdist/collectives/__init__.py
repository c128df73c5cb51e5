"""Collective communication, from the notebook: measure it (nccl-tests conventions), trace it step by step, price it.

sweep.py        benchmark(): every collective timed through torch.distributed and through MPI, algbw/busbw, checks
tracing.py      trace(): a hand-built all-reduce run on the cluster, compared with dist.all_reduce, step by step
costmodel.py    the alpha-beta model (latency + bytes / bandwidth) fitted to a sweep; ring vs tree predictions
ops.py          the benchmarked ops as data: names, chunked or not, element size (read on both sides)
replies.py      what the benchmark's ranks answer: their MPI world, one collective's time (read on both sides)

What they cost (one table of steps and bytes per all-reduce algorithm, what costmodel and trace both charge) is
nbdist/cost/collectives.py. What runs ON the engines is in ranks/: allreduce.py (ring, tree, recursive doubling
over point-to-point messages), collective_timing.py (the benchmark's timed loops); DDP's communication hooks are
data parallelism's (nbdist/data_parallel/ranks/). In a %%dist cell:
`from nbdist.collectives.ranks.allreduce import ring_all_reduce`.

Names are imported on first use, so `import nbdist` stays light: `import nbdist; nbdist.collectives.benchmark(...)`.
"""
from importlib import import_module

_EXPORTS = {
    "benchmark": "nbdist.collectives.sweep",
    "BenchmarkResult": "nbdist.collectives.sweep",
    "OPS": "nbdist.collectives.ops",
    "fit_alpha_beta": "nbdist.collectives.costmodel",
    "AlphaBeta": "nbdist.collectives.costmodel",
    "trace": "nbdist.collectives.tracing",
    "Trace": "nbdist.collectives.tracing",
    "message_counts": "nbdist.cost.collectives",
    "MessageCount": "nbdist.cost.collectives",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nbdist.collectives' has no attribute {name!r}")

"""Collective communication, from the notebook: measure it (nccl-tests conventions), trace it step by step, price it.

sweep.py        benchmark(): every collective timed through torch.distributed and through MPI, algbw/busbw, checks
tracing.py      trace(): a hand-built all-reduce run on the cluster, compared with dist.all_reduce, step by step
costmodel.py    the alpha-beta model (latency + bytes / bandwidth) fitted to a sweep; ring vs tree predictions
costs.py        one table of steps and bytes per all-reduce algorithm: what costmodel and trace both charge (data)
ops.py          the benchmarked ops as data: names, chunked or not, element size (read on both sides)

What runs ON the engines lives in nbdist.engine: allreduce.py (ring, tree, recursive doubling over point-to-point
messages), collective_timing.py (the benchmark's timed loops), hooks.py (DDP communication hooks: MPI all-reduce,
fp16, bf16, top-k, PowerSGD), ddp.py (`ddp(model, hook="auto")`), compat.py (all_gather_single /
reduce_scatter_single on every torch). In a %%dist cell: `from nbdist.collectives.ranks.allreduce import ring_all_reduce`.

Names are imported on first use, so `import nbdist` stays light: `import nbdist; nbdist.collectives.benchmark(...)`.
"""
from importlib import import_module

_EXPORTS = {
    "benchmark": "sweep",
    "BenchmarkResult": "sweep",
    "OPS": "ops",
    "fit_alpha_beta": "costmodel",
    "AlphaBeta": "costmodel",
    "trace": "tracing",
    "Trace": "tracing",
    "message_counts": "costs",
    "MessageCount": "costs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"nbdist.collectives.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'nbdist.collectives' has no attribute {name!r}")

"""Data parallelism (runs ON the engines): `ddp(model)` is DistributedDataParallel with nbdist's communication hook.

Why MPI on CPU: DDP all-reduces gradient buckets (1-25 MB) through its process group, which on CPU engines is
gloo over TCP loopback. nbdist's engines are also an MPI world, and MPICH all-reduces through shared memory,
several times faster for a bucket of a few MiB (figures: benchmarks/README.md). So on CPU, hook="auto" all-reduces
through MPI (see nbdist.data_parallel.ranks.hooks.register_hook for why); on GPUs DDP's own
all-reduce stays (hook "torch": torch.distributed's all-reduce, nccl for CUDA gradients). The hook's state
(bytes sent per step, ...) is kept as `model.comm_hook_state`.

    %%dist
    from nbdist.data_parallel.ranks.ddp import ddp
    model = ddp(MyModel())                      # hook="auto": MPI on CPU engines
    model = ddp(MyModel(), hook="topk", ratio=0.01, bucket_cap_mb=10)
    # one replica group of a mesh:
    model = ddp(MyModel(), process_group=nbdist.cluster.meshes.ranks.rank_mesh.here(m).group("dp"))
"""
from __future__ import annotations

import inspect
import math
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nbdist.data_parallel.ranks.hooks import register_hook


def _ddp_parameters() -> set[str]:
    return set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}


def ddp(model: nn.Module, hook: str = "auto", **options: Any) -> DistributedDataParallel:
    """Wrap `model` (already on this rank's device) in DistributedDataParallel and register communication hook
    `hook` (see nbdist.data_parallel.ranks.hooks.register_hook for the names). Options that DistributedDataParallel
    takes (bucket_cap_mb, find_unused_parameters, ...) go to it; the rest (ratio, rank, ...) go to the hook.

    One DDP default differs: gradient_as_bucket_view=True (pass False to undo). The gradients then live in DDP's
    buckets instead of being copied in before and out after the all-reduce: on CPU those copies are a visible part
    of a step (figures: benchmarks/README.md).
    """
    own = _ddp_parameters()
    ddp_options = {"gradient_as_bucket_view": True, **{k: v for k, v in options.items() if k in own}}
    if hook == "powersgd" and "bucket_cap_mb" not in ddp_options:  # one bucket: see hooks._check_one_bucket
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        ddp_options["bucket_cap_mb"] = max(25, math.ceil(nbytes / 2**20) + 1)
    wrapped = DistributedDataParallel(model, **ddp_options)
    wrapped.comm_hook_state = register_hook(wrapped, hook, **{k: v for k, v in options.items() if k not in own})
    return wrapped

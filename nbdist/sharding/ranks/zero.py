"""ZeRO (runs ON the engines): optimizer state, gradients and parameters sharded over the data-parallel replicas.

Stage 1 is torch's ZeroRedundancyOptimizer: each replica keeps the optimizer state of a share of the parameters,
steps only those, and broadcasts them back. Stages 2 and 3 are FSDP2 (`fully_shard`) on the dp dimension of the
mesh, one FSDP unit per top-level layer of the model plus the root: gradients are reduce-scattered into shards and
the optimizer steps the shards. Stage 3 frees each layer's gathered parameters after its forward
(reshard_after_forward=True) and gathers them again for its backward; stage 2 keeps them gathered from forward to
backward (reshard_after_forward=False), which costs memory and saves that second all-gather. On CPU engines the
mesh is a CPU DeviceMesh, so FSDP2 shards CPU tensors over the mesh's backend.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


def shard(model: nn.Module, dp_mesh, stage: int) -> nn.Module:
    """FSDP2 over `dp_mesh` (a 1-D DeviceMesh, or the dp part of a dp x tp mesh), in place: every top-level layer
    that has parameters is one unit, then the root (which takes what is left)."""
    from nbdist.cluster.ranks.compat import fully_shard  # public from torch 2.6, private before

    reshard = stage == 3
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    return model


def optimizer(params: Iterable[torch.nn.Parameter], make: Callable, stage: int, dp_group) -> torch.optim.Optimizer:
    """The rank's optimizer: `make(params)`, or for stage 1 a ZeroRedundancyOptimizer of the same class and
    settings over the dp group. (torch's ZeroRedundancyOptimizer takes a class and keyword arguments, not a
    function: the class and settings are read from what `make` builds for one throwaway parameter.)"""
    params = list(params)
    if stage != 1:
        return make(params)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    probe = make([nn.Parameter(torch.zeros(1))])
    return ZeroRedundancyOptimizer(params, optimizer_class=type(probe), process_group=dp_group, **probe.defaults)

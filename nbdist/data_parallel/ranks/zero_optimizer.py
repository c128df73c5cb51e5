"""ZeRO-1's optimizer (runs ON the engines): each data-parallel replica keeps the optimizer state of a share of the
parameters, steps only those and broadcasts them back (torch's ZeroRedundancyOptimizer). Here, below its two users:
a sharded model's replicas (sharding/ranks/sharded.py) and a pipeline's, the replicas of each stage
(pipeline_parallel/ranks/pipeline.py).

Tensor-parallel parameters are DTensors, which ZeroRedundancyOptimizer does not take. For them, `TensorParallelZero`
does the same on each parameter's local slice: the same partition (largest parameter first, to the replica with the
fewest elements so far, by full size: cost/memory.py's zero1_owners, what the memory prediction reads), each
replica's optimizer steps its own parameters, then each replica broadcasts its parameters' slices over the dp group
in one flat message. The dp group joins ranks with the same tp coordinate, so their slices have the same shapes.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from nbdist.cost.memory import zero1_owners
from nbdist.data_parallel.ranks.data_parallel import _local


def optimizer(params: Iterable[torch.nn.Parameter], make: Callable, stage: int, dp_group) -> torch.optim.Optimizer:
    """The rank's optimizer: `make(params)`, or for stage 1 a ZeroRedundancyOptimizer of the same class and
    settings over the dp group (TensorParallelZero for DTensor parameters). (torch's ZeroRedundancyOptimizer takes
    a class and keyword arguments, not a function: the class and settings are read from what `make` builds for one
    throwaway parameter.)"""
    params = list(params)
    if stage != 1:
        return make(params)
    if any(_is_dtensor(p) for p in params):
        return TensorParallelZero(params, make, dp_group)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    probe = make([nn.Parameter(torch.zeros(1))])
    return ZeroRedundancyOptimizer(params, optimizer_class=type(probe), process_group=dp_group, **probe.defaults)


class TensorParallelZero(torch.optim.Optimizer):
    """ZeRO-1 over tensor-parallel (DTensor) parameters: see the module's docstring. Its one group holds every
    parameter, as ZeroRedundancyOptimizer's do: loss scaling unscales, and clipping measures, every gradient, and a
    learning-rate schedule sets the group; the optimizer `make` builds for this replica's parameters takes the
    group's settings at each step and holds the state."""

    def __init__(self, params: list[torch.nn.Parameter], make: Callable, dp_group):
        replicas, me = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self._params, self._group = params, dp_group
        self._owner = zero1_owners([p.numel() for p in params], replicas)
        self._sources = [dist.get_global_rank(dp_group, r) for r in range(replicas)]
        mine = [p for p, o in zip(params, self._owner) if o == me]
        self.inner = make(mine) if mine else None
        probe = self.inner or make([nn.Parameter(torch.zeros(1))])
        super().__init__(params, {k: v for k, v in probe.param_groups[0].items() if k != "params"})
        if self.inner is not None:
            self.state = self.inner.state  # this replica's share only

    @torch.no_grad()
    def step(self, closure=None):
        """Step this replica's parameters, then bring every replica's to all: one broadcast per replica."""
        if self.inner is not None:
            settings = {k: v for k, v in self.param_groups[0].items() if k != "params"}
            for group in self.inner.param_groups:
                group.update(settings)
        loss = self.inner.step(closure) if self.inner is not None else (closure() if closure else None)
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for replica, source in enumerate(self._sources):
            slices = [_local(p) for p, o in zip(self._params, self._owner) if o == replica]
            if not slices:
                continue
            flat = _flatten_dense_tensors(slices)
            dist.broadcast(flat, src=source, group=self._group)
            for local, stepped in zip(slices, _unflatten_dense_tensors(flat, slices)):
                local.copy_(stepped)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def __repr__(self) -> str:
        return f"TensorParallelZero({type(self.inner).__name__ if self.inner else 'nothing to step'})"


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "placements")

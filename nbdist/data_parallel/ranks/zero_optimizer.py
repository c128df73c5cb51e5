"""ZeRO-1's optimizer (runs ON the engines): each data-parallel replica keeps the optimizer state of a share of the
parameters, steps only those and broadcasts them back (torch's ZeroRedundancyOptimizer). Here, below its two users:
a sharded model's replicas (sharding/ranks/sharded.py) and a pipeline's, the replicas of each stage
(pipeline_parallel/ranks/pipeline.py).

Tensor-parallel parameters are DTensors, which ZeroRedundancyOptimizer does not take. For them, `TensorParallelZero`
does the same on each parameter's local slice: the same partition (largest parameter first, to the replica with the
fewest elements so far, by full size: what sharding/memory.py's zero1_shares predicts), each replica's optimizer
steps its own parameters, then each replica broadcasts its parameters' slices over the dp group in one flat
message. The dp group joins ranks with the same tp coordinate, so their slices have the same shapes.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


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


def owners(sizes: list[int], replicas: int) -> list[int]:
    """The replica that steps each parameter: largest first, each to the replica with the fewest elements so far
    (ties to the lowest), as ZeroRedundancyOptimizer partitions."""
    held, owner = [0] * replicas, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        owner[i] = held.index(min(held))
        held[owner[i]] += sizes[i]
    return owner


class TensorParallelZero(torch.optim.Optimizer):
    """ZeRO-1 over tensor-parallel (DTensor) parameters: see the module's docstring. Its one group holds every
    parameter, as ZeroRedundancyOptimizer's do: loss scaling unscales, and clipping measures, every gradient, and a
    learning-rate schedule sets the group; the optimizer `make` builds for this replica's parameters takes the
    group's settings at each step and holds the state."""

    def __init__(self, params: list[torch.nn.Parameter], make: Callable, dp_group):
        replicas, me = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self._params, self._group = params, dp_group
        self._owner = owners([p.numel() for p in params], replicas)
        self._sources = [dist.get_global_rank(dp_group, r) for r in range(replicas)]
        mine = [p for p, o in zip(params, self._owner) if o == me]
        self.inner = make(mine) if mine else None
        probe = self.inner or make([nn.Parameter(torch.zeros(1))])
        # torch.optim.Optimizer.__init__ is not called: it would check the group against `make`'s own settings
        self.defaults = probe.defaults
        self.param_groups = [{**{k: v for k, v in probe.param_groups[0].items() if k != "params"}, "params": params}]
        self.state = self.inner.state if self.inner else defaultdict(dict)  # this replica's share only
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

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


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local slice (written in place), or the tensor itself."""
    return getattr(t, "_local_tensor", t)

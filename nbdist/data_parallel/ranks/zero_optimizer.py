"""ZeRO-1's optimizer (runs ON the engines): each data-parallel replica keeps the optimizer state of a share of the
parameters, steps only those and broadcasts them back (torch's ZeroRedundancyOptimizer). Here, below its two users:
a sharded model's replicas (sharding/ranks/sharded.py) and a pipeline's, the replicas of each stage
(pipeline_parallel/ranks/pipeline.py)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


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

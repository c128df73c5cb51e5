"""What a data-parallel step communicates once backward is done, by ZeRO stage: the one rule the local predictor
(sharding/step_time.py) and the cluster-scale planner (planner/step.py) price, each with its own collectives'
prices (an α-β fit measured here, or a link's published latency and bandwidth).

- ZeRO-0: the gradients are all-reduced.
- ZeRO-1: the gradients are reduced, then each rank's updated partition of the weights is all-gathered. The ZeRO
  paper and Megatron-LM's distributed optimizer reduce-scatter the gradients; torch's ZeroRedundancyOptimizer runs
  under DDP, which all-reduces them whole (its partitions are then broadcast by their owners: an all-gather's
  bytes). `zero1` names which.
- ZeRO-2: gradients are reduce-scattered during backward (priced per micro-batch by the callers, which know when);
  after the optimizer the updated weights are all-gathered where a whole replica is kept (the paper's ZeRO-2),
  not where they stay sharded (FSDP2, whose forward gathers them: priced per micro-batch too).
- ZeRO-3: nothing after backward; every gather and scatter happens per micro-batch.
"""
from __future__ import annotations

from typing import Callable

from nbdist.cost.memory import check_zero

Price = Callable[[float], float]  # bytes -> seconds of one collective over the data-parallel group
ZERO1_REDUCTIONS = ("reduce-scatter", "all-reduce")


def after_backward(zero: int, gradient_bytes: float, weight_bytes: float, all_reduce: Price, gather: Price,
                   zero1: str = "reduce-scatter", whole_weights: bool = True) -> tuple[float, float]:
    """(reduce, gather) seconds after backward: the gradients' reduction, and the updated weights' all-gather."""
    check_zero(zero)
    if zero == 0:
        return all_reduce(gradient_bytes), 0.0
    if zero == 1:
        reduce = all_reduce(gradient_bytes) if zero1 == "all-reduce" else gather(gradient_bytes)
        return reduce, gather(weight_bytes)
    if zero == 2 and whole_weights:
        return 0.0, gather(weight_bytes)
    return 0.0, 0.0

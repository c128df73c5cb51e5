"""Each rank's memory before the plan runs, from the model's profile: parameters, gradients, optimizer state and
saved activations per pipeline rank, counted per tensor as torch's ZeroRedundancyOptimizer and FSDP2 hold them
(padded shards, the greedy ZeRO-1 partition, gathered layers). Which parts ZeRO shards at which stage is
cost/memory.py's rule, the one the cluster-scale planner uses too; this module counts exact elements where the
planner counts Ψ. Checked against what the ranks measure (tests/test_memory_meter.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from nbdist.cost.memory import OPTIMIZER_STATES, check_zero, sharded, zero1_owners
from nbdist.errors import DistUsageError
from nbdist.schedules.schedule import Schedule
from nbdist.sharding.profile import LayerProfile, ParamShape, held_tensors
from nbdist.sharding.shape import micro_batch_size, schedule_and_ranges
from nbdist.units import format_bytes


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by kind (what nbdist.runtime.ranks.memory.state_bytes and ActivationMeter
    measure on a rank)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.params + self.grads + self.optimizer + self.activations)

    def __str__(self) -> str:
        return ", ".join(f"{k} {format_bytes(getattr(self, k))}"
                         for k in ("params", "grads", "optimizer", "activations", "total"))


def predict_memory(layers: Sequence[LayerProfile], *, dp: int, pp: int, tp: int, zero: int,
                   boundaries: Sequence[tuple[int, int]] | None, microbatches: int, schedule: str | Schedule,
                   batch: int, optimizer: str = "adam", param_bytes: int = 4) -> list[RankMemory]:
    """Per pipeline rank (the ranks of one stage hold the same), the bytes each rank holds at its peak.

    params: its stages' parameters, the split ones / tp. ZeRO-0/1: whole. ZeRO-3 (FSDP2 per top-level layer,
    resharded after forward): FSDP2's padded shards of every parameter, plus the largest layer gathered, in its
    all-gather buffers of dp padded shards (one layer at a time; FSDP2's backward prefetch can briefly hold two:
    not counted). ZeRO-2 (reshard_after_forward=False): the shards plus every layer gathered, held from its
    forward to its backward.
    grads: the parameters' size; ZeRO-2/3 the shards.
    optimizer: states per parameter element (adam 2, sgd-momentum 1, sgd 0; Adam's scalar step not counted).
    ZeRO-1: the largest share of ZeroRedundancyOptimizer's greedy partition; ZeRO-2/3: the padded shards (Adam's
    states take a rank's own rows, so the last rank may hold a little less: this is the largest rank's).
    activations: bytes saved for backward per sample x micro-batch size x the most micro-batches the schedule
    keeps in flight on that rank (pp=1: one, gradient accumulation); the last stage also holds what the loss saves.
    """
    check_zero(zero)
    if optimizer not in OPTIMIZER_STATES:
        raise DistUsageError(f"unknown optimizer {optimizer!r}: choose {', '.join(OPTIMIZER_STATES)}")
    schedule, ranges = schedule_and_ranges(layers, pp, boundaries, microbatches, schedule)
    size = micro_batch_size(batch, dp, microbatches)
    peaks = {0: 1} if pp == 1 else schedule.simulate().peak_activations
    return [
        _rank_memory([list(layers[a:b]) for a, b in (ranges[s] for s in schedule.stages_of(rank))], peaks[rank],
                     size, dp, tp, zero, OPTIMIZER_STATES[optimizer], param_bytes, layers[-1])
        for rank in range(schedule.ranks)
    ]


def _rank_memory(stages: list[list[LayerProfile]], peak: int, size: int, dp: int, tp: int, zero: int,
                 states: int, param_bytes: int, last: LayerProfile) -> RankMemory:
    tensors = held_tensors([layer for stage in stages for layer in stage])  # a tied copy where its owner is not
    whole = sum(t.numel(tp) for t in tensors)
    shards = sum(t.shard_numel(tp, dp) for t in tensors)
    # a gathered layer lives in FSDP2's all-gather buffers: dp padded shards per parameter
    per_layer = [sum(t.shard_numel(tp, dp) * dp for t in layer.tensors) for stage in stages for layer in stage]
    # ZeRO-2/3 run as FSDP2: weights live as shards, and the units running are gathered whole (ZeRO-2 holds every
    # layer from its forward to its backward, ZeRO-3 one at a time)
    gathered = sum(per_layer) if zero == 2 else max(per_layer, default=0)
    params = shards + gathered if zero >= 2 else whole
    grads = shards if sharded("gradients", zero) else whole
    partition = max(zero1_shares(tensors, dp, tp)) if zero == 1 else shards  # ZeroRedundancyOptimizer's greedy one
    state = partition if sharded("optimizer", zero) else whole
    # with several chunks per rank, the schedule counts one chunk's activation: the largest chunk's is taken
    saved = max(_stage_saved_bytes(stage, tp, last) for stage in stages)
    return RankMemory(params * param_bytes, grads * param_bytes, states * state * param_bytes,
                      round(saved * size * peak))


def _stage_saved_bytes(stage: list[LayerProfile], tp: int, last: LayerProfile) -> float:
    """Bytes per sample a stage saves for backward: its layers', its received input again, and on the last stage
    what the loss saves: one output's size (cross-entropy keeps its log-softmax, MSE its input; a target the loss
    also keeps is not counted)."""
    loss = last.output_bytes_per_sample if stage[-1] is last else 0.0
    return sum(layer.saved_bytes(tp) for layer in stage) + stage[0].input_saved_bytes(tp) + loss


def zero1_shares(tensors: Sequence[ParamShape], dp: int, tp: int = 1) -> list[int]:
    """Parameter elements each of dp ranks owns under ZeRO-1 (cost/memory.py's zero1_owners: partitioned by full
    size, a DTensor's numel being global), counted as the tp-local elements each rank holds."""
    held = [0] * dp
    for t, owner in zip(tensors, zero1_owners([t.numel() for t in tensors], dp)):
        held[owner] += t.numel(tp)
    return held

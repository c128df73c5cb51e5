"""The shapes a sharding plan may take on a model, refused in one line before anything runs: dp, pp, tp, the ZeRO
stage, micro-batches and stage boundaries against the model's layers, heads and features (`check_shape`, which
the plan calls first), and the schedule and stages' layer ranges a prediction reads (`schedule_and_ranges`).
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from nbdist.checks import whole_number
from nbdist.cost.memory import check_zero
from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel.stages import boundaries as ranges_of
from nbdist.pipeline_parallel.stages import layer_counts
from nbdist.schedules.generators import build
from nbdist.schedules.schedule import Schedule
from nbdist.sharding.profile import LayerProfile
from nbdist.tensor_parallel.pairs import check_tp, tp_pairs


def check_shape(model: nn.Sequential, *, dp: int, pp: int, tp: int, zero: int, microbatches: int, batch: int,
                boundaries: Sequence[tuple[int, int]] | None = None) -> None:
    """Refuse, in one line, a plan that cannot run on `model` (dp*pp*tp = world size is the plan's own check)."""
    for label, value in (("dp", dp), ("pp", pp), ("tp", tp), ("microbatches", microbatches), ("batch", batch)):
        whole_number(value, label)
    check_zero(zero)
    if pp > len(model):
        raise DistUsageError(f"pp={pp} needs at least {pp} layers to cut into stages, but the model has {len(model)}")
    micro_batch_size(batch, dp, microbatches)
    if tp > 1:
        check_tp(model, tp)
    if boundaries is not None:
        ranges = _checked_ranges(boundaries, len(model), len(boundaries) if len(boundaries) % pp == 0 else pp)
    else:  # as nbdist.pipeline cuts it: balanced by parameters
        ranges = ranges_of(layer_counts([sum(p.numel() for p in layer.parameters()) for layer in model], pp))
    if tp > 1 and pp > 1:
        _check_pairs_within_stages(model, ranges)


def check_any_shape(units: Sequence[str], *, dp: int, pp: int, zero: int, microbatches: int, batch: int) -> None:
    """check_shape for a model that is not nbdist's own Sequential (its tensor-parallel plan is checked where it
    is read: tensor_parallel/plans.py)."""
    for label, value in (("dp", dp), ("pp", pp), ("microbatches", microbatches), ("batch", batch)):
        whole_number(value, label)
    check_zero(zero)
    if pp > len(units):
        raise DistUsageError(f"pp={pp} needs at least {pp} units to cut into stages, but the model has {len(units)}")
    micro_batch_size(batch, dp, microbatches)


def _check_pairs_within_stages(model: nn.Sequential, ranges: list[tuple[int, int]]) -> None:
    """A column layer's output is split over the tp ranks until its row layer: no stage boundary may fall between."""
    names = [name for name, _ in model.named_children()]
    stage_of = {names[i]: s for s, (a, b) in enumerate(ranges) for i in range(a, b)}
    for column, row in tp_pairs(model):
        if stage_of[column.split(".")[0]] != stage_of[row.split(".")[0]]:
            raise DistUsageError(f"the stage boundaries {list(ranges)} cut the tensor-parallel pair ({column}, "
                                 f"{row}) between two stages: give boundaries that keep each pair in one stage")


def micro_batch_size(batch: int, dp: int, microbatches: int) -> int:
    """Samples in one micro-batch on one replica; refused unless the batch splits evenly."""
    if batch % dp:
        raise DistUsageError(f"a batch of {batch} does not split into dp={dp} equal shares")
    if (batch // dp) % microbatches:
        raise DistUsageError(f"each replica's {batch // dp} samples do not split into {microbatches} equal "
                             f"micro-batches")
    return batch // dp // microbatches


def _checked_ranges(boundaries: Sequence[tuple[int, int]], layers: int, stages: int) -> list[tuple[int, int]]:
    ranges = [tuple(r) for r in boundaries]
    joined = all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    if len(ranges) != stages or not joined or ranges[0][0] != 0 or ranges[-1][1] != layers:
        raise DistUsageError(f"stage boundaries {ranges} must be {stages} non-empty (first, end) layer ranges "
                             f"that follow each other from 0 to {layers}")
    return ranges


def schedule_and_ranges(layers: Sequence[LayerProfile], pp: int, boundaries, microbatches: int,
                        schedule: str | Schedule) -> tuple[Schedule, list[tuple[int, int]]]:
    """The schedule (built, or checked against pp and microbatches) and each stage's layer range (given, or
    balanced by parameters as nbdist.pipeline balances them)."""
    if isinstance(schedule, Schedule):
        if (schedule.ranks, schedule.microbatches) != (pp, microbatches):
            raise DistUsageError(f"the schedule has {schedule.ranks} ranks and {schedule.microbatches} "
                                 f"micro-batches, but the plan has pp={pp} and microbatches={microbatches}")
    else:
        schedule = build(schedule, pp, microbatches)
    if boundaries is None:
        return schedule, ranges_of(layer_counts([layer.params for layer in layers], schedule.stages))
    return schedule, _checked_ranges(boundaries, len(layers), schedule.stages)

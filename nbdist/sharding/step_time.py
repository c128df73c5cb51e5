"""A plan's step time before it runs, every term visible: compute from the timed profile, the schedule simulated
with it (nbdist's simulator), tensor-parallel and data-parallel collectives priced by the α-β model over the one
table of collective costs (cost/collectives.py), and what the libraries cost (Overheads, measured on the engines).
The cluster-scale planner (planner/step.py) prices the same collectives from the same table, with published
hardware figures instead of a fit measured here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from nbdist.cost import data_parallel
from nbdist.cost.memory import check_zero
from nbdist.cost.waiting import YIELD_SECONDS
from nbdist.errors import DistUsageError
from nbdist.schedules.schedule import Schedule
from nbdist.schedules.simulate import Span, Timeline
from nbdist.sharding.profile import LayerProfile, held_tensors
from nbdist.sharding.shape import micro_batch_size, schedule_and_ranges

if TYPE_CHECKING:
    from nbdist.collectives.costmodel import AlphaBeta



def default_alpha_beta() -> "AlphaBeta":
    """The default price of one message, 10.3 us + S x 4.26e-10 s (2.35 GB/s): a 2-rank all-reduce on 2 CPU
    engines (MPICH shared memory), fitted with `nbdist.collectives.benchmark(ops="all_reduce", via="torch")` and
    fit_alpha_beta (how, and the fit: benchmarks/README.md).

    The ring model charges a 2-rank all-reduce 2 alpha + S beta, hence half the fitted alpha per message. A plain
    message is cheaper per byte than an all-reduce's (no additions), so pipeline messages are priced high. The plan
    passes a fit measured on its own cluster instead.
    """
    from nbdist.collectives.costmodel import AlphaBeta

    return AlphaBeta(alpha=10.3e-6, beta=4.26e-10, op="all_reduce", via="torch", ranks=2)


@dataclass(frozen=True)
class Overheads:
    """What the libraries cost beyond a layer's own compute and the bytes they move, measured on the engines by
    micro-benchmarks (nbdist/sharding/ranks/sharded.py, mechanism_costs), seconds per micro-batch:
    `tp_linear`: (forward, backward) per tensor-parallel Linear (DTensor's dispatch and redistribution);
    `fsdp_unit`: (forward, backward) per FSDP2 unit (its hooks, gathers and scatters of small shards);
    `optimizer_per_param`: the optimizer's step per parameter element (the profile's optimizer kind), and
    `optimizer_per_tensor` per parameter tensor (its loop over them);
    `optimizer_per_dtensor`: its extra step time per parameter tensor that is a DTensor (FSDP2 shards, split
    Linears), DTensor's dispatch of every update op."""

    tp_linear: tuple[float, float] = (0.0, 0.0)
    fsdp_unit: tuple[float, float] = (0.0, 0.0)
    optimizer_per_param: float = 0.0
    optimizer_per_dtensor: float = 0.0
    optimizer_per_tensor: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """A predicted step, every term in seconds. Per stage and micro-batch: compute (`forward_s`, `backward_s`,
    the split part / tp) and tensor-parallel all-reduces (`tp_forward_s`, `tp_backward_s`); `pp_message_s`, one
    activation (or gradient) message between stages; `pipeline`, the schedule simulated with those (makespan,
    bubble); `dp_sync_s`, per stage the data-parallel collectives of a step. Collectives are not overlapped with
    compute (DDP and FSDP2 overlap some): `total_s` is an upper bound on the step's communication."""

    forward_s: list[float]
    backward_s: list[float]
    tp_forward_s: list[float]
    tp_backward_s: list[float]
    pp_message_s: float
    dp_sync_s: list[float]
    pipeline: Timeline
    alpha_beta: "AlphaBeta"
    optimizer_s: list[float] = field(default_factory=list)  # per stage: the optimizer's step on a rank's share
    overheads: Overheads = Overheads()
    library_forward_s: list[float] = field(default_factory=list)  # per stage and micro-batch: DTensor, FSDP2
    library_backward_s: list[float] = field(default_factory=list)
    microbatches: int = 1
    shared_cores_s: float = 0.0  # what ranks sharing a host's cores add to the schedule (sharing_the_cores)
    assumes: object = None  # the share of a core the ranks were measured to get (measured.CoreShare), said in repr

    @property
    def makespan_s(self) -> float:
        return self.pipeline.makespan

    @property
    def bubble_fraction(self) -> float:
        return self.pipeline.bubble_fraction

    @property
    def total_s(self) -> float:
        return self.makespan_s + max(self.dp_sync_s) + max(self.optimizer_s, default=0.0)

    def terms(self) -> dict[str, float]:
        """The step split into what a reader can check, summing to total_s: on the busiest stage, its layers'
        compute, its tensor-parallel all-reduces and the libraries' own time (DTensor, FSDP2) over every
        micro-batch, each as a rank alone would take it; the rest of the simulated schedule (pipeline bubbles
        and messages); what sharing the cores adds to all that; the data-parallel collectives; the optimizer's
        step."""
        m, none = self.microbatches, [0.0] * len(self.forward_s)
        library = [f + b for f, b in zip(self.library_forward_s or none, self.library_backward_s or none)]
        busy = [m * (f + b + tf + tb + lib) for f, b, tf, tb, lib in
                zip(self.forward_s, self.backward_s, self.tp_forward_s, self.tp_backward_s, library)]
        s = max(range(len(busy)), key=busy.__getitem__)
        return {"compute": m * (self.forward_s[s] + self.backward_s[s]),
                "tensor-parallel all-reduces": m * (self.tp_forward_s[s] + self.tp_backward_s[s]),
                "libraries (DTensor, FSDP2)": m * library[s],
                "pipeline bubbles and messages": max(0.0, self.makespan_s - self.shared_cores_s - busy[s]),
                "ranks sharing the cores": self.shared_cores_s,
                "data-parallel sync": max(self.dp_sync_s),
                "optimizer": max(self.optimizer_s, default=0.0)}

    def dominant(self) -> str:
        """The term that weighs most."""
        terms = self.terms()
        return max(terms, key=terms.__getitem__)


def predict_step_seconds(layers: Sequence[LayerProfile], *, dp: int, pp: int, tp: int, zero: int,
                         boundaries: Sequence[tuple[int, int]] | None, microbatches: int, schedule: str | Schedule,
                         batch: int, alpha_beta: "AlphaBeta | None" = None, param_bytes: int = 4,
                         overheads: Overheads | None = None, links: dict | None = None,
                         contention: float = 1.0, others: float = 0.0) -> StepTime:
    """The step's time from timed profiles (with_times), the schedule simulator and the alpha-beta model.

    Compute: each layer's seconds per sample x micro-batch size, its split part / tp, the split part taken as its
    share of split parameters (a Linear's work is 2 x parameters per token). Tensor parallel: per row-parallel
    Linear one all-reduce of its output in forward and one of its pair's input gradient in backward (2 + 2 per GPT
    block, 1 + 1 per MLP pair), ring-priced, inside the stage's F and B. Pipeline: the largest stage output
    per micro-batch as one message. Data parallel (ring-priced over dp), per step: ZeRO-0 an all-reduce of the
    gradients; ZeRO-1 that plus ZeroRedundancyOptimizer's broadcast of updated partitions (an all-gather, half a
    ring); FSDP2 gathers each layer in every micro-batch's forward (ZeRO-3: again in its backward) and
    reduce-scatters its gradients in every backward (its defaults: resharded after backward, gradients synced
    each micro-batch). `overheads` (measured on the engines): per tensor-parallel Linear and per FSDP2 unit, added
    to each micro-batch's forward and backward; the optimizer's step on each rank's share of the parameters.
    `links`: per dimension ("dp", "tp") the α-β measured on its groups (Plan.profile), else `alpha_beta`.
    `contention`: how much slower a rank computes when every rank of its host is busy (4 CPU ranks on 2 cores:
    2). The per-stage times are a rank's alone; the simulated schedule is stretched where ranks compute at once
    (sharing_the_cores): `pipeline` is the schedule as it runs, `shared_cores_s` what the sharing added.
    `others`: the part of the competition for the cores that is other work (it stays while ranks idle).
    """
    check_zero(zero)
    ab = alpha_beta or default_alpha_beta()
    extra = overheads or Overheads()
    schedule, ranges = schedule_and_ranges(layers, pp, boundaries, microbatches, schedule)
    size = micro_batch_size(batch, dp, microbatches)
    stages = [list(layers[a:b]) for a, b in ranges]
    if any(layer.forward_s is None or layer.backward_s is None for layer in layers):
        raise DistUsageError("the profile has no layer times yet: with_times(layers, time_layers(model, batch))")
    forward = [sum(layer.forward_s * _tp_share(layer, tp) * size for layer in stage) for stage in stages]
    backward = [sum(layer.backward_s * _tp_share(layer, tp) * size for layer in stage) for stage in stages]
    tp_ab, dp_ab = (links or {}).get("tp", ab), (links or {}).get("dp", ab)
    tp_f = [_tp_allreduces(stage, 0, size, tp, tp_ab) for stage in stages]
    tp_b = [_tp_allreduces(stage, 1, size, tp, tp_ab) for stage in stages]
    lib_f = [_library(stage, tp, zero, extra, 0) for stage in stages]
    lib_b = [_library(stage, tp, zero, extra, 1) for stage in stages]
    message = max((ab.predict(stage[-1].output_bytes_per_sample * size) for stage in stages[:-1]), default=0.0)
    v = schedule.chunks  # the simulator divides a rank's time by its chunks; these times are per stage already
    alone = schedule.simulate(forward=[(f + t + o) * v for f, t, o in zip(forward, tp_f, lib_f)],
                              backward=[(b + t + o) * v for b, t, o in zip(backward, tp_b, lib_b)], comm=message)
    timeline = sharing_the_cores(alone, contention, others)
    timeline.name, timeline.unit = f"{schedule.name} (predicted)", "s"
    sync = [_dp_sync([sum(p.numel(tp) for p in layer.tensors) * param_bytes for layer in stage], dp, zero,
                     microbatches, dp_ab) for stage in stages]
    shards = dp if zero >= 1 else 1
    optimizer = [extra.optimizer_per_param * sum(p.numel(tp) for p in held_tensors(stage)) / shards
                 + extra.optimizer_per_tensor * _stepped_tensors(stage, dp, zero)
                 + extra.optimizer_per_dtensor * _dtensors(stage, tp, zero) for stage in stages]
    return StepTime(forward, backward, tp_f, tp_b, message, sync, timeline, ab, optimizer, extra, lib_f, lib_b,
                    microbatches, timeline.makespan - alone.makespan)


def sharing_the_cores(timeline: Timeline, contention: float, others: float = 0.0) -> Timeline:
    """A simulated schedule as it runs when ranks share their host's cores. Every pipeline (each dp replica, each
    tp slice) runs the same schedule at once, so while b of a pipeline's p stages compute, b/p of the host's ranks
    do, and each computes max(1, contention x b / p) times slower than alone: the clock is stretched by that much
    there. A rank waiting for a message keeps its core only for the first YIELD_SECONDS of the wait (the MPI
    backend's polling: cost/waiting.py), then sleeps between tests. A pipeline's warm-up and cool-down (some stages
    idle) stretch less than its steady part; with one stage the whole step takes `contention` x its time alone.
    `others`: the part of the competition for the cores that is other work (busy processes beside the cluster):
    it stays while stages idle, so there the clock runs contention x (others + (1 - others) x b / p) slower."""
    if contention <= 1.0 or not any(s.action.is_compute for row in timeline.spans.values() for s in row):
        return timeline
    holding = [[(s.start, s.end) if s.action.is_compute else (s.start, min(s.end, s.start + YIELD_SECONDS))
                for s in row] for row in timeline.spans.values()]  # per rank, when it keeps a core busy
    edges = sorted({t for row in timeline.spans.values() for span in row for t in (span.start, span.end)}
                   | {t for row in holding for interval in row for t in interval})
    warped = [edges[0]]
    for a, b in zip(edges, edges[1:]):
        busy = sum(any(start <= a and b <= end for start, end in row) for row in holding)
        warped.append(warped[-1] + (b - a) * max(1.0, contention * (others + (1 - others) * busy / len(holding))))
    at = dict(zip(edges, warped))  # every span's ends are edges
    spans = {rank: [Span(s.action, at[s.start], at[s.end],
                         s.wait * (at[s.end] - at[s.start]) / s.duration if s.duration else s.wait) for s in row]
             for rank, row in timeline.spans.items()}
    return Timeline(spans, unit=timeline.unit, name=timeline.name, cuts=list(timeline.cuts),
                    pipelines=list(timeline.pipelines), pipeline_names=list(timeline.pipeline_names))


def _library(stage: list[LayerProfile], tp: int, zero: int, extra: Overheads, direction: int) -> float:
    """The libraries' own time in one micro-batch's forward (0) or backward (1) of a stage: DTensor's per split
    Linear (each has one tensor-parallel all-reduce entry), FSDP2's per unit (a layer with parameters)."""
    linears = sum(len(layer.tp_allreduce_bytes_per_sample) for layer in stage) if tp > 1 else 0
    units = sum(1 for layer in stage if layer.params) if zero >= 2 else 0
    return linears * extra.tp_linear[direction] + units * extra.fsdp_unit[direction]


def _stepped_tensors(stage: list[LayerProfile], dp: int, zero: int) -> float:
    """The parameter tensors a rank's optimizer steps: ZeRO-1 partitions whole tensors over the dp ranks (torch's
    ZeroRedundancyOptimizer), FSDP2 (ZeRO-2/3) gives every rank a shard of each, otherwise each rank has all."""
    tensors = sum(len(layer.tensors) for layer in stage)
    return tensors / dp if zero == 1 else tensors


def _dtensors(stage: list[LayerProfile], tp: int, zero: int) -> int:
    """A stage's parameter tensors that are DTensors on a rank: all of them under FSDP2 (ZeRO-2/3), the split ones
    under tensor parallelism."""
    if zero >= 2:
        return sum(len(layer.tensors) for layer in stage)
    return sum(p.tp_dim is not None for layer in stage for p in layer.tensors) if tp > 1 else 0


def _tp_share(layer: LayerProfile, tp: int) -> float:
    """The part of a layer's compute one of tp ranks does: its split parameters' share is divided."""
    return 1 - layer.tp_params / layer.params * (1 - 1 / tp) if layer.params else 1.0


def _tp_allreduces(stage: list[LayerProfile], direction: int, size: int, tp: int, ab: "AlphaBeta") -> float:
    if tp == 1:
        return 0.0
    return sum(ab.ring(entry[direction] * size, tp) for layer in stage for entry in layer.tp_allreduce_bytes_per_sample
               if entry[direction])


def _dp_sync(layer_bytes: list[float], dp: int, zero: int, microbatches: int, ab: "AlphaBeta") -> float:
    if dp == 1:
        return 0.0
    if zero <= 1:  # torch's ZeroRedundancyOptimizer runs under DDP: its gradients are all-reduced whole
        reduce, gather = data_parallel.after_backward(zero, sum(layer_bytes), sum(layer_bytes),
                                                      lambda s: ab.ring(s, dp), lambda s: ab.gather(s, dp),
                                                      zero1="all-reduce")
        return reduce + gather
    gathers = 1 if zero == 2 else 2  # FSDP2: each layer gathered in forward (ZeRO-3: again in backward)
    return microbatches * sum(ab.gather(b, dp) * (1 + gathers) for b in layer_bytes if b)  # and reduce-scattered

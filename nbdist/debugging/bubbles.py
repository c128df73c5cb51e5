"""Where a measured pipeline step's idle time comes from, and the one change that would save the most.

Each rank's idle time in a measured step (the step's length minus the rank's compute) is split into five causes, by
replaying the step's own schedule in the simulator (schedules/simulate.py) with what was measured, one cause at a
time, and by reading the measured spans:
- warm-up / cool-down: the schedule's own bubble, the idle time it has even with equal stages and free messages
  (simulated with every stage at the stages' mean measured time);
- stage imbalance: what unequal stages add (simulated with each stage's own median time), with the slowest stage
  named and how much slower it is than the mean;
- transfer: what the messages' measured latency adds (simulated with it);
- host overhead: the gaps between one action's end and the next one's start on the rank (Python between actions);
- waiting on a late peer: the rest, time in receives that the simulation does not explain (a peer slowed down by
  its own overhead, an action slower than its median, a machine busy with something else);
- stepping (tick by tick), only in a step a Stepper ran: the gaps that span the boundary between two of its calls
  (a rank that finished its tick early waits for the next call; each call starts with a barrier and wakes the
  rank up). A full-speed step has neither: this is stepping's own cost.
Per rank the simulated causes are clipped at zero and, where together they exceed what the rank really idled,
scaled down to fit, so each rank's bar sums to its measured idle time.

Then the candidate changes (stages balanced, twice the micro-batches, interleaving with v = 2, a zero-bubble
schedule) are each simulated with the same measured times, plus the measured overheads, and the best is advised with
its predicted step time.

Plain data in and out: a measured Timeline and its Schedule (Pipeline.bubbles() passes them); drawing in
viz/bubbles.py.
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field

from nbdist.errors import DistUsageError
from nbdist.schedules.generators import build
from nbdist.schedules.simulate import Timeline, measured_durations

SCHEDULE, IMBALANCE, TRANSFER, LATE_PEER, HOST, STEPPING = (
    "warm-up / cool-down", "stage imbalance", "transfer", "waiting on a late peer", "host overhead",
    "stepping (tick by tick)")
CAUSES = (SCHEDULE, IMBALANCE, TRANSFER, LATE_PEER, HOST, STEPPING)
IMBALANCED = 1.1  # a stage this much slower than the mean is named as the imbalance


@dataclass
class Change:
    """A change to the pipeline and the step time the simulator predicts for it."""

    what: str
    step: float  # predicted step time, seconds


@dataclass(repr=False)
class BubbleBreakdown:
    """A measured step's idle time by rank and cause (seconds), and the changes that would shorten it."""

    step: float  # the measured step's length
    idle: dict[int, dict[str, float]]  # rank -> cause -> seconds
    simulated_idle: float  # the ideal's idle time, all ranks (the simulator's figure for this step)
    slowest_stage: tuple[int, float]  # (stage, its time / the mean stage time)
    changes: list[Change] = field(default_factory=list)  # best first
    name: str = ""

    def total(self, cause: str | None = None) -> float:
        """Idle seconds over all ranks: of one cause, or of all."""
        return sum(v for row in self.idle.values() for c, v in row.items() if cause is None or c == cause)

    def shares(self) -> dict[str, float]:
        """Each cause's share of all the idle time."""
        total = self.total()
        return {c: self.total(c) / total if total else 0.0 for c in CAUSES}

    def sentence(self) -> str:
        shares = self.shares()
        ranked = sorted(shares.items(), key=lambda kv: -kv[1])
        parts = [f"{cause} {share:.0%}" for cause, share in ranked if share >= 0.005]
        stage, ratio = self.slowest_stage
        slow = f"; stage {stage} takes {ratio:.2f}x the mean stage time" if ratio >= IMBALANCED else ""
        best = (f"; best change: {self.changes[0].what}, step {self.step * 1e3:.1f} ms -> "
                f"{self.changes[0].step * 1e3:.1f} ms predicted") if self.changes else ""
        points = self.total(STEPPING) / (len(self.idle) * self.step) if self.step else 0.0
        stepped = f"; stepping itself causes {points:.0%} of the {self.bubble():.0%} bubble" if points else ""
        return (f"idle {self.total() * 1e3:.1f} ms over {len(self.idle)} ranks: " + ", ".join(parts) + slow + stepped
                + best)

    def bubble(self) -> float:
        """The measured step's bubble: idle share of all ranks' time."""
        ranks = len(self.idle)
        return self.total() / (ranks * self.step) if ranks and self.step else 0.0

    def rows(self) -> list[dict]:
        return [{"rank": r, **{c: round(v * 1e3, 3) for c, v in row.items()}} for r, row in self.idle.items()]

    def figure(self, title: str | None = None):
        """A stacked bar per rank, one colour per cause (viz/bubbles.py)."""
        from nbdist.viz.bubbles import bubble_figure

        return bubble_figure(self, title=title)

    def __repr__(self) -> str:
        return f"<BubbleBreakdown {self.name}: {self.sentence()}>"


def decompose(measured: Timeline, schedule, pipelines: list[list[int]] | None = None) -> BubbleBreakdown:
    """The breakdown of `measured` (a step of `schedule`, in seconds; several pipelines side by side when
    `pipelines` lists their ranks in pipeline-rank order)."""
    durations = measured_durations(measured, schedule.stages, schedule.chunks)
    if durations is None:
        raise DistUsageError("this step has no complete forward and backward of every stage to measure")
    pipeline_rank = _pipeline_ranks(measured, pipelines or measured.pipelines)
    sims = [schedule.simulate(**dict(_balanced(durations), comm=0.0)), schedule.simulate(**dict(durations, comm=0.0)),
            schedule.simulate(**durations)]
    boundaries = call_boundaries(measured)
    idle = {}
    for rank, row in measured.spans.items():
        p = pipeline_rank[rank]
        levels = [_idle(sim, p) for sim in sims]
        simulated = [max(0.0, levels[0]), max(0.0, levels[1] - levels[0]), max(0.0, levels[2] - levels[1])]
        stepping = _across_calls(row, boundaries)
        idle[rank] = _fit(measured.makespan - sum(s.busy for s in row),
                          _host_overhead(row, measured.start) - stepping, simulated, stepping)
    ideal, slowest = sims[2], _slowest(durations)
    overhead = measured.makespan - ideal.makespan
    return BubbleBreakdown(measured.makespan, idle, sum(_idle(ideal, p) for p in ideal.spans), slowest,
                           _changes(schedule, durations, slowest, overhead), name=measured.name)


def _pipeline_ranks(measured: Timeline, pipelines: list[list[int]]) -> dict[int, int]:
    if not pipelines:
        return {rank: i for i, rank in enumerate(sorted(measured.spans))}
    return {rank: i for pipeline in pipelines for i, rank in enumerate(pipeline)}


def _balanced(durations: dict) -> dict:
    """The measured durations with every stage at the stages' mean (the message latency kept)."""
    return {k: [statistics.fmean(v)] * len(v) if isinstance(v, list) else v for k, v in durations.items()}


def _idle(timeline: Timeline, rank: int) -> float:
    return timeline.makespan - timeline.busy_time.get(rank, 0.0)


def _host_overhead(row: list, step_start: float) -> float:
    """Gaps on a rank between one action's end and the next one's start, and before its first action."""
    gaps = row[0].start - step_start if row else 0.0
    return gaps + sum(max(0.0, b.start - a.end) for a, b in zip(row, row[1:]))


def stepping_cost(timeline: Timeline) -> float:
    """Seconds of idle time (all ranks) that stepping itself caused in a stepped step's work timeline: the gaps that
    span a boundary between two of the Stepper's calls. 0 at full speed."""
    boundaries = call_boundaries(timeline)
    return sum(_across_calls(row, boundaries) for row in timeline.spans.values())


def call_boundaries(timeline: Timeline) -> list[float]:
    """Where a stepped step's calls meet on its work timeline (the cuts' places), in order; none at full speed."""
    return sorted(at for at, _ in timeline.cuts)


def spans_a_boundary(boundaries: list[float], start: float, end: float) -> bool:
    """Whether the stretch from `start` to `end` holds one of the (ordered) call boundaries."""
    i = bisect.bisect_left(boundaries, start)
    return i < len(boundaries) and boundaries[i] <= end


def median_compute(timeline: Timeline) -> float:
    """The median compute time of one action in the timeline (0 when it has none)."""
    busy = [s.busy for row in timeline.spans.values() for s in row if s.action.is_compute]
    return statistics.median(busy) if busy else 0.0


def _across_calls(row: list, boundaries: list[float]) -> float:
    """The gaps of a stepped rank that span a boundary between two calls."""
    return sum(b.start - a.end for a, b in zip(row, row[1:])
               if b.start > a.end and spans_a_boundary(boundaries, a.end, b.start))


def _fit(idle: float, host: float, simulated: list[float], stepping: float = 0.0) -> dict[str, float]:
    """One rank's idle time by cause, summing to `idle`: stepping's and the host's gaps as measured, the simulated
    causes scaled down if they do not fit beside them, the rest waiting on a late peer."""
    stepping = min(stepping, idle)
    host = min(max(0.0, host), idle - stepping)
    room = max(0.0, idle - host - stepping)
    scale = min(1.0, room / sum(simulated)) if sum(simulated) > 0 else 0.0
    parts = [s * scale for s in simulated]
    return dict(zip(CAUSES, [*parts, max(0.0, room - sum(parts)), host, stepping]))


def _slowest(durations: dict) -> tuple[int, float]:
    """The stage whose forward + backward (+ weight) is longest, and how many times the mean stage's it is."""
    per_stage = [sum(values) for values in zip(*(durations[k] for k in ("forward", "backward", "weight")
                                                 if k in durations))]
    mean = statistics.fmean(per_stage)
    stage = max(range(len(per_stage)), key=per_stage.__getitem__)
    return stage, per_stage[stage] / mean if mean else 1.0


def _changes(schedule, durations: dict, slowest: tuple[int, float], overhead: float) -> list[Change]:
    """Each candidate change simulated with the measured times, plus the measured overhead (the step's length beyond
    the ideal's) grown with the number of actions a rank runs; best first. `slowest`: (stage, x the mean)."""
    changes = []
    overhead = max(0.0, overhead)
    stage, ratio = slowest
    if ratio >= IMBALANCED:
        changes.append(Change(f"balance the stages (stage {stage} takes {ratio:.2f}x the mean)",
                              schedule.simulate(**_balanced(durations)).makespan + overhead))
    p, m, v = schedule.ranks, schedule.microbatches, schedule.chunks
    for what, name, micro, chunks in (
            (f"twice the micro-batches (m = {2 * m})", schedule.name, 2 * m, v),
            (f"interleave with v = {2 * v} (interleaved-1f1b)", "interleaved-1f1b", m, 2 * v),
            ("a zero-bubble schedule (zb-h1)", "zb-h1", m, 1)):
        if name == schedule.name and micro == m and chunks == v:
            continue
        predicted = _simulated(name, p, micro, chunks, schedule, durations)
        if predicted is not None:
            changes.append(Change(what, predicted + overhead * micro * chunks / (m * v)))
    return sorted(changes, key=lambda c: c.step)


def _simulated(name: str, p: int, m: int, v: int, schedule, durations: dict) -> float | None:
    """The makespan of schedule `name` (p ranks, m micro-batches, v chunks) with the measured times: per
    micro-batch times scale with the micro-batch's size (m / the measured m), a rank's stage splits into v chunks
    (the simulator divides by v), a zero-bubble schedule splits the backward in halves."""
    try:
        other = build(name, p, m, v)
    except DistUsageError:
        return None
    size = schedule.microbatches / m
    per_rank = {k: _per_rank(durations[k], schedule) for k in ("forward", "backward", "weight") if k in durations}
    stage_of = [s % p for s in range(p * v)]
    times = {k: [per_rank[k][r] * size for r in stage_of] for k in per_rank}
    if name == "zb-h1" and "weight" not in times:
        times["backward"], times["weight"] = [b / 2 for b in times["backward"]], [b / 2 for b in times["backward"]]
    return other.simulate(**times, comm=durations["comm"]).makespan


def _per_rank(values: list[float], schedule) -> list[float]:
    """A value per stage (p x v stages, each value a chunk's time x v) as one per rank: the rank's whole stage."""
    p, v = schedule.ranks, schedule.chunks
    return [sum(values[s] for s in range(r, p * v, p)) / v for r in range(p)]

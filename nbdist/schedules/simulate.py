"""Checking and simulating schedules, and the Timeline both simulated and measured steps are drawn from.

Semantics shared with the executor: a send never blocks (it is buffered, like isend); a receive blocks until the
matching send has happened; a compute action needs its inputs (its forward's input, its backward's gradient).
`requirements` states these once; `ready` (the check and the stepper's ticks) and `simulate` (the clock) read them.

Duration convention of `simulate`: `forward` and `backward` are the times of one micro-batch through one rank's
share of the model. With v chunks per rank each chunk's action takes duration / v, so every schedule does the same
total work and their makespans compare directly. Sends and receives take no compute time; a message arrives `comm`
after its send.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbdist.errors import DistUsageError
from nbdist.schedules.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
)

# ---------------------------------------------------------------------------------------------------------------
# Dependencies
# ---------------------------------------------------------------------------------------------------------------


def requirements(a: Action, last_stage: int, same_rank: Callable[[int, int], bool] | None = None
                 ) -> list[tuple[Action, ...]]:
    """What `a` waits for: a list of needs, each satisfied by any one of its alternatives.

    Alternatives exist because an input arrives either by message (RECV_F) or, when the previous stage sits on the
    same rank (several chunks), directly from that stage's forward. `same_rank(s, t)` says whether stages s and t
    share a rank (a schedule's placement); without it both ways are taken as possible.
    """
    s, j = a.stage, a.microbatch
    local = (lambda t: True) if same_rank is None else (lambda t: same_rank(s, t))
    if a.kind in (RECV_F, RECV_B):
        return [(a.matching(),)]
    if a.kind == SEND_F:
        return [(Action(s, FORWARD, j),)]
    if a.kind == SEND_B:
        return [(Action(s, BACKWARD, j), Action(s, BACKWARD_INPUT, j))]
    if a.kind == FORWARD:
        return [] if s == 0 else [(Action(s, RECV_F, j),) + ((Action(s - 1, FORWARD, j),) if local(s - 1) else ())]
    if a.kind in (BACKWARD, BACKWARD_INPUT):
        needs = [(Action(s, FORWARD, j),)]
        if s != last_stage:
            from_next = (Action(s + 1, BACKWARD, j), Action(s + 1, BACKWARD_INPUT, j)) if local(s + 1) else ()
            needs.append((Action(s, RECV_B, j),) + from_next)
        return needs
    if a.kind == BACKWARD_WEIGHT:
        return [(Action(s, BACKWARD_INPUT, j),)]
    raise ValueError(a)


def same_rank_of(schedule) -> Callable[[int, int], bool]:
    """Whether two stages of `schedule` live on the same rank (a message is needed between them otherwise)."""
    return lambda s, t: schedule.rank_of(s) == schedule.rank_of(t)


def ready(a: Action, done: set[Action] | Mapping[Action, Any], last_stage: int,
          same_rank: Callable[[int, int], bool] | None = None) -> bool:
    """Can `a` run now, given the actions already done anywhere (a set, or a dict keyed by action)?"""
    return _met(requirements(a, last_stage, same_rank), done)


def _met(needs: list[tuple[Action, ...]], done: set[Action] | Mapping[Action, Any]) -> bool:
    """Every need has one of its alternatives done."""
    return all(any(x in done for x in alternatives) for alternatives in needs)


def needs_of(schedule) -> dict[Action, list[tuple[Action, ...]]]:
    """`requirements` of every action of `schedule`, worked out once: a play asks for an action's needs at every
    tick it waits, and at cluster scale (tens of thousands of actions) working them out again each time is most of
    the simulation's time."""
    last, same = schedule.stages - 1, same_rank_of(schedule)
    return {a: requirements(a, last, same) for acts in schedule.program.values() for a in acts}


def _inputs_at(a: Action, needs: list[tuple[Action, ...]], finished: Mapping[Action, float], comm: float) -> float:
    """When `a`'s inputs are all there, given its needs and when each done action finished (a message adds
    `comm`)."""
    time = 0.0
    for alternatives in needs:
        time = max(time, max(finished[x] for x in alternatives if x in finished))
    return time + comm if a.kind in (RECV_F, RECV_B) else time


# ---------------------------------------------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------------------------------------------


def _missing(schedule) -> list[str]:
    """Every (stage, micro-batch) needs one F and either one B or one I and one W."""
    seen: dict[Action, int] = {}
    for acts in schedule.program.values():
        for a in acts:
            seen[a] = seen.get(a, 0) + 1
    problems = [f"{a} appears {n} times" for a, n in seen.items() if n > 1]
    for s in range(schedule.stages):
        for j in range(schedule.microbatches):
            if Action(s, FORWARD, j) not in seen:
                problems.append(f"no forward {Action(s, FORWARD, j)}")
            full = Action(s, BACKWARD, j) in seen
            split = Action(s, BACKWARD_INPUT, j) in seen and Action(s, BACKWARD_WEIGHT, j) in seen
            if full == split:
                problems.append(f"stage {s} micro-batch {j} needs one backward: B, or I and W")
    return problems


def ticks(schedule, needs: Mapping[Action, list[tuple[Action, ...]]] | None = None
          ) -> Iterator[list[tuple[int, Action]]]:
    """The lockstep rounds: at each tick every rank runs its next action if that action is ready.

    Yields, per tick, the (rank, action) pairs that run. A tick where nothing can run while actions remain is a
    deadlock: refused, naming the rank, the tick and the action it would wait on forever. `needs`: the schedule's
    `needs_of`, where the caller has it already.
    """
    needs = needs_of(schedule) if needs is None else needs
    position = {r: 0 for r in schedule.program}
    done: set[Action] = set()
    tick = 0
    while any(position[r] < len(acts) for r, acts in schedule.program.items()):
        runnable = [
            (r, acts[position[r]])
            for r, acts in schedule.program.items()
            if position[r] < len(acts) and _met(needs[acts[position[r]]], done)
        ]
        if not runnable:
            rank, acts = next((r, acts) for r, acts in schedule.program.items() if position[r] < len(acts))
            blocked = acts[position[rank]]
            raise DistUsageError(
                f"schedule {schedule.name!r} deadlocks: rank {rank} would wait forever at tick {tick} "
                f"on {blocked} (action {position[rank]} of its list): what it needs is never produced before"
            )
        yield runnable
        for r, a in runnable:
            done.add(a)
            position[r] += 1
        tick += 1


def _refuse_incomplete(schedule) -> None:
    problems = _missing(schedule)
    if problems:
        raise DistUsageError(f"schedule {schedule.name!r} is incomplete: " + "; ".join(problems[:5]))


def check(schedule) -> None:
    """Refuse a schedule that misses actions or would deadlock, naming the rank, the tick and the action."""
    _refuse_incomplete(schedule)
    for _ in ticks(schedule):
        pass


# ---------------------------------------------------------------------------------------------------------------
# Timeline
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One action on one rank: when it started and ended, and how much of that it spent waiting for a message."""

    action: Action
    start: float
    end: float
    wait: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Compute time in this span (sends and receives do none; a measured compute span may include a wait)."""
        return self.duration - self.wait if self.action.is_compute else 0.0


@dataclass
class Timeline:
    """Per rank, the spans of one step, in the order the rank ran them; the same for simulated and measured steps.

    `unit` names the time axis: "s" for a measured step, "" for a simulation (the unit of its durations), "tick"
    for the lockstep ticks a Stepper advances by (every action one tick long).
    `cuts` are the pauses taken out of a measured step that was stepped: (where on this axis, seconds removed).
    Stepping waits for a person between calls; that time is no rank's work, so the work timeline closes the gap
    and remembers where, so a chart can say so.
    `pipelines`: the ranks of each pipeline when several run side by side (data parallelism), each list in
    pipeline-rank order; empty means one pipeline of all the ranks.
    """

    spans: dict[int, list[Span]]
    unit: str = "s"
    name: str = ""
    cuts: list[tuple[float, float]] = field(default_factory=list)
    pipelines: list[list[int]] = field(default_factory=list)
    pipeline_names: list[str] = field(default_factory=list)  # one per pipeline ("replica 1", "dp 0, tp 1"); optional

    @classmethod
    def from_spans(cls, spans: Mapping[int, Iterable[Any]], unit: str = "s", name: str = "",
                   cuts: Iterable[tuple[float, float]] = (), pipelines: Iterable[Iterable[int]] = (),
                   pipeline_names: Iterable[str] = ()) -> Timeline:
        """A timeline from per-rank spans: (action, start, end[, wait]) tuples or objects with those attributes.

        Actions may be strings ('0F3') or Actions. Times are shifted so the earliest start is 0, because a measured
        clock (time.perf_counter) starts anywhere; all ranks must share that clock. `cuts` are on the same clock.
        """
        rows = {int(rank): [_as_span(item) for item in items] for rank, items in spans.items()}
        starts = [s.start for row in rows.values() for s in row]
        origin = min(starts) if starts else 0.0
        shifted = {
            rank: [Span(s.action, s.start - origin, s.end - origin, s.wait) for s in row]
            for rank, row in sorted(rows.items())
        }
        return cls(shifted, unit=unit, name=name, cuts=[(at - origin, removed) for at, removed in cuts],
                   pipelines=[list(p) for p in pipelines], pipeline_names=list(pipeline_names))

    @property
    def paused(self) -> float:
        """Seconds of pauses taken out of this timeline (0 unless it was stepped)."""
        return sum(removed for _, removed in self.cuts)

    @property
    def ranks(self) -> int:
        return len(self.spans)

    @property
    def start(self) -> float:
        return min((s.start for row in self.spans.values() for s in row), default=0.0)

    @property
    def end(self) -> float:
        return max((s.end for row in self.spans.values() for s in row), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end, over all ranks."""
        return self.end - self.start

    @property
    def busy_time(self) -> dict[int, float]:
        """rank -> time spent computing."""
        return {rank: sum(s.busy for s in row) for rank, row in self.spans.items()}

    @property
    def busy_fraction(self) -> dict[int, float]:
        """rank -> share of the makespan it spent computing."""
        makespan = self.makespan
        return {rank: busy / makespan if makespan else 0.0 for rank, busy in self.busy_time.items()}

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: 1 - total compute time / (ranks x makespan)."""
        capacity = self.ranks * self.makespan
        return 1.0 - sum(self.busy_time.values()) / capacity if capacity else 0.0

    @property
    def wait_time(self) -> dict[int, float]:
        """rank -> time spent inside receives (and compute spans) waiting for a message."""
        return {rank: sum(s.wait for s in row) for rank, row in self.spans.items()}

    @property
    def peak_activations(self) -> dict[int, int]:
        """rank -> most (stage, micro-batch) activations held at once.

        An activation is made by F and freed by B, or by W when the backward is split (W still needs the stage's
        inputs). With v chunks each count is one chunk's activation, 1/v of a rank's share of the model.
        """
        return {rank: _peak_held(row) for rank, row in self.spans.items()}

    def figure(self, **kwargs):
        """Plotly Gantt of this timeline (see nbdist.viz.timeline.timeline_figure for the options)."""
        from nbdist.viz.timeline import timeline_figure

        return timeline_figure(self, **kwargs)

    def __repr__(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        paused = f", pauses removed {self.paused:.3g} s" if self.cuts else ""
        return (f"<Timeline {self.name or ''}: {self.ranks} ranks, makespan {self.makespan:.4g}{unit}, "
                f"bubble {self.bubble_fraction:.1%}{paused}>")


def _as_span(item: Any) -> Span:
    if isinstance(item, Span):
        return item
    if isinstance(item, (tuple, list)):
        action, start, end, *rest = item
        wait = rest[0] if rest else 0.0
    else:
        action, start, end, wait = item.action, item.start, item.end, getattr(item, "wait", 0.0)
    return Span(Action.parse(action), float(start), float(end), float(wait))


def _peak_held(row: list[Span]) -> int:
    """Replay one rank's spans in order, counting live (stage, micro-batch) activations."""
    held = peak = 0
    for span in row:
        held += span.action.activations_held
        peak = max(peak, held)
    return peak


# ---------------------------------------------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------------------------------------------


Durations = float | Sequence[float]  # one value for every stage, or one per stage (uneven stages)


def durations(schedule, forward: Durations = 1.0, backward: Durations = 2.0,
              weight: Durations | None = None) -> dict[tuple[int, str], float]:
    """Compute time of each (stage, action kind) for `schedule`, following the module's duration convention.

    weight=None: backward is the whole backward; a split schedule spends half of it in I and half in W.
    weight given: the backward is `backward` + `weight`; a split schedule spends `backward` in I and `weight` in W,
    one that does not split spends both in B. So one call compares every schedule on the same work.
    Each argument is one number for all stages or a sequence with one per stage (measured, uneven stages).
    """
    f, b = _per_stage(schedule, forward), _per_stage(schedule, backward)
    w = None if weight is None else _per_stage(schedule, weight)
    times = {}
    for s in range(schedule.stages):
        if w is None:
            kinds = {FORWARD: f[s], BACKWARD: b[s], BACKWARD_INPUT: b[s] / 2, BACKWARD_WEIGHT: b[s] / 2}
        else:
            kinds = {FORWARD: f[s], BACKWARD: b[s] + w[s], BACKWARD_INPUT: b[s], BACKWARD_WEIGHT: w[s]}
        times.update({(s, kind): t / schedule.chunks for kind, t in kinds.items()})
    return times


def _per_stage(schedule, value) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * schedule.stages
    values = [float(v) for v in value]
    if len(values) != schedule.stages:
        raise DistUsageError(f"got {len(values)} per-stage durations for {schedule.stages} stages")
    return values


def simulate(schedule, forward: Durations = 1.0, backward: Durations = 2.0, weight: Durations | None = None,
             comm: float = 0.0) -> Timeline:
    """Play the schedule on an ideal machine: each rank runs its list in order, every action as soon as possible.

    An action starts at max(the rank's clock, when its inputs are there). Compute spans last their duration; a send
    lasts nothing; a receive lasts as long as the rank waited for the message, and records that as its wait.
    """
    needs, order = play_order(schedule)
    return replay(schedule, needs, order, durations(schedule, forward, backward, weight), comm)


def play_order(schedule) -> tuple[dict[Action, list[tuple[Action, ...]]], list[tuple[int, Action]]]:
    """The schedule's needs and the (rank, action) pairs in the order its ticks run them: what a simulation of it
    plays whatever the durations, so a caller that simulates one schedule under many durations (the planner)
    works it out once. An incomplete schedule is refused here."""
    _refuse_incomplete(schedule)
    needs = needs_of(schedule)
    return needs, [pair for runnable in ticks(schedule, needs) for pair in runnable]


def replay(schedule, needs: Mapping[Action, list[tuple[Action, ...]]], order: Sequence[tuple[int, Action]],
           times: dict[tuple[int, str], float], comm: float = 0.0) -> Timeline:
    """`simulate` from its `play_order` and `durations`: the actions are played in the order of the ticks, each
    when its rank and its inputs are ready (an action never needs one of its own tick: it ran only if ready
    before that tick)."""
    clock = {r: 0.0 for r in schedule.program}
    finished: dict[Action, float] = {}
    spans: dict[int, list[Span]] = {r: [] for r in sorted(schedule.program)}
    for rank, a in order:
        span = _play(a, clock[rank], _inputs_at(a, needs[a], finished, comm), times)
        spans[rank].append(span)
        clock[rank] = finished[a] = span.end
    return Timeline(spans, unit="", name=schedule.name)


def _play(a: Action, clock: float, inputs_at: float, times: dict[str, float]) -> Span:
    if a.kind in (RECV_F, RECV_B):
        end = max(clock, inputs_at)
        return Span(a, clock, end, wait=end - clock)
    start = max(clock, inputs_at)
    return Span(a, start, start + times.get((a.stage, a.kind), 0.0))


def measured_durations(timelines: Timeline | Iterable[Timeline], stages: int, chunks: int = 1) -> dict | None:
    """simulate() arguments that describe measured steps: per stage and kind the MEDIAN compute time, and the
    median message latency.

    Why the median: a measured step has cold outliers (the first backward on a fresh process can take many times
    the others: allocator, autograd warm-up); a mean lets one of them stretch a whole stage of the ideal. The median
    over the micro-batches of a step, and over several steps when given several timelines (`Pipeline` passes its
    last few), is the warm duration. forward/backward/weight are lists with one entry per stage, following the
    duration convention (a chunk's time times `chunks`), so stages that really differ (the last one also computes
    the loss) stay different. comm is the median latency of the messages whose receiver was already waiting: from
    the send's start to the receive's end (one clock on one host). None until every stage has a forward and a
    backward.
    """
    timelines = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    spans = [s for t in timelines for row in t.spans.values() for s in row]
    median: dict[str, list] = {}
    for kind in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
        per_stage = [[s.busy for s in spans if s.action.kind == kind and s.action.stage == st] for st in range(stages)]
        if all(per_stage):
            median[kind] = [chunks * statistics.median(x) for x in per_stage]
    if FORWARD not in median or not (BACKWARD in median or BACKWARD_INPUT in median):
        return None
    latencies = [latency for t in timelines for latency in _message_latencies(t)]
    out = {"forward": median[FORWARD], "comm": max(0.0, statistics.median(latencies)) if latencies else 0.0}
    if BACKWARD in median:
        out["backward"] = median[BACKWARD]
    else:
        out["backward"], out["weight"] = median[BACKWARD_INPUT], median.get(BACKWARD_WEIGHT, [0.0] * stages)
    return out


def _message_latencies(timeline: Timeline) -> list[float]:
    """Send start to receive end, for the receives that waited (their message was not there yet)."""
    spans = [s for row in timeline.spans.values() for s in row]
    sent = {s.action: s.start for s in spans if s.action.kind in (SEND_F, SEND_B)}
    return [
        s.end - sent[s.action.matching()]
        for s in spans
        if s.action.kind in (RECV_F, RECV_B) and s.wait > 0 and s.action.matching() in sent
    ]

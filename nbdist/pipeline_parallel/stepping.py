"""Ticks: the lockstep clock a Stepper advances by, and the two timelines a stepped step is read on.

At tick t every rank runs its next action if that action's inputs exist by then (sends are buffered, a receive
needs its send, a backward its gradient). Stopping all ranks at a tick boundary is therefore always safe: no rank
waits for a message that another rank has not sent yet. `state_at` replays the ticks to say what each rank just
did, which messages are in flight and how many micro-batches' activations each rank holds.

A stepped step is measured in seconds like a full-speed one, but between two calls (two clicks on Step) the ranks
wait for a person. `work_timeline` takes those pauses out, so the chart and its bubble show the work; `tick_timeline`
puts every action at its tick instead, the axis the Stepper itself moves along.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nbdist.schedules.actions import RECV_B, RECV_F, SEND_B, SEND_F
from nbdist.schedules.simulate import Span, Timeline
from nbdist.schedules.simulate import ticks as lockstep


def action_ticks(schedule) -> dict[int, list[int]]:
    """rank -> the tick of each of its actions, from the same lockstep rounds the deadlock check plays."""
    out: dict[int, list[int]] = {r: [] for r in schedule.program}
    for tick, runnable in enumerate(lockstep(schedule)):
        for rank, _ in runnable:
            out[rank].append(tick)
    return out


@dataclass
class TickState:
    """What the pipeline looks like after `tick` ticks."""

    tick: int
    total_ticks: int
    last_actions: dict[int, str | None]  # rank -> the action it ran in the last tick (None: idle then)
    in_flight: list[str]  # messages sent whose receive has not run yet, in words (message_in_words)
    activations: dict[int, int]  # rank -> micro-batches whose activations it holds

    def __str__(self) -> str:
        lines = [f"tick {self.tick} of {self.total_ticks}"]
        for rank, action in self.last_actions.items():
            lines.append(f"  rank {rank}: {action or 'idle':<10} holds {self.activations[rank]} activation(s)")
        lines.append(f"  in flight: {', '.join(self.in_flight) or 'nothing'}")
        return "\n".join(lines)


def state_at(schedule, ticks: dict[int, list[int]], tick: int) -> TickState:
    sent, received, held = set(), set(), {}
    last_actions: dict[int, str | None] = {}
    for rank, acts in schedule.program.items():
        held[rank] = 0
        last_actions[rank] = None
        for a, t in zip(acts, ticks[rank]):
            if t >= tick:
                break
            if t == tick - 1:
                last_actions[rank] = str(a)
            if a.kind in (SEND_F, SEND_B):
                sent.add(a)
            elif a.kind in (RECV_F, RECV_B):
                received.add(a.matching())
            held[rank] += a.activations_held
    in_flight = [message_in_words(s, schedule) for s in sorted(sent - received)]
    return TickState(tick, total_ticks(ticks), last_actions, in_flight, held)


def message_in_words(send, schedule) -> str:
    """A send and its receive as the view says them: 'rank 0 sends F2 → rank 1 receives it' (F2: micro-batch 2's
    activation, as the timeline's bars name it; B2 its gradient), not the schedule's '0SEND_F2 -> 1RECV_F2'."""
    what = f"{'F' if send.kind == SEND_F else 'B'}{send.microbatch}"
    return (f"rank {schedule.rank_of(send.stage)} sends {what} → rank {schedule.rank_of(send.peer_stage())} "
            "receives it")


def total_ticks(ticks: dict[int, list[int]]) -> int:
    """How many ticks the whole step takes."""
    return 1 + max((t[-1] for t in ticks.values() if t), default=-1)


def tick_timeline(schedule, ticks: dict[int, list[int]], upto: int | None = None, name: str = "") -> Timeline:
    """Every action at its tick (one tick long), for the ticks before `upto` (None: the whole step).

    A normal Timeline in unit "tick", so the one Gantt function draws it; its bubble is the share of rank-ticks
    without compute (sends and receives take a tick of their own here).
    """
    spans = {
        rank: [Span(a, float(t), float(t + 1)) for a, t in zip(acts, ticks[rank]) if upto is None or t < upto]
        for rank, acts in schedule.program.items()
    }
    return Timeline(spans, unit="tick", name=name or f"{schedule.name} (ticks)")


def work_timeline(reports: Mapping[int, Mapping], name: str = "", pipelines=(), pipeline_names=()) -> Timeline:
    """The measured timeline of a step with the pauses between calls taken out.

    reports: rank -> {"spans": [(action, start, end, wait, call), ...], "calls": [start of call 0, call 1, ...]},
    as the ranks report them (nbdist/pipeline_parallel/ranks/pipeline.advance): every call starts with a barrier of
    the ranks, and "calls" holds when each rank left it. Call k is shifted left so that it starts where the work of
    the calls before it ended; the time removed is kept in the timeline's `cuts`. Within a call nothing is moved, so
    the idle time the schedule (or the tick lockstep) causes stays. A full-speed step is one call: nothing is cut.
    """
    reports = on_one_clock(reports)
    origins: dict[int, float] = {}
    for report in reports.values():
        for call, started in enumerate(report.get("calls", ())):
            origins[call] = min(origins.get(call, started), started)
    by_call: dict[int, list[tuple[int, tuple]]] = {}
    for rank, report in reports.items():
        for item in report.get("spans", ()):
            by_call.setdefault(item[4] if len(item) > 4 else 0, []).append((rank, tuple(item)))
    rows: dict[int, list[tuple]] = {rank: [] for rank in reports}
    cuts, shift, work_end = [], 0.0, None
    for call in sorted(by_call):
        items = by_call[call]
        origin = origins.get(call, min(item[1] for _, item in items))
        if work_end is not None and origin - shift > work_end:
            cuts.append((work_end, origin - shift - work_end))
            shift = origin - work_end
        for rank, (action, start, end, wait, *_) in items:
            rows[rank].append((action, start - shift, end - shift, wait))
        work_end = max([end - shift for _, (_, _, end, *_) in items] + ([work_end] if work_end is not None else []))
    return Timeline.from_spans(rows, unit="s", name=name, cuts=cuts, pipelines=pipelines,
                               pipeline_names=pipeline_names)


def on_one_clock(reports: Mapping[int, Mapping]) -> dict[int, Mapping]:
    """Reports of ranks on other hosts moved onto the first rank's host clock.

    perf_counter is one clock per host, not across hosts. Every call starts with a barrier that all ranks leave at
    (nearly) the same moment, so a rank on another host is shifted, call by call, by the difference between when it
    and the first rank left that barrier (the barrier's own skew: microseconds on one network). Ranks on the first
    rank's host already share its clock and are left as measured."""
    if not reports:
        return dict(reports)
    first = reports[min(reports)]
    host, reference = first.get("host"), list(first.get("calls", ()))
    out = {}
    for rank, report in reports.items():
        calls = list(report.get("calls", ()))
        if report.get("host") == host or len(calls) != len(reference):
            out[rank] = report
            continue
        shift = [ref - own for ref, own in zip(reference, calls)]
        spans = [(a, start + shift[c], end + shift[c], wait, c)
                 for a, start, end, wait, c in (tuple(item) + (0,) * (5 - len(item)) for item in report.get("spans", ()))]
        out[rank] = {**report, "spans": spans, "calls": reference}
    return out

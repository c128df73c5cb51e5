"""Measured pipeline steps as a Chrome / Perfetto trace: one track per rank, every action a slice, every idle
stretch a slice named by its cause.

Open the file in https://ui.perfetto.dev (or chrome://tracing): steps follow each other on one time axis, each rank
is a track (a thread of the process "pipeline"), and an idle stretch says why the rank idled there: waiting for a
message (and from which rank), stepping's gap between two tick calls, host overhead between actions, or the end of
the step (waiting for the other ranks). Each step also carries its bubble breakdown (debugging/bubbles.py) as the
arguments of a slice on a track of its own, so the totals by cause sit beside the picture.

Plain data in (Timelines, their Schedule), a JSON-ready dict out; `write()` saves it. Chrome's trace event format:
complete events ("ph": "X", microseconds) and thread names ("ph": "M").
"""
from __future__ import annotations

import json
from pathlib import Path

from nbdist.debugging.bubbles import HOST, STEPPING, call_boundaries, decompose, spans_a_boundary
from nbdist.errors import DistUsageError
from nbdist.schedules.actions import RECV_B, RECV_F
from nbdist.schedules.simulate import Timeline

PROCESS = 0
SUMMARY_TRACK = -1  # the track that holds each step's breakdown
GAP = 1e-6  # idle stretches shorter than this (seconds) are not written


def chrome_trace(steps: list[Timeline], schedule=None, ranks: list[int] | None = None) -> dict:
    """The trace of `steps` (measured timelines, in order), of every rank or of `ranks`; with `schedule`, each
    step's bubble breakdown is added."""
    events: list[dict] = [_name(PROCESS, None, "process_name", "pipeline")]
    chosen = sorted(set(ranks if ranks is not None else [r for t in steps for r in t.spans]))
    events += [_name(PROCESS, rank, "thread_name", f"rank {rank}") for rank in chosen]
    events.append(_name(PROCESS, SUMMARY_TRACK, "thread_name", "steps: idle by cause"))
    offset = 0.0
    for number, step in enumerate(steps):
        for rank in chosen:
            events += _rank_events(step, rank, offset, number)
        events.append(_summary(step, schedule, offset, number))
        offset += step.makespan
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(path: str | Path, steps: list[Timeline], schedule=None, ranks: list[int] | None = None) -> Path:
    """Save the trace as JSON at `path` (.json); returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(steps, schedule, ranks)), encoding="utf-8")
    return path


def _name(pid: int, tid: int | None, kind: str, name: str) -> dict:
    event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(name: str, start: float, end: float, rank: int, category: str, args: dict | None = None) -> dict:
    return {"ph": "X", "name": name, "cat": category, "pid": PROCESS, "tid": rank, "ts": start * 1e6,
            "dur": max(0.0, end - start) * 1e6, "args": args or {}}


def _rank_events(step: Timeline, rank: int, offset: float, number: int) -> list[dict]:
    """One rank's actions in one step and the idle stretches between them, each named by its cause."""
    row = step.spans.get(rank, [])
    boundaries = call_boundaries(step)
    events, clock = [], step.start
    for span in row:
        if span.start - clock > GAP:
            events.append(_idle(clock, span.start, rank, offset, boundaries, number))
        if span.action.kind in (RECV_F, RECV_B) and span.wait > GAP:
            message = "activation" if span.action.kind == RECV_F else "gradient"
            events.append(_slice(f"wait for stage {span.action.peer_stage()}'s {message}", offset + span.start,
                                 offset + span.end, rank, "idle",
                                 {"cause": "waiting for a message", "step": number, "action": str(span.action)}))
            continue
        events.append(_slice(str(span.action), offset + span.start, offset + span.end, rank,
                             "compute" if span.action.is_compute else "communication",
                             {"step": number, "busy_ms": round(span.busy * 1e3, 4)}))
        clock = max(clock, span.end)
    if step.end - clock > GAP:
        events.append(_slice("idle: end of step (waiting for the other ranks)", offset + clock, offset + step.end,
                             rank, "idle", {"cause": "end of step", "step": number}))
    return events


def _idle(start: float, end: float, rank: int, offset: float, boundaries: list[float], number: int) -> dict:
    cause = STEPPING if spans_a_boundary(boundaries, start, end) else HOST
    return _slice(f"idle: {cause}", offset + start, offset + end, rank, "idle", {"cause": cause, "step": number})


def _summary(step: Timeline, schedule, offset: float, number: int) -> dict:
    """The step as one slice on the summary track; its arguments: bubble, and idle ms by cause."""
    args = {"step": number, "bubble": round(step.bubble_fraction, 4), "makespan_ms": round(step.makespan * 1e3, 4)}
    if schedule is not None:
        try:
            breakdown = decompose(step, schedule)
        except DistUsageError:
            breakdown = None
        if breakdown is not None:
            args.update({f"idle_ms: {cause}": round(breakdown.total(cause) * 1e3, 4) for cause in breakdown.shares()})
            args["advice"] = breakdown.changes[0].what if breakdown.changes else ""
    return _slice(f"step {number}: bubble {step.bubble_fraction:.0%}", offset + step.start, offset + step.end,
                  SUMMARY_TRACK, "step", args)

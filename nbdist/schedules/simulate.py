"""Checking and simulating schedules.

Semantics shared with the executor: a send never blocks (it is buffered, like isend); a receive blocks until the
matching send has happened; a compute action needs its inputs (its forward's input, its backward's gradient).
"""
from __future__ import annotations

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


def ready(a: Action, done: set[Action], last_stage: int) -> bool:
    """Can `a` run now, given the set of actions already done anywhere?"""
    s, j = a.stage, a.microbatch
    if a.kind in (RECV_F, RECV_B):
        return a.matching() in done
    if a.kind == SEND_F:
        return Action(s, FORWARD, j) in done
    if a.kind == SEND_B:
        return Action(s, BACKWARD, j) in done or Action(s, BACKWARD_INPUT, j) in done
    if a.kind == FORWARD:
        return s == 0 or Action(s, RECV_F, j) in done or Action(s - 1, FORWARD, j) in done
    if a.kind in (BACKWARD, BACKWARD_INPUT):
        has_grad = (
            s == last_stage
            or Action(s, RECV_B, j) in done
            or Action(s + 1, BACKWARD, j) in done
            or Action(s + 1, BACKWARD_INPUT, j) in done
        )
        return Action(s, FORWARD, j) in done and has_grad
    if a.kind == BACKWARD_WEIGHT:
        return Action(s, BACKWARD_INPUT, j) in done
    raise ValueError(a)


def check(schedule) -> None:
    """Refuse a schedule that misses actions or would deadlock, naming the rank, the tick and the action."""
    problems = _missing(schedule)
    if problems:
        raise DistUsageError(f"schedule {schedule.name!r} is incomplete: " + "; ".join(problems[:5]))
    last = schedule.stages - 1
    position = {r: 0 for r in schedule.program}
    done: set[Action] = set()
    tick = 0
    while any(position[r] < len(acts) for r, acts in schedule.program.items()):
        runnable = [
            (r, acts[position[r]])
            for r, acts in schedule.program.items()
            if position[r] < len(acts) and ready(acts[position[r]], done, last)
        ]
        if not runnable:
            rank, acts = next((r, acts) for r, acts in schedule.program.items() if position[r] < len(acts))
            blocked = acts[position[rank]]
            raise DistUsageError(
                f"schedule {schedule.name!r} deadlocks: rank {rank} would wait forever at tick {tick} "
                f"on {blocked} (action {position[rank]} of its list): what it needs is never produced before"
            )
        for r, a in runnable:
            done.add(a)
            position[r] += 1
        tick += 1

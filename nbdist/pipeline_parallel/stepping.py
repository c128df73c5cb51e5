"""Ticks: the lockstep clock a Stepper advances by.

At tick t every rank runs its next action if that action's inputs exist by then (sends are buffered, a receive
needs its send, a backward its gradient). Stopping all ranks at a tick boundary is therefore always safe: no rank
waits for a message that another rank has not sent yet. `state_at` replays the ticks to say what each rank just
did, which messages are in flight and how many micro-batches' activations each rank holds.
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.schedules.actions import RECV_B, RECV_F, SEND_B, SEND_F
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
    in_flight: list[str]  # messages sent whose receive has not run yet, e.g. "0SEND_F3 -> 1RECV_F3"
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
    in_flight = [f"{s} -> {s.matching()}" for s in sorted(sent - received)]
    return TickState(tick, total_ticks(ticks), last_actions, in_flight, held)


def total_ticks(ticks: dict[int, list[int]]) -> int:
    """How many ticks the whole step takes."""
    return 1 + max((t[-1] for t in ticks.values() if t), default=-1)

"""Schedule generators: for each rank, the order of its compute actions. Sends and receives are added after.

Each generator takes (p ranks, m micro-batches, v chunks) and returns rank -> [Action]. `build` checks the
parameters, adds communication and refuses a schedule that would deadlock.
"""
from __future__ import annotations

from typing import Callable

from nbdist.errors import DistUsageError
from nbdist.schedules.actions import BACKWARD, FORWARD, Action
from nbdist.schedules.schedule import Schedule, add_comms

Program = dict[int, list[Action]]


def naive(p: int, m: int, v: int) -> Program:
    """Layer-wise model parallelism without pipelining: each micro-batch goes all the way forward and back
    before the next one starts, so at any moment one rank works and p-1 wait."""
    return {r: [a for j in range(m) for a in (Action(r, FORWARD, j), Action(r, BACKWARD, j))] for r in range(p)}


def gpipe(p: int, m: int, v: int) -> Program:
    """GPipe: all forwards, then all backwards. Activations of all m micro-batches are held at once."""
    return {r: [Action(r, FORWARD, j) for j in range(m)] + [Action(r, BACKWARD, j) for j in range(m)] for r in range(p)}


def one_f_one_b(p: int, m: int, v: int) -> Program:
    """1F1B (PipeDream-Flush): p-1-r warm-up forwards, then alternate one forward and one backward, then drain.
    Same bubble as GPipe, but rank r holds at most p-r micro-batches' activations instead of m."""
    program = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [Action(r, FORWARD, j) for j in range(warmup)]
        for j in range(m - warmup):
            acts += [Action(r, FORWARD, warmup + j), Action(r, BACKWARD, j)]
        acts += [Action(r, BACKWARD, j) for j in range(m - warmup, m)]
        program[r] = acts
    return program


GENERATORS: dict[str, Callable[[int, int, int], Program]] = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}
SINGLE_CHUNK = ("naive", "gpipe", "1f1b")


def check_parameters(name: str, p: int, m: int, v: int) -> None:
    """Refuse impossible parameters, naming the constraint."""
    if name not in GENERATORS:
        raise DistUsageError(f"unknown schedule {name!r}: choose one of {', '.join(GENERATORS)}")
    for label, value in (("stages", p), ("microbatches", m), ("chunks", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DistUsageError(f"{label} must be a positive whole number, got {value!r}")
    if name in SINGLE_CHUNK and v != 1:
        raise DistUsageError(f"{name} runs one model chunk per rank: chunks must be 1, got {v}")


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The named schedule for `stages` pipeline ranks, `microbatches` micro-batches and `chunks` per rank."""
    name = name.lower() if isinstance(name, str) else name
    check_parameters(name, stages, microbatches, chunks)
    schedule = Schedule(name, stages, microbatches, chunks, GENERATORS[name](stages, microbatches, chunks))
    schedule.program = add_comms(schedule)
    from nbdist.schedules.simulate import check

    check(schedule)
    return schedule

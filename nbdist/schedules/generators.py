"""Schedule generators: for each rank, the order of its compute actions. Sends and receives are added after.

Each generator takes (p ranks, m micro-batches, v chunks) and returns rank -> [Action]. `build` checks the
parameters, adds communication and refuses a schedule that would deadlock. The orders follow
torch.distributed.pipelining where torch has the schedule (gpipe, 1f1b, interleaved-1f1b, and zb-h1 as torch's
interleaved zero-bubble schedule with one chunk per rank), so a schedule drawn here is the one torch would run.
"""
from __future__ import annotations

from collections.abc import Callable

from nbdist.checks import whole_number
from nbdist.errors import DistUsageError
from nbdist.schedules.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
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


def pipedream(p: int, m: int, v: int) -> Program:
    """PipeDream (arXiv 1806.03377; asynchronous 1F1B with weight stashing), one step at a time: 1F1B's order.

    What differs from 1F1B is not the order but the weights: each stage updates its weights after every
    micro-batch's backward (not once per step), and a backward uses the weight version stashed at its own forward,
    so its gradient is consistent. Each step still runs this order to its end, so it fills and drains like 1F1B;
    PipeDream proper keeps the pipe full across mini-batches, which nbdist does not. The executor handles the
    stashing; the simulated timeline of one step equals 1F1B's.
    """
    return one_f_one_b(p, m, v)


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Program:
    """Megatron's interleaved 1F1B (arXiv 2104.04473): v chunks per rank, rank r holds stages r, r+p, r+2p, ...

    The rank's m*v chunk-forwards are numbered k = 0, 1, ...: they walk its chunks in groups of p micro-batches
    (k -> chunk (k // p) % v), backwards walk the chunks in reverse. Warm-up runs (v-1)*p + 2*(p-1-r) forwards
    (capped at m*v), then one forward and one backward alternate, then the remaining backwards drain. Smaller
    chunks shrink the bubble by v, at the price of v times more messages. Same order as torch and Megatron-core.
    """
    total = m * v
    program = {}
    for r in range(p):
        warmup = min((v - 1) * p + 2 * (p - 1 - r), total)
        acts = [_virtual(FORWARD, k, r, p, v) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [_virtual(FORWARD, warmup + k, r, p, v), _virtual(BACKWARD, k, r, p, v)]
        acts += [_virtual(BACKWARD, k, r, p, v) for k in range(total - warmup, total)]
        program[r] = acts
    return program


def _virtual(kind: str, k: int, rank: int, p: int, v: int) -> Action:
    """The k-th forward (or backward) of `rank` in the interleaved order: which chunk's stage, which micro-batch."""
    chunk = (k // p) % v
    if kind != FORWARD:
        chunk = v - 1 - chunk
    microbatch = (k // (p * v)) * p + k % p
    return Action(chunk * p + rank, kind, microbatch)


def zb_h1(p: int, m: int, v: int) -> Program:
    """Zero Bubble H1 (arXiv 2401.10241): the backward split into I (input gradient) and W (weight gradient).

    Only I is on the critical path between ranks, so ranks send gradients upstream sooner; W waits. Rank r runs
    1F1B's order with I for B, and puts W of micro-batch j-r right after I of micro-batch j: it defers r weight
    gradients and runs the last r in the cool-down, where 1F1B idles. Every rank holds at most p micro-batches
    (counted until W), the same peak as 1F1B's rank 0. Same order as torch's ScheduleInterleavedZeroBubble with
    one chunk per rank.
    """
    program = {}
    for r in range(p):
        warmup = p - 1 - r
        acts = [Action(r, FORWARD, j) for j in range(warmup)]
        for j in range(m):
            acts += [Action(r, FORWARD, warmup + j)] if warmup + j < m else []
            acts.append(Action(r, BACKWARD_INPUT, j))
            acts += [Action(r, BACKWARD_WEIGHT, j - r)] if j >= r else []
        acts += [Action(r, BACKWARD_WEIGHT, j) for j in range(max(m - r, 0), m)]
        program[r] = acts
    return program


GENERATORS: dict[str, Callable[[int, int, int], Program]] = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "zb-h1": zb_h1,
}
NAMES: tuple[str, ...] = tuple(GENERATORS)
SINGLE_CHUNK = ("naive", "gpipe", "1f1b", "pipedream", "zb-h1")
# 1F1B-style schedules interleave forwards and backwards only once every rank has warmed up with its p-1-r
# forwards; with m < p there is nothing to alternate, and torch's Schedule1F1B refuses it. Use gpipe there.
NEEDS_MICROBATCHES_AT_LEAST_STAGES = ("1f1b", "pipedream", "interleaved-1f1b", "zb-h1")


def check_parameters(name: str, p: int, m: int, v: int) -> None:
    """Refuse impossible parameters, naming the constraint."""
    if name not in GENERATORS:
        raise DistUsageError(f"unknown schedule {name!r}: choose one of {', '.join(GENERATORS)}")
    for label, value in (("stages", p), ("microbatches", m), ("chunks", v)):
        whole_number(value, label)
    if name in SINGLE_CHUNK and v != 1:
        raise DistUsageError(f"{name} runs one model chunk per rank: chunks must be 1, got {v}")
    if name in NEEDS_MICROBATCHES_AT_LEAST_STAGES and m < p:
        raise DistUsageError(f"{name} needs microbatches >= stages ({m} < {p}): with fewer micro-batches than "
                             f"ranks there is nothing to interleave; use gpipe")
    if name == "interleaved-1f1b":
        _check_interleaved(p, m, v)


def _check_interleaved(p: int, m: int, v: int) -> None:
    """Micro-batches go through each chunk in groups of p, so m must be a multiple of p (as in Megatron)."""
    if v < 2:
        raise DistUsageError(f"interleaved-1f1b needs chunks >= 2 (got {v}); with one chunk per rank use 1f1b")
    if m % p:
        raise DistUsageError(f"interleaved-1f1b needs microbatches divisible by stages ({m} % {p} = {m % p}): "
                             f"micro-batches walk each chunk in groups of {p}")


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The named schedule for `stages` pipeline ranks, `microbatches` micro-batches and `chunks` per rank."""
    name = name.lower() if isinstance(name, str) else name
    check_parameters(name, stages, microbatches, chunks)
    schedule = Schedule(name, stages, microbatches, chunks, GENERATORS[name](stages, microbatches, chunks))
    schedule.program = add_comms(schedule)
    from nbdist.schedules.simulate import check

    check(schedule)
    return schedule

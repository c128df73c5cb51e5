"""NCCL-safety of a schedule: its lowering for the GPU transport, and the three rules that lowering must keep.

The GPU transport gives every DIRECTED pair of ranks (sender -> receiver) its own process group, so each NCCL
stream carries one-way traffic. NCCL ignores tags: on a pair, the k-th receive gets the k-th message sent, whatever
it was meant to be. Sends never block the host; a receive completes once its pair's k-th send was issued. Hence:
(1) per pair, the receiver must receive in the sender's order (MPI's tags would sort a different order out; NCCL
hands over the wrong tensor); (2) played with those semantics every rank reaches its end; (3) the pair groups are
connected once, at build, in one global order (`connect_order`), and that set-up must not block in a cycle.
Ticks are the lockstep ticks the Stepper shows (simulate.ticks). Plain data: no torch here.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nbdist.errors import DistUsageError
from nbdist.schedules.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action
from nbdist.schedules.schedule import Schedule
from nbdist.schedules.simulate import requirements, same_rank_of, ticks

Pair = tuple[int, int]  # (sending rank, receiving rank)
Place = tuple[int, int]  # (rank, index in its list)


@dataclass
class Lowering:
    """Per directed pair, where its sends and its receives sit in the ranks' lists, each in program order."""

    sends: dict[Pair, list[Place]] = field(default_factory=dict)
    receives: dict[Pair, list[Place]] = field(default_factory=dict)


def lower(schedule: Schedule) -> Lowering:
    """The GPU transport's view of `schedule`: the sender's sends and the receiver's receives, per directed pair."""
    out = Lowering()
    for rank, acts in sorted(schedule.program.items()):
        for i, a in enumerate(acts):
            if a.kind in (SEND_F, SEND_B):
                out.sends.setdefault((rank, schedule.rank_of(a.peer_stage())), []).append((rank, i))
            elif a.kind in (RECV_F, RECV_B):
                out.receives.setdefault((schedule.rank_of(a.peer_stage()), rank), []).append((rank, i))
    return out


def connect_order(schedule: Schedule) -> list[Pair]:
    """The directed pairs that carry messages, in the one order every rank creates and connects their groups."""
    low = lower(schedule)
    return sorted(pair for pair in set(low.sends) | set(low.receives) if pair[0] != pair[1])


def check_nccl(schedule: Schedule) -> None:
    """None for a schedule that is safe on the GPU transport; else one DistUsageError line naming rank, tick, action."""
    low = lower(schedule)
    written = _play(schedule)  # the lockstep ticks as written, the Stepper's
    if written.stuck is None:
        _refuse_misorder(schedule, low, written)  # (1)
    delivered = _delivered(schedule, low)
    fifo = written if delivered.program == schedule.program else _play(delivered)
    if fifo.stuck is not None:
        raise DistUsageError(_stuck_line(schedule, delivered, fifo))  # (2)
    _refuse_misorder(schedule, low, fifo)  # (1) for a schedule that only plays with the wrong messages
    order = connect_order(schedule)
    check_setup({r: [pair for pair in order if r in pair] for r in schedule.program})  # (3)


def check_setup(orders: Mapping[int, list[Pair]]) -> None:
    """Refuse per-rank orders of connecting pair groups that block in a cycle (set-up of a pair waits for both).

    Plays the set-up: a pair connects once it is next on both its ranks. With one global order the earliest
    unconnected pair is always next on both, so `connect_order` passes; per-rank (lazy) orders may not.
    """
    position = {r: 0 for r in orders}
    while True:
        heads = {r: orders[r][position[r]] for r in orders if position[r] < len(orders[r])}
        if not heads:
            return
        ready = {pair for pair in heads.values() if all(heads.get(r) == pair for r in pair)}
        if not ready:
            waits = "; ".join(f"rank {r} waits to connect {a}->{b}" for r, (a, b) in sorted(heads.items()))
            raise DistUsageError(f"NCCL communicator set-up blocks in a cycle at build (before tick 0): {waits}")
        for r, pair in heads.items():
            position[r] += pair in ready


@dataclass
class _Play:
    """Lockstep play: per rank the tick of each action it ran; `stuck` is the tick where nothing could run."""

    at: dict[int, list[int]]
    stuck: int | None = None


def _play(schedule: Schedule) -> _Play:
    play, tick = _Play({r: [] for r in schedule.program}), 0
    try:
        for runnable in ticks(schedule):
            for rank, _ in runnable:
                play.at[rank].append(tick)
            tick += 1
    except DistUsageError:  # ticks() refuses the tick where nothing can run: the play is stuck there
        play.stuck = tick
    return play


def _delivered(schedule: Schedule, low: Lowering) -> Schedule:
    """`schedule` with every receive renamed to the message FIFO matching hands it (the pair's k-th send), or to a
    receive no send matches when the pair has no k-th send."""
    program = {r: list(acts) for r, acts in schedule.program.items()}
    for pair, receives in low.receives.items():
        sends = low.sends.get(pair, [])
        for k, (rank, i) in enumerate(receives):
            a = program[rank][i]
            program[rank][i] = _at(schedule, sends[k]).matching() if k < len(sends) else Action(a.stage, a.kind, -1 - k)
    return Schedule(schedule.name, schedule.ranks, schedule.microbatches, schedule.chunks, program)


def _refuse_misorder(schedule: Schedule, low: Lowering, play: _Play) -> None:
    """Rule (1): per pair the k-th receive is the k-th send's message; refuse the earliest receive (or send) that
    breaks it, and any message to the own rank or to a stage that does not exist."""
    problems = []
    for rank, acts in schedule.program.items():
        for i, a in enumerate(acts):
            peer = a.peer_stage() if a.is_comm else 0
            if a.is_comm and not (0 <= peer < schedule.stages and schedule.rank_of(peer) != rank):
                where = "is on the same rank (pass it locally)" if 0 <= peer < schedule.stages else "does not exist"
                problems.append((play.at[rank][i], rank, f"{a} has no pair group: its peer stage {peer} {where}"))
    for (src, dst), sends in low.sends.items():
        receives = low.receives.get((src, dst), [])
        for k, place in enumerate(sends):
            sent = _at(schedule, place)
            if k >= len(receives):
                what = (f"{sent} is never received: rank {dst} posts {len(receives)} receive(s) from rank {src}, "
                        f"this is send #{k + 1} there")
                problems.append((play.at[src][place[1]], src, what))
            elif (got := _at(schedule, receives[k])) != sent.matching():
                what = (f"{got} would get {sent.message} instead ({sent}, rank {src}'s send #{k + 1} to it): NCCL "
                        f"matches each pair's messages in order, not by tag, so rank {dst} must receive in rank "
                        f"{src}'s send order")
                problems.append((play.at[dst][receives[k][1]], dst, what))
    if problems:
        tick, rank, what = min(problems)
        raise DistUsageError(f"schedule {schedule.name!r} is not NCCL-safe: rank {rank} at tick {tick}: {what}")


def _stuck_line(schedule: Schedule, delivered: Schedule, play: _Play) -> str:
    """Rule (2): the ranks stuck where the FIFO play stops, each with its next action and what it waits for."""
    done = {a for r, acts in delivered.program.items() for a in acts[:len(play.at[r])]}
    waits = []
    for rank, acts in sorted(delivered.program.items()):
        if len(play.at[rank]) < len(acts):
            a, written = acts[len(play.at[rank])], schedule.program[rank][len(play.at[rank])]
            missing = [alts[0] for alts in requirements(a, schedule.stages - 1, same_rank_of(schedule))
                       if not any(x in done for x in alts)]
            wanted = ", ".join(str(x) for x in missing if x.microbatch >= 0) or "a message no rank sends"
            waits.append(f"rank {rank} waits at {written} for {wanted}")
    return (f"schedule {schedule.name!r} hangs under NCCL (messages matched in order per pair of ranks) at tick "
            f"{play.stuck}: " + "; ".join(waits))


def _at(schedule: Schedule, place: Place) -> Action:
    return schedule.program[place[0]][place[1]]

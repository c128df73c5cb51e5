"""NCCL-safety of a schedule: how the GPU transport posts its messages, and the rules that posting must keep.

NCCL ignores tags: on a pair of ranks, the k-th receive gets the k-th message sent, whatever it was meant to be. And
on one communicator a rank's operations run one after another while a send may not complete before its receive is
posted. The GPU transport (pipeline_parallel/ranks/transport.py) therefore sends over ONE communicator per pipeline
and posts each rank's messages in batches, one per ROUND (`rounds`): round t holds the send of the rank's own action
of tick t and the receives of the messages its neighbours send at tick t, posted together as one NCCL group
(torch.distributed.batch_isend_irecv, as torch.distributed.pipelining does). Ticks are the lockstep ticks the
Stepper shows (simulate.ticks).

Why one communicator and rounds:
- One communicator per direction between two ranks (nbdist's former design) keeps each stream one-way, but then a
  rank has several communicators in flight at once, and NCCL documents that this can deadlock unless every rank
  issues them in one consistent order: CUDA does not promise that kernels of different streams run concurrently.
- Serialising those operations in program order instead (one after another, each alone) hangs 1F1B: rank 0 sends
  F1 and then receives B0 while rank 1 sends B0 and then receives F1; each send waits for a receive queued behind
  the other rank's send. Megatron and torch post such a send and receive together; batching a rank's consecutive
  sends and receives is still not enough (interleaved 1F1B hangs), rounds are: a message's send and receive sit in
  the same round on both ranks, so by induction on the round every batch completes. `check_batches` plays this.
- Stepping: a call that stops at tick T posts every round < T on every rank, and waits for its own compute and the
  batches of the receives it ran (never the whole device): by the same induction all of that completes before the
  next call (`check_stepping`; `call_boundaries` and `unpartnered` state it for tests).

The rules: (1) per pair, the receiver receives in the sender's order (kept from the per-pair design, where a wrong
order fed the wrong tensor; rounds post every receive in the send order, so this is stricter than the transport
needs); (2) played as CPU transports run it (sends never block; a receive needs the pair's k-th send) every rank
reaches its end; (3) the rounds complete, in a whole step, in evaluation's forward-only lists and at every Stepper
call boundary; (4) the pairs are connected once, at build, in one global order (`connect_order`), and that set-up
must not block in a cycle. Plain data: no torch here.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from nbdist.errors import DistUsageError
from nbdist.schedules.actions import FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, Action
from nbdist.schedules.schedule import Schedule
from nbdist.schedules.simulate import requirements, same_rank_of, ticks

Pair = tuple[int, int]  # (sending rank, receiving rank)
Place = tuple[int, int]  # (rank, index in its list)
Round = tuple[int, tuple[Action, ...]]  # (tick, the sends and receives a rank posts together then)
Batches = Mapping[int, list[Round]]  # rank -> its batches, in the order it posts them
Boundary = tuple[int, dict[int, set[Action]], dict[int, set[Action]]]  # (until, waits, posted): call_boundaries


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
    """The directed pairs that carry messages, in the one order every rank connects them at build."""
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
    batches = rounds(schedule, fifo.at)
    check_batches(schedule, batches)  # (3)
    check_stepping(schedule, batches, fifo.at)
    evaluation = forward_only(schedule)
    check_batches(evaluation, rounds(evaluation), "in evaluation's forward-only lists")
    order = connect_order(schedule)
    check_setup({r: [pair for pair in order if r in pair] for r in schedule.program})  # (4)


def rank_walks(schedule: Schedule, rank: int) -> dict[str, tuple[list[Action], list[int], list[Round]]]:
    """What `rank` walks on the GPU transport, for a "step" and for "evaluation" (forward only): its actions, their
    ticks and its rounds (pipeline_parallel/ranks/executor.py)."""
    out = {}
    for kind, walked in (("step", schedule), ("evaluation", forward_only(schedule))):
        at = _play(walked).at
        out[kind] = (walked.program[rank], at[rank], rounds(walked, at)[rank])
    return out


def forward_only(schedule: Schedule) -> Schedule:
    """The lists evaluation walks (executor.evaluate): each rank's forwards and their activations' messages."""
    program = {r: [a for a in acts if a.kind in (FORWARD, RECV_F, SEND_F)] for r, acts in schedule.program.items()}
    return Schedule(schedule.name, schedule.ranks, schedule.microbatches, schedule.chunks, program)


# ---------------------------------------------------------------------------------------------------------------
# Rounds: what the GPU transport posts together, and NCCL's semantics played
# ---------------------------------------------------------------------------------------------------------------


def rounds(schedule: Schedule, at: Mapping[int, list[int]] | None = None) -> dict[int, list[Round]]:
    """rank -> its batches in round order: round t holds the send of its own action of tick t and the receives of
    what its neighbours send at tick t (per pair, the k-th receive takes the k-th send, as NCCL matches them).
    `at`: the ranks' ticks per action, when known (the lockstep play of `schedule`)."""
    at, low = _play(schedule).at if at is None else at, lower(schedule)
    chosen: dict[int, dict[int, list[int]]] = {r: {} for r in schedule.program}
    for pair, sends in low.sends.items():
        for (rank, i), (receiver, j) in zip(sends, low.receives.get(pair, [])):
            chosen[rank].setdefault(at[rank][i], []).append(i)
            chosen[receiver].setdefault(at[rank][i], []).append(j)
    return {r: [(tick, tuple(schedule.program[r][i] for i in sorted(places))) for tick, places in sorted(c.items())]
            for r, c in chosen.items()}


def check_batches(schedule: Schedule, batches: Batches, where: str = "") -> None:
    """Rule (3): refuse batches that hang when played as NCCL runs them on one communicator, in one line naming each
    stuck rank, the tick of its stuck batch, the operation that waits and what it waits for."""
    comm = _Communicator(schedule, batches)
    comm.post(until=None)
    stuck = comm.stuck()
    if stuck:
        how = "one communicator: each rank's batches run in turn, a send completes only with its receive"
        raise DistUsageError(f"schedule {schedule.name!r} hangs under NCCL ({how}){' ' + where if where else ''}: "
                             + "; ".join(stuck))


def check_stepping(schedule: Schedule, batches: Batches, at: Mapping[int, list[int]] | None = None) -> None:
    """Rule (3) at a Stepper's call boundaries, stepping one tick per call: what each rank waits for at the end of a
    call (`call_boundaries`) completes with what every rank posted by then. Played once, boundary after boundary."""
    at = _play(schedule).at if at is None else at
    comm, waits = _Communicator(schedule, batches), _waits(schedule, batches, at)
    for until in range(1, 2 + max((t[-1] for t in at.values() if t), default=-1)):
        comm.post(until)
        for rank, index in _waited(waits, until).items():
            if index >= comm.done[rank]:
                stuck = "; ".join(comm.stuck()) or "nothing posted is stuck"
                raise DistUsageError(f"schedule {schedule.name!r} hangs at the Stepper's call boundary before tick "
                                     f"{until}: rank {rank} waits for its batch of tick {batches[rank][index][0]} "
                                     f"({stuck})")


def call_boundaries(schedule: Schedule, batches: Batches | None = None) -> list[Boundary]:
    """Stepping one tick per call: for the end of each call (before tick `until`, 1 .. the last tick + 1), what each
    rank waits for there and what it has posted by then, as (until, waits, posted), each rank -> set of actions.

    A rank waits for the batches of the receives it ran (its compute stream waited on them) and, once its list is
    done, for every batch (it completes its sends); it has posted every round before `until`."""
    at = _play(schedule).at
    batches = rounds(schedule, at) if batches is None else batches
    waits, out = _waits(schedule, batches, at), []
    for until in range(1, 2 + max((t[-1] for t in at.values() if t), default=-1)):
        last = _waited(waits, until)
        waited = {r: {a for _, acts in batches[r][:last.get(r, -1) + 1] for a in acts} for r in batches}
        out.append((until, waited, {r: {a for tick, acts in bs if tick < until for a in acts}
                                    for r, bs in batches.items()}))
    return out


def unpartnered(schedule: Schedule, waits: Mapping[int, set[Action]],
                posted: Mapping[int, set[Action]]) -> list[tuple[int, Action]]:
    """(rank, action) for every send or receive waited for whose partner is not posted yet: a wait that hangs."""
    return sorted((rank, a) for rank, acts in waits.items() for a in acts
                  if a.matching() not in posted.get(schedule.rank_of(a.peer_stage()), set()))


def _waits(schedule: Schedule, batches: Batches, at: Mapping[int, list[int]]) -> dict[int, list[tuple[int, int]]]:
    """rank -> per action, (its tick, index of the last batch a call that ran it waits for; -1: none)."""
    out = {}
    for rank, acts in schedule.program.items():
        where = {a: j for j, (_, batch) in enumerate(batches[rank]) for a in batch}
        last, steps = -1, []
        for a, tick in zip(acts, at[rank]):
            if a.kind in (RECV_F, RECV_B):
                last = max(last, where.get(a, -1))
            steps.append((tick, last))
        if steps:  # a rank whose list is done completes its sends: it waits for every batch
            steps[-1] = (steps[-1][0], len(batches[rank]) - 1)
        out[rank] = steps
    return out


def _waited(waits: Mapping[int, list[tuple[int, int]]], until: int) -> dict[int, int]:
    """rank -> index of the last batch the end of a call stopping before `until` waits for (absent: none)."""
    out = {}
    for rank, steps in waits.items():
        ran = bisect.bisect_left(steps, (until, -2))  # steps are in tick order: those before `until` ran
        if ran and steps[ran - 1][1] >= 0:
            out[rank] = steps[ran - 1][1]
    return out


class _Communicator:
    """Batches on one NCCL communicator, played: on each rank they run one after another, in posting order; an
    operation completes once its partner's batch is running (posted, and every earlier batch of its rank done)."""

    def __init__(self, schedule: Schedule, batches: Batches):
        self.batches = batches
        self.index = {(r, a): j for r, bs in batches.items() for j, (_, acts) in enumerate(bs) for a in acts}
        low = lower(schedule)
        self.partner: dict[tuple[int, Action], tuple[int, Action]] = {}
        for pair, sends in low.sends.items():
            for send, receive in zip(sends, low.receives.get(pair, [])):
                one, other = (send[0], _at(schedule, send)), (receive[0], _at(schedule, receive))
                self.partner[one], self.partner[other] = other, one
        self.posted = {r: 0 for r in batches}
        self.done = {r: 0 for r in batches}

    def post(self, until: int | None) -> None:
        """Post every batch of a tick before `until` (None: all), then run what can run."""
        for rank, bs in self.batches.items():
            while self.posted[rank] < len(bs) and (until is None or bs[self.posted[rank]][0] < until):
                self.posted[rank] += 1
        progress = True
        while progress:
            progress = False
            for rank in self.batches:
                while self.done[rank] < self.posted[rank] and self._blocker(rank) is None:
                    self.done[rank] += 1
                    progress = True

    def _running(self, place: tuple[int, Action]) -> bool:
        j, rank = self.index.get(place), place[0]
        return j is not None and (j < self.done[rank] or j == self.done[rank] < self.posted[rank])

    def _blocker(self, rank: int) -> tuple[Action, tuple[int, Action] | None] | None:
        """The first operation of `rank`'s running batch whose partner is not running, with that partner."""
        for a in self.batches[rank][self.done[rank]][1]:
            other = self.partner.get((rank, a))
            if other is None or not self._running(other):
                return a, other
        return None

    def stuck(self) -> list[str]:
        out = []
        for rank in sorted(self.batches):
            if self.done[rank] < self.posted[rank]:
                a, other = self._blocker(rank)
                wanted = f"{other[1]} on rank {other[0]}" if other else "a message no rank sends"
                out.append(f"rank {rank} at tick {self.batches[rank][self.done[rank]][0]} waits at {a} for {wanted}")
        return out


# ---------------------------------------------------------------------------------------------------------------
# Rules (1), (2), (4)
# ---------------------------------------------------------------------------------------------------------------


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

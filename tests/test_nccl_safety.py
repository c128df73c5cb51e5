"""NCCL-safety as a property of the schedule (issue 9): the GPU transport's lowering and the rules NCCL imposes.

The claims: every built-in schedule, at many p, m, v, keeps each directed pair's receive order equal to its send
order and connects its pair groups without a cycle; a hand-written schedule that MPI's tags would run but NCCL would
feed the wrong tensor is refused, naming the receiving rank, the Stepper's tick of that receive, the receive and the
message it would get; a schedule that hangs is refused naming the stuck ranks; a lazy per-rank set-up ring is
refused while the one global order is not. Expected values are computed from the schedules (the Stepper's ticks,
the programs), never written down. Pure Python: no cluster, no torch.
"""
from __future__ import annotations

import itertools

import pytest

from nbdist import schedules
from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel.stepping import action_ticks
from nbdist.schedules import NAMES, Action, Schedule, build, check_nccl
from nbdist.schedules.actions import RECV_B, RECV_F, SEND_B, SEND_F
from nbdist.schedules.nccl import check_setup, connect_order
from nbdist.schedules.simulate import ticks

SINGLE_CHUNK = [(p, m, 1) for p in (1, 2, 3, 4, 5) for m in (p, p + 1, 2 * p, 3 * p + 1)]
INTERLEAVED = [(p, m, v) for p in (1, 2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p)]
CASES = [(name, *pmv) for name in NAMES if name != "interleaved-1f1b" for pmv in SINGLE_CHUNK] + [
    ("interleaved-1f1b", *pmv) for pmv in INTERLEAVED]


def pair_traffic(schedule: Schedule) -> tuple[dict, dict]:
    """Per directed (sender, receiver) pair: the sends in the sender's program order, the receives in the
    receiver's, read straight from the program (the reference the lowering is checked against)."""
    sent, received = {}, {}
    for rank, acts in schedule.program.items():
        for a in acts:
            peer = schedule.rank_of(a.peer_stage()) if a.is_comm else None
            if a.kind in (SEND_F, SEND_B):
                sent.setdefault((rank, peer), []).append(a)
            elif a.kind in (RECV_F, RECV_B):
                received.setdefault((peer, rank), []).append(a)
    return sent, received


def refusal(schedule: Schedule) -> str:
    with pytest.raises(DistUsageError) as caught:
        check_nccl(schedule)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_package_exports_check_nccl():
    from nbdist.schedules import nccl

    assert schedules.check_nccl is nccl.check_nccl and "check_nccl" in schedules.__all__


# ---------------------------------------------------------------------------------------------------------------
# Every built-in schedule is NCCL-safe
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_built_in_schedule_is_nccl_safe(name, p, m, v):
    schedule = build(name, p, m, v)
    assert check_nccl(schedule) is None
    assert check_nccl(Schedule.from_actions(schedule.actions, name=name, chunks=v)) is None  # its text form too
    sent, received = pair_traffic(schedule)
    assert set(sent) == set(received)
    for pair, sends in sent.items():
        assert pair[0] != pair[1]
        assert [s.matching() for s in sends] == received[pair]  # the property check_nccl claims
    assert connect_order(schedule) == sorted(sent)


def test_cases_cover_every_schedule_and_pairs_that_carry_both_directions_and_kinds():
    assert {case[0] for case in CASES} == set(NAMES)
    mixed = build("interleaved-1f1b", 2, 4, 2)  # rank 1 -> rank 0 carries activations (stage 1->2) and gradients
    kinds = {a.kind for a in pair_traffic(mixed)[0][(1, 0)]}
    assert kinds == {SEND_F, SEND_B}
    assert check_nccl(mixed) is None


# ---------------------------------------------------------------------------------------------------------------
# Hand-written schedules
# ---------------------------------------------------------------------------------------------------------------


def test_hand_written_safe_schedule_passes_even_with_micro_batches_out_of_numeric_order():
    # rank 1 runs micro-batch 1's backward first, so gradients travel 1 then 0; rank 0 takes them in that order
    schedule = Schedule.from_actions({0: ["0F0", "0F1", "0B1", "0B0"], 1: ["1F0", "1F1", "1B1", "1B0"]})
    sent, _ = pair_traffic(schedule)
    assert [a.microbatch for a in sent[(1, 0)]] == [1, 0]
    assert check_nccl(schedule) is None


def unsafe_schedule() -> Schedule:
    """Rank 0 sends micro-batch 0 then 1; rank 1 receives 1 first. MPI's tags run it; NCCL would swap the tensors."""
    return Schedule.from_actions({
        0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        1: ["1RECV_F1", "1F1", "1B1", "1SEND_B1", "1RECV_F0", "1F0", "1B0", "1SEND_B0"],
    })


def test_receive_order_unlike_send_order_is_refused_naming_rank_tick_action_and_what_it_gets():
    schedule = unsafe_schedule()
    assert schedule.simulate().makespan > 0  # valid where tags match messages (the MPI transport)
    sent, received = pair_traffic(schedule)
    first_send, first_receive = sent[(0, 1)][0], received[(0, 1)][0]
    assert first_receive != first_send.matching()
    index = schedule.program[1].index(first_receive)
    tick = action_ticks(schedule)[1][index]  # the Stepper's tick of that receive
    message = refusal(schedule)
    assert f"rank 1 at tick {tick}: {first_receive} would get {first_send.message} instead ({first_send}" in message
    assert "not NCCL-safe" in message


def swapped_receives(schedule: Schedule) -> list[tuple[Schedule, int, int]]:
    """Variants of `schedule` with two consecutive receives of one pair in the other order: the second moved to just
    before the first (so each is still received before it is used), kept where MPI's tags still run them:
    (variant, receiving rank, index of the receive now first)."""
    out = []
    for (_, dst), receives in pair_traffic(schedule)[1].items():
        for first, second in itertools.pairwise(receives):
            acts = list(schedule.program[dst])
            i = acts.index(first)
            acts.remove(second)
            acts.insert(i, second)
            text = {r: [str(a) for a in (acts if r == dst else schedule.program[r])] for r in schedule.program}
            try:
                variant = Schedule.from_actions(text, name=schedule.name, chunks=schedule.chunks)
            except DistUsageError:
                continue  # deadlocks even with tags: not a case of this rule
            out.append((variant, dst, i))
    return out


@pytest.mark.parametrize("name,p,m,v", [(n, 3, 6, 1) for n in NAMES if n != "interleaved-1f1b"] + [
    ("interleaved-1f1b", 3, 6, 2), ("interleaved-1f1b", 2, 4, 3)])
def test_every_swap_of_two_receives_that_tags_would_run_is_refused_at_the_earlier_one(name, p, m, v):
    variants = swapped_receives(build(name, p, m, v))
    # naive has one micro-batch in flight at a time, so a swapped receive waits forever even with tags
    assert bool(variants) == (name != "naive")
    for variant, rank, index in variants:
        receive, tick = variant.program[rank][index], action_ticks(variant)[rank][index]
        assert f"rank {rank} at tick {tick}: {receive} would get " in refusal(variant)


def test_schedule_that_hangs_is_refused_naming_the_stuck_ranks_tick_and_what_each_waits_for():
    # each rank receives before it sends what the other waits for: a cycle
    program = {0: ["0F0", "0RECV_B0", "0SEND_F0", "0B0"], 1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]}
    with pytest.raises(DistUsageError, match="deadlocks"):
        Schedule.from_actions(program)  # built or read schedules never get this far
    schedule = Schedule("cyclic", 2, 1, 1, {r: [Action.parse(a) for a in acts] for r, acts in program.items()})
    ran, rounds = {r: 0 for r in program}, 0  # play the lockstep ticks until nothing can run
    with pytest.raises(DistUsageError):
        for runnable in ticks(schedule):
            rounds += 1
            for r, _ in runnable:
                ran[r] += 1
    message = refusal(schedule)
    assert f"hangs under NCCL (messages matched in order per pair of ranks) at tick {rounds}:" in message
    for rank, acts in schedule.program.items():
        stuck = acts[ran[rank]]
        assert f"rank {rank} waits at {stuck} for {stuck.matching()}" in message


def test_message_to_a_stage_on_the_same_rank_is_refused():
    schedule = Schedule.from_actions({0: ["0F0", "0SEND_F0", "1RECV_F0", "1F0", "1B0", "1SEND_B0", "0RECV_B0",
                                          "0B0"]})
    index = schedule.program[0].index(Action.parse("0SEND_F0"))
    message = refusal(schedule)
    assert f"rank 0 at tick {action_ticks(schedule)[0][index]}: 0SEND_F0 has no pair group" in message


# ---------------------------------------------------------------------------------------------------------------
# Communicator set-up
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 4, 1), ("interleaved-1f1b", 4, 8, 2), ("zb-h1", 3, 3, 1)])
def test_connect_order_is_one_global_order_whose_set_up_completes(name, p, m, v):
    schedule = build(name, p, m, v)
    order = connect_order(schedule)
    assert len(order) == len(set(order))
    assert check_setup({r: [pair for pair in order if r in pair] for r in range(p)}) is None


def test_lazy_set_up_ring_is_refused_naming_each_rank_and_pair():
    # each rank first connects the pair from its left neighbour, then the pair to its right one: a ring
    p = 3
    lazy = {r: [((r - 1) % p, r), (r, (r + 1) % p)] for r in range(p)}
    with pytest.raises(DistUsageError) as caught:
        check_setup(lazy)
    message = str(caught.value)
    assert "\n" not in message and "cycle" in message
    for r in range(p):
        assert f"rank {r} waits to connect {(r - 1) % p}->{r}" in message
    order = sorted({pair for pairs in lazy.values() for pair in pairs})  # the same pairs in one global order
    assert check_setup({r: [pair for pair in order if r in pair] for r in range(p)}) is None

"""The pipeline's GPU path, checked on CPU (issue 20, defects C and D): what NCCL would do, as rules on plain data and
as the real executors run in one process over a transport that obeys NCCL's semantics.

D: a rank's messages go through ONE communicator per pipeline, posted in rounds (schedules/nccl.py). The claims: in
every built-in schedule a message's send and receive sit in the same round on both ranks, and the rounds complete
when played as NCCL runs one communicator (a rank's batches in turn, a send done only with its receive); the
alternatives do not: messages issued one by one hang every 1F1B-like schedule (so "order" is not enough, hence
"merge"), batching a rank's consecutive sends and receives hangs interleaved 1F1B (hence rounds); a schedule the old
rules accept and serialised communicators hang is still run.
C: a Stepper's call boundary waits only for what is already partnered: stepping one tick per call, nothing any rank
waits for at a boundary has its partner in a later call, where the former executor (receives posted a few actions
ahead, then the whole device synchronised) did in every pipeline; the GPU clock never synchronises the whole device.
The executors, each in its own thread over a fake NCCL, step tick by tick and run whole steps equal to one process,
and after every call nothing they posted is still pending.
Expected values are computed from the schedules, never written down. No cluster.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch
from test_nccl_safety import CASES
from torch import nn

from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel.ranks.executor import RECEIVE_LOOKAHEAD, StageExecutor
from nbdist.pipeline_parallel.spec import StageSpec
from nbdist.pipeline_parallel.stepping import action_ticks, total_ticks
from nbdist.runtime.ranks import placement
from nbdist.schedules import Schedule, build, check_nccl
from nbdist.schedules.actions import RECV_B, RECV_F
from nbdist.schedules.nccl import (
    call_boundaries,
    check_batches,
    check_stepping,
    forward_only,
    lower,
    rank_walks,
    rounds,
    unpartnered,
)

PIPELINED = [case for case in CASES if case[1] > 1]  # p >= 2: messages exist
LOSS = nn.functional.mse_loss


def one_by_one(schedule: Schedule) -> dict:
    """Serialised communicators ("order"): every send and receive alone, in program order."""
    at = action_ticks(schedule)
    return {r: [(at[r][i], (a,)) for i, a in enumerate(acts) if a.is_comm] for r, acts in schedule.program.items()}


def consecutive(schedule: Schedule) -> dict:
    """Each run of consecutive sends and receives of a rank's list posted together."""
    at, out = action_ticks(schedule), {}
    for r, acts in schedule.program.items():
        runs, run = [], []
        for i, a in enumerate(acts + [None]):
            if a is not None and a.is_comm:
                run.append(i)
            elif run:
                runs.append((at[r][run[0]], tuple(acts[j] for j in run)))
                run = []
        out[r] = runs
    return out


def former_posts(schedule: Schedule, until: int) -> dict:
    """What the former executor had posted when a call stopping before `until` ended: each send at its tick, and
    before each action it ran the next RECEIVE_LOOKAHEAD receives of its list. It then ran torch.cuda.synchronize(),
    which waits for all of it."""
    at, out = action_ticks(schedule), {}
    for r, acts in schedule.program.items():
        ran = sum(tick < until for tick in at[r])
        receives = [i for i, a in enumerate(acts) if a.kind in (RECV_F, RECV_B)]
        ahead = [i for i in receives if i >= ran - 1][:RECEIVE_LOOKAHEAD] if ran else []
        out[r] = {a for i, a in enumerate(acts) if (i < ran and a.is_comm) or i in ahead}
    return out


# -- D: one communicator, rounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m,v", PIPELINED)
def test_each_message_is_posted_in_one_round_on_both_ranks_before_it_is_needed(name, p, m, v):
    schedule = build(name, p, m, v)
    at, batches = action_ticks(schedule), rounds(schedule)
    round_of = {(r, a): tick for r, bs in batches.items() for tick, acts in bs for a in acts}
    for bs in batches.values():
        assert [tick for tick, _ in bs] == sorted({tick for tick, _ in bs})  # one batch per round, in order
    low = lower(schedule)
    for pair, sends in low.sends.items():
        for (src, i), (dst, j) in zip(sends, low.receives[pair], strict=True):
            send, receive = schedule.program[src][i], schedule.program[dst][j]
            assert round_of[(src, send)] == round_of[(dst, receive)] == at[src][i]  # the send's own tick
            assert at[dst][j] > at[src][i]  # posted before the receive runs
    check_batches(schedule, batches)
    evaluation = forward_only(schedule)
    check_batches(evaluation, rounds(evaluation))


@pytest.mark.parametrize("name,p,m,v", PIPELINED)
def test_messages_one_by_one_hang_every_schedule_that_interleaves_forwards_and_backwards(name, p, m, v):
    """Why merge and not order: on one communicator (or several serialised), 1F1B's rank 0 sends F1 then receives
    B0 while rank 1 sends B0 then receives F1. GPipe (all forwards, then all backwards) and the naive schedule (one
    micro-batch at a time) have no such crossing."""
    schedule = build(name, p, m, v)
    if name in ("gpipe", "naive"):
        check_batches(schedule, one_by_one(schedule))
        return
    with pytest.raises(DistUsageError, match="hangs under NCCL"):
        check_batches(schedule, one_by_one(schedule))


def test_a_hang_is_refused_in_one_line_naming_each_stuck_rank_its_tick_action_and_partner():
    schedule = build("1f1b", 2, 2)
    at = action_ticks(schedule)
    with pytest.raises(DistUsageError) as caught:
        check_batches(schedule, one_by_one(schedule))
    line = str(caught.value)
    assert "\n" not in line
    for rank, waiting, partner in ((0, "0SEND_F1", "1RECV_F1"), (1, "1SEND_B0", "0RECV_B0")):
        tick = at[rank][[str(a) for a in schedule.program[rank]].index(waiting)]
        assert f"rank {rank} at tick {tick} waits at {waiting} for {partner} on rank {1 - rank}" in line


def test_batching_consecutive_sends_and_receives_still_hangs_interleaved_1f1b():
    """Why rounds: Megatron-style pairs (send F with receive B) are not enough once chunks interleave."""
    schedule = build("interleaved-1f1b", 2, 4, 2)
    with pytest.raises(DistUsageError, match="hangs under NCCL"):
        check_batches(schedule, consecutive(schedule))
    check_batches(schedule, rounds(schedule))
    assert check_nccl(schedule) is None


def test_a_schedule_the_old_rules_accept_and_serialised_communicators_hang_still_runs():
    """Split backward, hand-ordered: each rank sends, computes W, then receives. Fine where sends never block;
    one by one, or even pairing consecutive sends and receives, each rank's send waits for a receive the other posts
    only after its own send. Rounds run it, so check_nccl accepts it."""
    schedule = Schedule.from_actions({
        0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0I0", "0F2", "0SEND_F2", "0W0", "0RECV_B1", "0I1",
            "0W1", "0RECV_B2", "0I2", "0W2"],
        1: ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1RECV_F1", "1F1", "1I1", "1SEND_B1", "1W0", "1RECV_F2", "1F2",
            "1I2", "1SEND_B2", "1W1", "1W2"],
    }, name="hand")
    for serialised in (one_by_one, consecutive):
        with pytest.raises(DistUsageError, match="hangs under NCCL"):
            check_batches(schedule, serialised(schedule))
    assert check_nccl(schedule) is None


# -- C: what a call boundary waits for -----------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m,v", PIPELINED)
def test_stepping_one_tick_per_call_never_waits_for_a_partner_of_a_later_call(name, p, m, v):
    schedule = build(name, p, m, v)
    batches = rounds(schedule)
    boundaries = call_boundaries(schedule, batches)
    assert [until for until, _, _ in boundaries] == list(range(1, total_ticks(action_ticks(schedule)) + 1))
    for _, waits, posted in boundaries:
        assert unpartnered(schedule, waits, posted) == []
        assert unpartnered(schedule, posted, posted) == []  # even everything posted is partnered
    check_stepping(schedule, batches)  # and the waited batches complete, played as NCCL runs them


@pytest.mark.parametrize("name,p,m,v", PIPELINED)
def test_the_former_boundary_waited_for_partners_of_later_calls(name, p, m, v):
    schedule = build(name, p, m, v)
    ends = range(1, total_ticks(action_ticks(schedule)) + 1)
    assert any(unpartnered(schedule, posted, posted) for posted in (former_posts(schedule, until) for until in ends))


def test_the_gpu_clock_waits_for_its_own_events_never_the_whole_device(monkeypatch):
    """CPU twin of placement.CudaClock (the pipeline's clock on a GPU): a call's start waits for the compute stream,
    its end for its last event."""
    waited = []

    class Event:
        def __init__(self, enable_timing):
            self.name = f"event {len(recorded)}"

        def record(self, stream=None):
            recorded.append(self)

        def synchronize(self):
            waited.append(self.name)

    class Stream:
        def synchronize(self):
            waited.append("compute stream")

    def whole_device(*_):
        raise AssertionError("torch.cuda.synchronize waits for NCCL's streams too")

    recorded: list = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", whole_device)
    clock = placement.CudaClock(torch.device("cuda", 0))
    clock.call_began()
    marks = [clock.mark() for _ in range(3)]
    clock.settle()
    assert waited == ["compute stream", "event 3"] and marks[-1][1] is recorded[-1]


# -- the executors over a fake NCCL ---------------------------------------------------------------------------------


class FakeNccl:
    """One communicator shared by a pipeline's ranks, with NCCL's semantics: per directed pair messages match in
    order; a rank's batches run one after another, and a message completes only once its partner's batch runs too."""

    def __init__(self):
        self.lock = threading.Condition()
        self.posted = {True: defaultdict(list), False: defaultdict(list)}  # sending? -> (src, dst) -> [(tensor, batch)]
        self.last: dict[int, Batch] = {}
        self.batches: list[Batch] = []

    def post(self, rank: int, ops) -> Batch:
        with self.lock:
            batch = Batch(self, self.last.get(rank), len(ops))
            self.last[rank] = batch
            self.batches.append(batch)
            for sending, tensor, peer in ops:
                pair = (rank, peer) if sending else (peer, rank)
                mine, theirs = self.posted[sending][pair], self.posted[not sending][pair]
                mine.append((tensor, batch))
                if len(mine) <= len(theirs):
                    other, partner = theirs[len(mine) - 1]
                    (other if sending else tensor).copy_(tensor if sending else other)
                    batch.partners.append(partner)
                    partner.partners.append(batch)
            self.lock.notify_all()
            return batch

    def pending(self) -> list:
        with self.lock:
            return [b for b in self.batches if not b.done]


class Batch:
    def __init__(self, nccl: FakeNccl, before, size: int):
        self.nccl, self.before, self.size, self.partners, self.finished = nccl, before, size, [], False

    def running(self) -> bool:
        return self.before is None or self.before.done

    @property
    def done(self) -> bool:
        self.finished = self.finished or (len(self.partners) == self.size and self.running()
                                          and all(p.running() for p in self.partners))
        return self.finished

    def is_completed(self) -> bool:
        with self.nccl.lock:
            return self.done

    def wait(self) -> None:
        with self.nccl.lock:
            if not self.nccl.lock.wait_for(lambda: self.done, timeout=10):
                raise AssertionError("a wait that NCCL would never complete")


class FakeTransport:
    name, max_tag = "torch", 2**31 - 1

    def __init__(self, nccl: FakeNccl, rank: int):
        self.nccl, self.rank = nccl, rank

    def post(self, ops):
        return self.nccl.post(self.rank, [(s, t.contiguous() if s else t, peer) for s, t, peer in ops])


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(6, 6), nn.Tanh())], nn.Linear(6, 2))


def executors(schedule: Schedule, nccl: FakeNccl, x: torch.Tensor):
    pieces = torch.arange(len(model())).tensor_split(schedule.stages)
    layers = {s: (int(piece[0]), int(piece[-1]) + 1) for s, piece in enumerate(pieces)}
    whole, shapes, out = model(), {}, x[: len(x) // schedule.microbatches]
    for s, (a, b) in layers.items():
        out = whole[a:b](out)
        shapes[s] = (tuple(out.shape), out.dtype)
    ticks, ranks = action_ticks(schedule), []
    for r in range(schedule.ranks):
        mine = {s: layers[s] for s in schedule.stages_of(r)}
        spec = StageSpec(name="p", number=0, mesh="m", replicas=1, pipeline_rank=r, pipeline_ranks=schedule.ranks,
                         program=tuple(schedule.actions[r]), ticks=tuple(ticks[r]), stages=schedule.stages,
                         microbatches=schedule.microbatches, layers=mine, model=None, transport="torch")
        modules = {s: model()[a:b] for s, (a, b) in mine.items()}
        ranks.append(StageExecutor(spec, modules, torch.device("cpu"), FakeTransport(nccl, r),
                                   walks=rank_walks(schedule, r)))
    return ranks, shapes


def in_threads(ranks, work) -> None:
    errors = []

    def run(rank):
        try:
            work(rank)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(e,)) for e in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 3, 6, 1), ("zb-h1", 2, 4, 1), ("naive", 2, 2, 1),
                                        ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 3, 6, 2)])
@pytest.mark.parametrize("stepped", [False, True])
def test_executors_over_fake_nccl_equal_one_process_whole_or_tick_by_tick(name, p, m, v, stepped):
    schedule = build(name, p, m, v)
    torch.manual_seed(1)
    x, y = torch.randn(4 * m, 6), torch.randn(4 * m, 2)
    nccl = FakeNccl()
    ranks, shapes = executors(schedule, nccl, x)
    for e in ranks:
        e.begin(shapes, x if e.spec.first_stage else None, y if e.spec.last_stage else None, LOSS)
    boundaries = range(1, total_ticks(action_ticks(schedule)) + 1) if stepped else [None]
    for until in boundaries:
        in_threads(ranks, lambda e, until=until: e.advance(until))
        assert nccl.pending() == []  # after each call nothing posted is pending: even a device-wide wait returns
    reports = [e.finish() for e in ranks]
    reference = model()
    expected = LOSS(reference(x), y)
    expected.backward()
    assert [r["loss"] for r in reports if r["loss"] is not None] == [pytest.approx(expected.item(), abs=1e-6)]
    got = {k: p.grad for e in ranks for module in e.modules.values() for k, p in module.named_parameters()}
    for key, param in reference.named_parameters():
        torch.testing.assert_close(got[key], param.grad, atol=1e-6, rtol=0)
    in_threads(ranks, lambda e: setattr(e, "evaluated", e.evaluate(x, y, LOSS)))
    assert [e.evaluated for e in ranks if e.evaluated is not None] == [pytest.approx(expected.item(), abs=1e-6)]

"""The flight recorder's ring and the hang view's reading of reports, in this process (no engines): what each call
leaves in the ring, and the sentence and mismatches read from ranks' reports made here by the recorder itself."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import nbdist
from nbdist.debugging import hang
from nbdist.debugging.ranks import recorder

WORLD = ("0", (0, 1, 2, 3))
NBDIST = os.path.dirname(nbdist.__file__)  # where the ranks' nbdist frames are


@pytest.fixture(autouse=True)
def clean_ring():
    recorder.clear()
    yield
    recorder.clear()


def test_a_call_is_in_flight_until_it_ends_and_failed_calls_say_so():
    first = recorder.begin(WORLD, 1, "all_reduce", None, 256, torch.float32)
    second = recorder.begin(WORLD, None, "recv", 1, 4, torch.float64)
    recorder.end(first)
    recorder.failed(second)
    third = recorder.begin(WORLD, 2, "broadcast", None, 8, torch.int64)
    calls = recorder.tail()
    assert [c["call"] for c in calls] == ["all_reduce", "recv", "broadcast"]
    assert calls[0]["done"] and not calls[0]["failed"]
    assert not calls[1]["done"] and calls[1]["failed"] and calls[1]["peer"] == 1
    assert not calls[2]["done"] and not calls[2]["failed"]  # in flight
    assert (calls[0]["bytes"], calls[1]["bytes"], calls[2]["bytes"]) == (1024, 32, 64)
    assert calls[0]["ranks"] == [0, 1, 2, 3] and calls[0]["dtype"] == "float32"
    recorder.end(third)


def test_the_ring_keeps_the_last_calls_in_order_when_it_wraps():
    for seq in range(recorder.SIZE + 37):
        recorder.end(recorder.begin(WORLD, seq, "all_reduce", None, 1, torch.float32))
    calls = recorder.tail(5)
    assert [c["seq"] for c in calls] == list(range(recorder.SIZE + 32, recorder.SIZE + 37))
    assert len(recorder.tail(recorder.SIZE + 100)) == recorder.SIZE


def test_recording_off_leaves_the_ring_untouched():
    recorder.recording(False)
    try:
        assert recorder.begin(WORLD, 1, "all_reduce", None, 1, torch.float32) is None
        recorder.end(None)
        recorder.failed(None)
    finally:
        recorder.recording(True)
    assert recorder.tail() == []


class Counting:
    """What a run reads of a process group (the MPI backend's MpiProcessGroup): its name and its calls so far."""

    def __init__(self, recorded_as: tuple):
        self.recorded_as, self.calls = recorded_as, 0

    def quick_sums(self, times: int, key: tuple) -> None:
        """`times` quick sums as the backend's hot path records them (mpi_backend.MpiProcessGroup._sum_now)."""
        for _ in range(times):
            self.calls += 1
            if recorder.on and recorder.run_key is not key:
                recorder.start_run(self, key, "all_reduce", key[0], key[1])


def test_quick_sums_are_one_entry_per_run_and_any_other_call_ends_the_run():
    world, other = Counting(WORLD), Counting(("1", (0, 1)))
    small, large = (256, torch.float32), (1024, torch.float32)
    world.quick_sums(5, small)
    assert [(c["first"], c["seq"], c["calls"], c["done"]) for c in recorder.tail()] == [(1, 5, 5, True)]  # open
    world.quick_sums(3, large)  # another size: another run
    other.quick_sums(2, (256, torch.float32))  # another group: another run
    world.calls += 1
    slot = recorder.begin(WORLD, world.calls, "broadcast", None, 8, torch.int64)  # ends the open run
    world.quick_sums(2, large)  # after the broadcast: a new run, though of the same size as the last one of world
    calls = recorder.tail()
    assert [(c["group"], c["call"], c["first"], c["seq"], c["calls"], c["numel"]) for c in calls] == [
        ("0", "all_reduce", 1, 5, 5, 256), ("0", "all_reduce", 6, 8, 3, 1024), ("1", "all_reduce", 1, 2, 2, 256),
        ("0", "broadcast", 9, 9, 1, 8), ("0", "all_reduce", 10, 11, 2, 1024)]
    assert not calls[3]["done"] and calls[4]["done"]
    recorder.end(slot)


def test_a_call_of_a_run_that_waits_shows_the_run_in_flight_and_one_that_fails_leaves_it():
    world, key = Counting(WORLD), (256, torch.float32)
    world.quick_sums(4, key)
    recorder.since[recorder.open_run[0]] = None
    slot = recorder.waiting()  # call #4 did not complete within the spin
    (run,) = recorder.tail()
    assert (run["first"], run["seq"], run["done"], run["failed"]) == (1, 4, False, False)  # #4 in flight
    assert run["start"] == recorder.since[slot]  # since it began to wait, not since the run's first call
    recorder.end(slot)
    assert recorder.tail()[0]["done"]
    world.quick_sums(1, key)
    recorder.run_failed(recorder.waiting(), world, "all_reduce", 256, torch.float32)  # call #5 timed out
    calls = recorder.tail()
    assert [(c["first"], c["seq"], c["done"], c["failed"]) for c in calls] == [(1, 4, True, False),
                                                                             (5, 5, False, True)]
    world.quick_sums(1, key)  # a new run; its only call fails: the run is removed, the call has its entry
    recorder.run_failed(recorder.waiting(), world, "all_reduce", 256, torch.float32)
    assert [(c["first"], c["seq"], c["failed"]) for c in recorder.tail()] == [(1, 4, False), (5, 5, True),
                                                                           (6, 6, True)]


def test_calls_made_while_recording_is_off_are_not_counted_in_a_run():
    world, key = Counting(WORLD), (256, torch.float32)
    world.quick_sums(2, key)
    recorder.recording(False)
    try:
        world.quick_sums(3, key)
    finally:
        recorder.recording(True)
    world.quick_sums(1, key)
    assert [(c["first"], c["seq"]) for c in recorder.tail()] == [(1, 2), (6, 6)]


def test_the_main_stack_is_read_from_another_thread():
    seen = []
    reader = threading.Thread(target=lambda: seen.append(recorder.report()))
    reader.start()
    reader.join()
    (report,) = seen
    functions = [frame[2] for frame in report["stack"]]
    assert "test_the_main_stack_is_read_from_another_thread" in functions  # the main thread's, not the reader's
    assert report["now"] <= time.perf_counter()


def _report(calls: list[tuple], stack: list, now: float = 10.0, doing: str | None = None) -> dict:
    """A rank's report as the recorder makes it: its calls written down, then read back."""
    recorder.clear()
    for group, seq, call, peer, numel, dtype, ended in calls:
        slot = recorder.begin(group, seq, call, peer, numel, dtype)
        recorder.entries[slot] = recorder.entries[slot][:-1] + (1.0 + 1e-6 * len(recorder.tail(1000)),)  # t = 1 s
        if ended:
            recorder.end(slot)
    return {"now": now, "calls": recorder.tail(), "doing": doing, "stack": stack, "host": "h"}


WAIT_STACK = [["/x/site-packages/ipykernel/kernelbase.py", 1, "dispatch", ""], ["cell In[3]", 8, "<module>", "f()"],
              [f"{NBDIST}/backend/ranks/waiting.py", 120, "_poll", "while not test():"]]
RUN_STACK = [["/x/site-packages/ipykernel/kernelbase.py", 1, "dispatch", ""], ["cell In[3]", 5, "<module>", "g()"],
             ["/home/u/train.py", 88, "step", "x = model(x)"]]
IDLE_STACK = [[f"{NBDIST}/cluster/launching/ranks/main.py", 34, "main", ""], ["/x/site-packages/tornado/ioloop.py", 1, "x", ""]]


def test_the_sentence_names_the_rank_that_never_reached_the_collective():
    reduce = (WORLD, 42, "all_reduce", None, 256, torch.float32, False)
    reports = {r: _report([reduce], WAIT_STACK) for r in (0, 1, 3)}
    reports[2] = _report([(("pipeline", (1, 2)), None, "recv", 1, 64, torch.float32, False)], WAIT_STACK,
                         doing="pipeline tick 7: R1 s1")
    view = hang.explain(reports)
    assert view.sentence == (
        "ranks 0, 1, 3 wait in all_reduce #42 on the group of ranks [0, 1, 2, 3]; rank 2 never reached it: it waits "
        "in recv from rank 1 on group pipeline (ranks [1, 2]) (pipeline tick 7: R1 s1), called from cell In[3]:8 in "
        "<module>")
    assert view.rows()[0]["waiting"] == "9.0 s" and view.mismatches == []


def test_a_rank_outside_any_call_one_behind_or_silent_is_said_so():
    reduce = (WORLD, 42, "all_reduce", None, 256, torch.float32, False)
    reports = {0: _report([reduce], WAIT_STACK), 1: _report([], RUN_STACK),
               2: _report([(WORLD, 41, "all_reduce", None, 256, torch.float32, False)], WAIT_STACK), 3: None}
    sentence = hang.explain(reports).sentence
    assert sentence == (
        "rank 0 waits in all_reduce #42 on the group of ranks [0, 1, 2, 3]; rank 1 never reached it: it runs "
        "train.py:88 in step, outside any communication call; rank 2 waits in all_reduce #41 on the group of ranks "
        "[0, 1, 2, 3] (1 call behind on that group); rank 3 never reached it: it did not answer (stuck in code that "
        "holds Python's lock, or gone)")


def test_ranks_that_met_in_one_call_with_different_shapes_are_named():
    reports = {0: _report([(WORLD, 5, "all_reduce", None, 4, torch.float32, False)], WAIT_STACK),
               1: _report([(WORLD, 5, "all_reduce", None, 8, torch.float32, False)], WAIT_STACK)}
    (said,) = hang.explain(reports).mismatches
    assert said == ("the ranks disagree on call #5 of the group of ranks [0, 1, 2, 3]: rank 0 all_reduce of 4 "
                    "float32, rank 1 all_reduce of 8 float32")


def test_two_ranks_receiving_from_each_other_are_a_deadlock():
    pair = ("7", (0, 1))
    reports = {0: _report([(pair, None, "recv", 1, 4, torch.float32, False)], WAIT_STACK),
               1: _report([(pair, None, "recv", 0, 4, torch.float32, False)], WAIT_STACK)}
    assert "neither sends (a deadlock)" in hang.explain(reports).sentence


def test_idle_engines_and_their_last_call():
    reports = {r: _report([(WORLD, 3, "barrier", None, 1, torch.uint8, True)], IDLE_STACK) for r in (0, 1)}
    view = hang.explain(reports)
    assert view.sentence == "no rank is running a cell: every engine waits for the next one"
    assert [row["last done"] for row in view.rows()] == ["barrier #3 on the group of ranks [0, 1, 2, 3]"] * 2
    assert [row["where"] for row in view.rows()] == ["", ""]


def test_an_engine_caught_in_its_between_cells_progress_tick_is_idle():
    """Between cells the engine's loop ticks MPI's progress (idle_progress.py); a view that catches a rank there (CI
    did, once) must say the rank waits for its next cell, not that it runs code."""
    ticking = IDLE_STACK + [["/x/lib/python3.11/asyncio/events.py", 80, "_run", ""],
                            [f"{NBDIST}/backend/ranks/idle_progress.py", 52, "tick", "probe()"]]
    reports = {0: _report([(WORLD, 2, "all_reduce", None, 1, torch.float32, True)], ticking),
               1: _report([(WORLD, 2, "all_reduce", None, 1, torch.float32, True)], IDLE_STACK)}
    view = hang.explain(reports)
    assert view.sentence == "no rank is running a cell: every engine waits for the next one"
    assert [row["where"] for row in view.rows()] == ["", ""]


def test_ranks_that_completed_the_call_the_last_one_waits_in_are_said_to_have_completed_it():
    """The shape of the hang CI met (notebook 32, before idle_progress.py): the peers completed the broadcast and
    their cells, rank 0 still waited in it; they had not 'never reached it'."""
    broadcast = (WORLD, 81, "broadcast", None, 64, torch.float32)
    reports = {0: _report([broadcast + (False,)], WAIT_STACK)}
    reports.update({r: _report([broadcast + (True,)], IDLE_STACK) for r in (1, 2, 3)})
    assert hang.explain(reports).sentence == (
        "rank 0 waits in broadcast #81 on the group of ranks [0, 1, 2, 3]; ranks 1, 2, 3 completed it and finished "
        "their cells")

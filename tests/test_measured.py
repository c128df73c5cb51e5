"""The helpers a lab prints beside a measurement (nbdist/measured.py): the load line and repeated timings."""
import os

import pytest

from nbdist.errors import DistUsageError
from nbdist.measured import Load, Repeats, compared, machine_load, order, ranking, ratios, this_run


def test_the_load_line_reads_the_run_queue_on_this_process_cores():
    load = machine_load()
    assert load.cores == len(os.sched_getaffinity(0))
    assert str(load).startswith(f"machine: load {load.average:.1f} on {load.cores} core")
    assert [Load(a, 2).word for a in (0.5, 1.0, 2.0, 2.1)] == ["quiet", "busy", "busy", "loaded"]


def test_an_order_is_said_only_when_every_repeat_agrees():
    fast, slow = Repeats((1.0, 1.2, 1.1), "ms"), Repeats((2.0, 2.5, 1.9), "ms")
    assert order(fast, slow, "a", "b").startswith("a was faster than b in every repeat: a 1.1 ms (median of 3, 1-1.2)")
    assert order(slow, fast, "a", "b").startswith("b was faster than a in every repeat")
    assert order(fast, Repeats((1.15, 0.9), "ms"), "a", "b").startswith("a and b overlap")


def test_no_repeats_is_refused_in_one_line():
    with pytest.raises(DistUsageError, match="at least one measured value"):
        Repeats(())


def test_compared_says_which_median_is_higher_and_by_how_much():
    mpi, backend = Repeats((22.0, 29.0, 99.0), "µs"), Repeats((414.0, 471.0, 474.0), "µs")
    said = compared(mpi, backend, "MPI", "the backend")
    assert said.startswith("MPI was faster than the backend in every repeat")
    assert said.endswith(f"; the backend's median is {471 - 29:,} µs above MPI's ({471 / 29:.3g}x)")


def test_ratios_pair_the_repeats_measured_side_by_side():
    assert ratios(Repeats((4.0, 9.0)), Repeats((2.0, 3.0))).values == (2.0, 3.0)
    with pytest.raises(DistUsageError, match="as many repeats on each side"):
        ratios(Repeats((1.0, 2.0)), Repeats((1.0,)))


def test_a_ranking_lists_single_runs_from_the_end_asked_for():
    assert ranking({"a": 3100.0, "b": 12.5, "c": 400.0}, "samples/s") == (
        "from highest to lowest: a 3,100 samples/s; c 400 samples/s; b 12.5 samples/s")
    assert ranking({"a": 2.0, "b": 1.0}, "%", "lowest") == "from lowest to highest: b 1%; a 2%"
    assert this_run("x").splitlines()[0] == "this run: x"
    assert this_run("x").splitlines()[1].startswith("machine: load ")

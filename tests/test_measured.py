"""The helpers a lab prints beside a measurement (nbdist/measured.py): the load line and repeated timings."""
import os

import pytest

from nbdist.errors import DistUsageError
from nbdist.measured import Load, Repeats, machine_load, order


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

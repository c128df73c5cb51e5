"""A plan's step prediction on a loaded machine (issue 43): the profile measures the share of a core each rank gets
with every rank busy (other work on the host counts), the prediction scales the layers' core seconds by it and says
the load it assumed. How close it lands, strategy by strategy, quiet and loaded: benchmarks/bench_plan_under_load.py.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

import nbdist
from nbdist.measured import CoreShare, Load
from nbdist.schedules.simulate import Timeline
from nbdist.sharding.step_time import sharing_the_cores


def test_other_work_keeps_slowing_a_stage_while_the_other_stage_idles():
    """With 2 stages, one busy: the ranks alone would give it a core (contention 2 x 1/2), but other work on the
    host stays: half the competition being other work, it runs 2 x (1/2 + 1/2 x 1/2) = 1.5x slower there."""
    timeline = Timeline.from_spans({0: [("0F0", 0.0, 1.0)], 1: [("1F0", 1.0, 2.0)]}, unit="")
    assert sharing_the_cores(timeline, contention=2.0).makespan == pytest.approx(2.0)
    assert sharing_the_cores(timeline, contention=2.0, others=0.5).makespan == pytest.approx(3.0)


def test_a_core_share_says_what_competes_and_the_load_it_was_measured_under():
    """4 ranks on 2 cores getting a third of a core each: 6 processes' worth compete, 2 of them other work."""
    cores = CoreShare(1 / 3, 4, Load(4.1, 2))
    assert cores.slowdown == pytest.approx(3.0)
    assert cores.others == pytest.approx(2.0)
    assert cores.others_fraction == pytest.approx(1 / 3)
    said = str(cores)
    assert "0.33 of a core" in said and "load 4.1 on 2 cores" in said and "now " in said
    assert CoreShare(1.0, 2, Load(0.3, 2)).others == 0.0  # a core each: nothing else competes


def _tiny_gpt():
    from nbdist import models

    return models.gpt(vocab=64, seq=16, layers=2, hidden=32, heads=2, seed=0)


@pytest.mark.slow
def test_a_profile_beside_two_busy_processes_reads_a_smaller_share_and_the_prediction_says_so(cluster):
    """Two processes spinning beside the 2 engines take their part of the 2 cores: the plan profiled then reads a
    smaller share of a core per rank than without them, predicts the compute that much slower, and its repr says
    the load it assumed."""
    plan = nbdist.shard(_tiny_gpt, dp=2, batch=8, cluster=cluster)
    quiet = plan.profile(repeats=3).cores
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded_plan = nbdist.shard(_tiny_gpt, dp=2, batch=8, cluster=cluster).profile(repeats=3)
        step = loaded_plan.predicted_step()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    loaded = loaded_plan.cores
    # beside them the ranks compete with 2 more processes: with E others already running (other test streams),
    # 2/(4+E) of a core each against 2/(2+E) without them
    assert loaded.share < quiet.share, (quiet, loaded)
    assert loaded_plan.contention() == pytest.approx(1 / loaded.share)
    assert step.assumes is loaded
    assert f"gets {loaded.share:.2f} of a core" in repr(step) and f"load {loaded.load.average:.1f}" in repr(step)


@pytest.mark.slow
def test_the_local_hardware_profile_is_scaled_by_the_share_of_a_core_and_says_it(cluster):
    """planner.hardware("local", cluster=c): the probes' core seconds at the share each engine gets now."""
    from nbdist import planner

    local = planner.hardware("local", cluster=cluster)
    m = local.measured
    assert 0 < m["core_share"] <= 1 and m["cores"] >= 1
    assert f"gets {m['core_share']:.2f} of a core" in local.notes and f"load {m['load']:.1f}" in local.notes

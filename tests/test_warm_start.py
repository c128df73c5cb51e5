"""Ranks forked from the kernel (cluster/launching/warm.py): the same MPI world as launched ranks, none of the kernel's state,
and the same promises (a rank's death named, nothing left, only this user's processes served). The forked ranks are
measured in fresh Pythons (tests/warm_scenarios.py) and in a real Jupyter kernel: this test process may have loaded
MPI itself, and then gets fresh ranks, as such a kernel would."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
from warm_scenarios import (
    _world,
    kernel_imported_the_wait,
    killed_rank,
    other_user,
    parallel_loops,
    stand_in_killed,
    world,
)

import nbdist
from nbdist.cluster.launching import warm
from nbdist.errors import DistUsageError

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_scenarios.py")


def scenario(function) -> dict:
    """Run tests/warm_scenarios.py's `function` in a fresh Python; what it saw."""
    ran = subprocess.run([sys.executable, SCENARIOS, function.__name__], capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return json.loads(ran.stdout.strip().splitlines()[-1])


def test_ranks_are_forked_from_the_kernel_and_form_one_world():
    seen = scenario(world)
    ranks = seen["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["sum"] == [3.0, 3.0] for r in ranks)
    assert seen["forked"] == sorted(r["pid"] for r in ranks)  # children of the warm process
    assert seen["warm_parent"] == seen["kernel"]  # itself a fork of the kernel
    for r, cmdline in zip(ranks, seen["cmdlines"]):  # the stand-in's environment, the thread count it asks for
        assert r["pmi_rank"] == str(r["rank"])  # Hydra's word to the stand-in
        assert r["threads"] == int(r["omp"])
        assert "nbdist.cluster.launching.ranks.main" in cmdline  # ps and psutil show a rank, not the kernel's command


def test_fresh_ranks_when_asked_or_when_forking_cannot_work():
    cluster = nbdist.Cluster(n=2, cpu=True, fork=False).start()
    try:
        assert cluster._launched.warm_process is None
        pids = [r["pid"] for r in cluster.run(_world)]
        assert all(psutil.Process(pid).parent().name() == "hydra_pmi_proxy" for pid in pids)
    finally:
        cluster.stop()
    assert warm.usable(multi_host=True) == "engines on other hosts"
    os.environ[warm.WARM_ENV] = "0"
    try:
        assert warm.usable(multi_host=False) == f"{warm.WARM_ENV}=0"
    finally:
        del os.environ[warm.WARM_ENV]
    with pytest.raises(DistUsageError, match="fork must be True or False, got 'yes'"):
        nbdist.Cluster(n=2, cpu=True, fork="yes").start()


@pytest.mark.parametrize("loaded, why", [
    ("sys.modules['mpi4py.MPI'] = object()", "this kernel has loaded MPI"),
    ("import types; sys.modules['pynvml'] = types.SimpleNamespace(_nvmlLib_refcount=1)",
     "this kernel holds NVML open"),
])
def test_a_kernel_holding_what_a_fork_cannot_share_gets_fresh_ranks(loaded, why):
    """A kernel's own MPI is a world of one, which its forks would inherit; NVML's open devices are the kernel's."""
    code = f"import sys; {loaded}; from nbdist.cluster.launching import warm; print(warm.usable(multi_host=False))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == why, out.stderr


def test_in_a_real_kernel_the_ranks_keep_none_of_its_state(kernel):
    """Forked from a Jupyter kernel: the ranks see none of its variables (their engine's shell is their own), and
    the kernel's own event loop and sockets go on working."""
    assert not kernel.execute("secret = 42").error
    assert not kernel.execute("%load_ext nbdist").error
    started = kernel.execute("print('printed once')\n%dist_start -n 2 --restart")
    assert not started.error, started.error_text
    assert started.stdout.count("printed once") == 1, started.stdout  # not again from a fork of the kernel
    seen = kernel.execute("%%dist --output all\nprint('secret' in globals(), type(get_ipython().kernel).__name__)")
    assert seen.stdout.count("False IPythonParallelKernel") == 2, seen.stdout  # the engine's shell, not ours
    assert kernel.execute("secret + 1").displays[-1]["text/plain"] == "43"  # the kernel answers as before
    assert not kernel.execute("%dist_stop").error


def test_a_killed_forked_rank_is_named_and_nothing_is_left():
    seen = scenario(killed_rank)
    assert f"rank 1 (pid {seen['victim']} on " in seen["said"] and ") died" in seen["said"], seen["said"]
    assert seen["gone"] and not seen["socket_left"]


def test_killing_a_stand_in_ends_its_rank():
    """Hydra ends a job by killing the processes it started: those are the stand-ins, and their ranks follow."""
    seen = scenario(stand_in_killed)
    assert seen["stand_ins"] == 2 and seen["ranks"] == 2 and seen["ranks_gone"]


def test_only_this_user_gets_a_fork():
    """The socket's folder is this user's alone, and the warm process serves only this user's processes."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")  # CI runs as root
    seen = scenario(other_user)
    assert seen["mode"] & 0o077 == 0 and seen["refused"]
    assert seen["sums"] == [[3.0, 3.0]] * 2  # still serving its own


def test_ranks_run_parallel_loops_after_the_kernel_ran_some():
    """GNU OpenMP's worker threads belong to the thread that started them: ranks forked from a kernel whose cells ran
    large tensor operations must not hang at their first parallel loop (one engine: two threads on two cores)."""
    assert scenario(parallel_loops)["threads"] == [2]


def test_a_forked_rank_reads_its_own_environment_where_the_kernel_had_read_its_own():
    """Modules the kernel imported carry settings read from its environment into the fork: the MPI backend's wait
    must read Hydra's (ranks per host against cores), or 4 ranks on 2 cores spin without yielding (2.6x slower)."""
    seen = scenario(kernel_imported_the_wait)
    assert seen["ranks"] == [seen["expected"]] * 2

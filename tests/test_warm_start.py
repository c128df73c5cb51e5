"""Ranks forked from the kernel (cluster/warm.py): the same MPI world as launched ranks, none of the kernel's state,
and the same promises (a rank's death named, nothing left, only this user's processes served)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
from processes import wait_until_gone

import nbdist
from nbdist.cluster import launch, warm
from nbdist.errors import DistError, DistUsageError


def _world() -> dict:
    import os

    import torch
    import torch.distributed as dist

    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {"pid": os.getpid(), "rank": dist.get_rank(), "sum": t.tolist(), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "pmi_rank": os.environ.get("PMI_RANK")}


@pytest.fixture
def forked():
    cluster = nbdist.Cluster(n=2, cpu=True).start()
    yield cluster
    cluster.stop()


def _warm_process(cluster) -> warm.WarmProcess:
    return launch._warm[id(cluster._launched.cluster)]


def test_ranks_are_forked_from_the_kernel_and_form_one_world(forked):
    warm_process = _warm_process(forked)
    ranks = forked.run(_world)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["sum"] == [3.0, 3.0] for r in ranks)
    assert {p.pid for p in warm_process.ranks()} == {r["pid"] for r in ranks}  # children of the warm process
    assert psutil.Process(warm_process.pid).ppid() == os.getpid()  # itself a fork of this process
    for r in ranks:  # the stand-in's environment (as mpiexec made it), and the thread count it asks for
        assert r["pmi_rank"] == str(r["rank"])  # Hydra's word to the stand-in
        assert r["threads"] == int(r["omp"])
        cmdline = " ".join(psutil.Process(r["pid"]).cmdline())
        assert "nbdist.cluster.ranks.main" in cmdline  # ps and psutil show a rank, not the kernel's command


def test_fresh_ranks_when_asked_or_when_forking_cannot_work():
    cluster = nbdist.Cluster(n=2, cpu=True, fork=False).start()
    try:
        assert id(cluster._launched.cluster) not in launch._warm
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
    code = f"import sys; {loaded}; from nbdist.cluster import warm; print(warm.usable(multi_host=False))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == why, out.stderr


def test_in_a_real_kernel_the_ranks_keep_none_of_its_state(kernel):
    """Forked from a Jupyter kernel: the ranks see none of its variables (their engine's shell is their own), and
    the kernel's own event loop and sockets go on working."""
    assert not kernel.execute("secret = 42").error
    assert not kernel.execute("%load_ext nbdist").error
    started = kernel.execute("%dist_start -n 2 --restart")
    assert not started.error, started.error_text
    seen = kernel.execute("%%dist --output all\nprint('secret' in globals(), type(get_ipython().kernel).__name__)")
    assert seen.stdout.count("False IPythonParallelKernel") == 2, seen.stdout  # the engine's shell, not ours
    assert kernel.execute("secret + 1").displays[-1]["text/plain"] == "43"  # the kernel answers as before
    assert not kernel.execute("%dist_stop").error


def test_a_killed_forked_rank_is_named_and_nothing_is_left(forked):
    warm_process = _warm_process(forked)
    members = forked.processes()
    victim = forked.run(_world)[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(DistError, match=rf"rank 1 \(pid {victim} on \S+\) died"):
        forked.run(_world, timeout=30)
    forked.stop()
    assert wait_until_gone(members, timeout=5) == []
    assert not os.path.exists(warm_process.path)


def test_killing_a_stand_in_ends_its_rank(forked):
    """Hydra ends a job by killing the processes it started: those are the stand-ins, and their ranks follow."""
    warm_process = _warm_process(forked)
    stand_ins = [p for p in forked.processes() if p.name() == "python" and "warm_stub.py" in " ".join(p.cmdline())]
    assert len(stand_ins) == 2
    ranks = warm_process.ranks()
    stand_ins[0].kill()
    assert wait_until_gone(ranks, timeout=5) == []  # its own at once; the other when Hydra ends the job


def test_only_this_user_gets_a_fork(forked):
    """The socket's folder is this user's alone, and the warm process serves only this user's processes."""
    path = _warm_process(forked).path
    assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")  # CI runs as root
    child = os.fork()
    if child == 0:  # another user: refused by the folder's mode, or by the warm process if it could connect
        os.setgid(65534)
        os.setuid(65534)
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            os._exit(0 if s.recv(64) == b"" else 1)
        except PermissionError:
            os._exit(0)
        os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.WEXITSTATUS(status) == 0
    assert [r["sum"] for r in forked.run(_world)] == [[3.0, 3.0]] * 2  # still serving its own


def test_ranks_run_parallel_loops_after_the_kernel_ran_some():
    """GNU OpenMP's worker threads belong to the thread that started them: ranks forked from a kernel whose cells ran
    large tensor operations must not hang at their first parallel loop (one engine: two threads on two cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (torch.randn(1500, 1500) @ torch.randn(1500, 1500)).sum()  # the kernel's main thread starts OpenMP's workers
        cluster = nbdist.Cluster(n=1, cpu=True).start()
    finally:
        torch.set_num_threads(threads)
    try:
        def parallel_loops() -> int:
            import torch

            (torch.randn(1500, 1500) @ torch.randn(1500, 1500)).sum()
            (torch.randn(2_000_000) * 2 + 1).sum()
            return torch.get_num_threads()

        assert cluster.run(parallel_loops, timeout=60) == [2]
    finally:
        cluster.stop()

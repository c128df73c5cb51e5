"""Scenarios of ranks forked from the kernel (cluster/launching/warm.py), each run in a fresh Python by tests/test_warm_start.py:
a test process that has loaded MPI itself (another test did) gets fresh ranks, as any such kernel would, so the
forked ranks are measured where forking is possible. Each scenario prints one JSON line of what it saw.

    python tests/warm_scenarios.py SCENARIO
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

import psutil
from processes import wait_until_gone

import nbdist
from nbdist.cluster.launching import warm
from nbdist.errors import DistError


def _world() -> dict:
    import os

    import torch
    import torch.distributed as dist

    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {"pid": os.getpid(), "rank": dist.get_rank(), "sum": t.tolist(), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "pmi_rank": os.environ.get("PMI_RANK")}


def _started(n: int = 2) -> tuple[nbdist.Cluster, warm.WarmProcess]:
    cluster = nbdist.Cluster(n=n, cpu=True).start()
    assert cluster._launched.warm_process is not None, "the ranks were not forked"
    return cluster, cluster._launched.warm_process


def world() -> dict:
    cluster, warm_process = _started()
    try:
        ranks = cluster.run(_world)
        return {"ranks": ranks, "forked": sorted(p.pid for p in warm_process.ranks()),
                "warm_parent": psutil.Process(warm_process.pid).ppid(), "kernel": os.getpid(),
                "cmdlines": [" ".join(psutil.Process(r["pid"]).cmdline()) for r in ranks]}
    finally:
        cluster.stop()


def killed_rank() -> dict:
    cluster, warm_process = _started()
    members = cluster.processes()
    victim = cluster.run(_world)[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    try:
        cluster.run(_world, timeout=30)
        said = None
    except DistError as e:
        said = str(e)
    cluster.stop()
    return {"victim": victim, "said": said, "gone": wait_until_gone(members, timeout=5) == [],
            "socket_left": os.path.exists(warm_process.path)}


def stand_in_killed() -> dict:
    cluster, warm_process = _started()
    try:
        stand_ins = [p for p in cluster.processes() if p.name() == "python" and "warm_stub.py" in " ".join(p.cmdline())]
        ranks = warm_process.ranks()
        stand_ins[0].kill()
        return {"stand_ins": len(stand_ins), "ranks": len(ranks),
                "ranks_gone": wait_until_gone(ranks, timeout=5) == []}
    finally:
        cluster.stop()


def other_user() -> dict:
    """Another user is refused by the socket folder's mode, or by the warm process if it could connect."""
    cluster, warm_process = _started()
    try:
        mode = os.stat(os.path.dirname(warm_process.path)).st_mode & 0o777
        child = os.fork()
        if child == 0:
            os.setgid(65534)
            os.setuid(65534)
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(warm_process.path)
                os._exit(0 if s.recv(64) == b"" else 1)
            except PermissionError:
                os._exit(0)
            os._exit(2)
        _, status = os.waitpid(child, 0)
        return {"mode": mode, "refused": os.WEXITSTATUS(status) == 0, "sums": [r["sum"] for r in cluster.run(_world)]}
    finally:
        cluster.stop()


def parallel_loops() -> dict:
    """The kernel's main thread ran a large tensor operation (GNU OpenMP's workers started) before the start."""
    import torch

    torch.set_num_threads(2)
    (torch.randn(1500, 1500) @ torch.randn(1500, 1500)).sum()
    cluster, _ = _started(n=1)
    try:
        def loops() -> int:
            import torch

            (torch.randn(1500, 1500) @ torch.randn(1500, 1500)).sum()
            (torch.randn(2_000_000) * 2 + 1).sum()
            return torch.get_num_threads()

        return {"threads": cluster.run(loops, timeout=60)}
    finally:
        cluster.stop()


def kernel_imported_the_wait() -> dict:
    """The kernel imported the MPI backend's wait (a benchmark's helpers, a user's import) with the opposite of what
    the ranks' own environment says about sharing cores: each forked rank reads its own."""
    from nbdist.backend.ranks import waiting

    n = 2
    expected = n > len(os.sched_getaffinity(0))  # what Hydra's MPI_LOCALNRANKS will say on this host
    waiting.OVERSUBSCRIBED, waiting.QUICK_TESTS = not expected, 1 if not expected else waiting.SPIN_TESTS
    cluster, _ = _started(n=n)
    try:
        def settings() -> list:
            from nbdist.backend.ranks import waiting

            return [waiting.OVERSUBSCRIBED, waiting.QUICK_TESTS]

        return {"expected": [expected, 1 if expected else waiting.SPIN_TESTS], "ranks": cluster.run(settings)}
    finally:
        cluster.stop()


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))

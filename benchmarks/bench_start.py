#!/usr/bin/env python
"""Start to ready, against its floor and against doing it by hand; on one host and on two (issue 21).

"Ready" means: a controller, 2 MPI engines registered, torch imported and torch.distributed initialised on each.
Measured in one run, interleaved (who goes first rotates), medians:

1. floor: two `python -c "import torch"` started at once, until both have exited. Nothing can be ready sooner.
2. nbdist, one host: `nbdist.start(2, cpu=True)` (torch.distributed over mpi4py) to its return.
3. by hand, one host: plain ipyparallel MPI engines (`ipp.Cluster(engines="mpi", n=2).start_and_connect_sync()`),
   then on both engines `import torch` and `init_process_group("gloo")` through a TCPStore rank 0 serves, its port
   sent over MPI: what a user writes without nbdist.
4. nbdist, two hosts (one engine each): `nbdist.start(2, hosts=...)`, on hosts given with --hosts/--mpi-args, or
   made here with --make-hosts (root: two network namespaces with sshd, tests/hosts.py).

Targets (issue 21): nbdist - floor <= 0.25 s; nbdist / by hand <= 0.3; two hosts - one host <= 1 s.

    python benchmarks/bench_start.py [--repeats 5] [--make-hosts | --hosts a,b --mpi-args "..."] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import ipyparallel as ipp  # imported before any timing
from bench_cluster import ClusterRun, put_mpiexec_on_path
from common import Measure, bytecode_kept, rotated

import nbdist
from nbdist.cluster.launching import launch

N = 2
SETTLE = 2.0  # seconds of quiet before each measurement: a stopped cluster's processes take a moment to go


def floor() -> float:
    """Two concurrent `import torch`, to both exits."""
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(N)]
    for proc in procs:
        proc.wait()
    return time.perf_counter() - started


def nbdist_start(run: ClusterRun, **options) -> float:
    started = time.perf_counter()
    cluster = nbdist.start(N, cpu=True, restart=True, timeout=120, **options)
    seconds = time.perf_counter() - started
    run.track(cluster.processes())
    cluster.stop()
    return seconds


def _init_by_hand() -> int:
    """On an engine: torch and a gloo process group, the rendezvous served by rank 0 (port sent over MPI)."""
    import datetime

    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed import TCPStore

    comm = MPI.COMM_WORLD
    timeout = datetime.timedelta(seconds=60)
    store = TCPStore("127.0.0.1", 0, comm.size, True, timeout, wait_for_workers=False) if comm.rank == 0 else None
    port = comm.bcast(store.port if store else None, root=0)
    store = store or TCPStore("127.0.0.1", port, comm.size, False, timeout)
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
    return dist.get_world_size()


def by_hand(run: ClusterRun) -> float:
    cluster = ipp.Cluster(engines="mpi", n=N, log_level=40)
    run.plain.append(cluster)
    started = time.perf_counter()
    client = cluster.start_and_connect_sync()
    assert client[:].apply_sync(_init_by_hand) == [N] * N
    seconds = time.perf_counter() - started
    run.track(launch.processes(cluster))
    client.close()
    cluster.stop_cluster_sync()
    run.plain.remove(cluster)
    return seconds


def measure(repeats: int, hosts: str | None, mpi_args: str) -> list[Measure]:
    samples: dict[str, list[float]] = {"floor": [], "nbdist": [], "by hand": [], "two hosts": []}
    with ClusterRun() as run:
        sides = [("floor", floor), ("nbdist", lambda: nbdist_start(run)), ("by hand", lambda: by_hand(run))]
        if hosts:
            sides.append(("two hosts", lambda: nbdist_start(run, hosts=hosts, mpi_args=mpi_args)))
        for i in range(repeats + 1):  # the first round warms the page cache and imports
            for name, side in rotated(sides, i):
                run.leftovers(grace=10)  # the previous side's processes gone (they would share the cores)
                time.sleep(SETTLE)
                seconds = side()
                if i:
                    samples[name].append(seconds)
            if i:
                run.log(f"  repetition {i}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in samples.items() if s))
    measures = [
        Measure("start to ready - floor (2 x import torch)", "s", samples["nbdist"], samples["floor"], "diff<=", 0.25,
                anchor_name="floor"),
        Measure("start to ready / by hand (ipyparallel + torch + init_process_group)", "s", samples["nbdist"],
                samples["by hand"], "ratio<=", 0.3, anchor_name="by hand"),
    ]
    if hosts:
        measures.append(Measure("two hosts - one host", "s", samples["two hosts"], samples["nbdist"], "diff<=", 1.0,
                                anchor_name="one host"))
    return measures, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hosts", default=None, help="two hosts for the two-host start, e.g. a,b")
    parser.add_argument("--mpi-args", default="", help="mpiexec arguments for those hosts (e.g. -launcher-exec ...)")
    parser.add_argument("--make-hosts", action="store_true", help="make two namespace hosts with sshd here (root)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    put_mpiexec_on_path()
    made = None
    if args.make_hosts:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from hosts import SshHosts

        made = SshHosts(2).__enter__()
        args.hosts, args.mpi_args = made.names(1), " ".join(made.mpi_args)
    try:
        with bytecode_kept("bench-start-pyc-"):  # for every side's processes alike
            measures, run = measure(args.repeats, args.hosts, args.mpi_args)
    finally:
        if made is not None:
            made.close()
    return run.finish(measures, json_path=args.json, settings={"repeats": args.repeats, "hosts": args.hosts,
                                                               "cpus": os.cpu_count()})


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""On a shared machine, does nbdist's MPI backend stay faster than gloo and close to raw MPI, and cheap when idle?

The question (issue 23, "shared machines"): a class's engines share a teaching server's cores, a laptop runs other
work. Busy polling there would starve everyone. Measured here:
1. With a neighbour: another job's MPI ranks, one per core, all-reducing 1 MiB in a loop (its own `mpiexec`, a
   blocking `Allreduce` that spins inside MPICH, as any MPI job does), the same all-reduce sweep as
   bench_mpi_backend.py (its `busbw`: the library's timing loop) on 2 and 4 ranks: gloo, the MPI backend, raw
   mpi4py. Targets: the MPI backend faster than gloo at every size (busbw ratio >= 1), within 2x of raw mpi4py from
   64 KiB up (ratio >= 0.5).
2. Idle: 4 engines on the MPI backend waiting for the next cell (after one ran), no neighbour: the CPU time all
   their processes (engines, the controller, MPI's launcher and proxies, forked ranks' stand-ins and the warm process
   or launched ranks' PMI relays) use over `--idle-seconds`, as % of one core, and which processes used it.
   Target: <= 5 % (what the issue measured before: 4 %). `--idle-engines 2,4` and `--idle-ranks forked,fresh`
   measure more clusters (each row counted against the same target); `--idle-only` skips the rest.

    python benchmarks/bench_mpi_backend_shared.py [--ranks 2,4] [--sizes 1K,64K,...] [--repeats 3]
    python benchmarks/bench_mpi_backend_shared.py --idle-only --idle-engines 2,4 --idle-ranks forked,fresh

About 5 minutes on 2 cores. Exit status 0 when every counted target is met and nothing was left running.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import psutil
from bench_mpi_backend import busbw
from common import Measure, Run
from workloads import parse_size

from nbdist.cluster.options import find_mpiexec
from nbdist.units import format_bytes

DEFAULT_SIZES = "1K,64K,1M,4M,16M"
RAW_FROM, RAW_RATIO, GLOO_RATIO, IDLE_PERCENT = 64 * 2**10, 0.5, 1.0, 5.0
NEIGHBOUR = """
import numpy as np
from mpi4py import MPI
a = np.ones(1 << 18, np.float32); b = np.empty_like(a)
MPI.COMM_WORLD.Allreduce(a, b)  # every rank has mapped MPICH's shared memory: its name can go (it is SIGKILLed)
if MPI.COMM_WORLD.rank == 0:
    import os
    for line in open("/proc/self/maps"):
        path = line.split(maxsplit=5)[-1].strip()
        if path.startswith("/dev/shm/mpich_") and not path.endswith("(deleted)") and os.path.exists(path):
            os.unlink(path)
print("neighbour up", flush=True)
while True:
    MPI.COMM_WORLD.Allreduce(a, b)
"""


@contextmanager
def neighbour(run: Run):
    """Another job's MPI ranks all-reducing in a loop, one per core, for the block's duration. Its own session, so
    that it can be ended whole; its processes are tracked by the run (the end checks that none is left)."""
    cores = len(os.sched_getaffinity(0))
    command = [find_mpiexec() or "mpiexec", "-n", str(cores), sys.executable, "-c", NEIGHBOUR]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_until_up(proc, cores)
        run.track([psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True))
        run.log(f"  neighbour: {cores} MPI ranks all-reducing 1 MiB in a loop (pid {proc.pid})")
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_until_up(proc: subprocess.Popen, ranks: int, seconds: float = 60.0) -> None:
    """Until each of the neighbour's ranks said it is up, at most `seconds` (read unbuffered: Hydra may pass both
    ranks' lines in one piece)."""
    deadline, said = time.monotonic() + seconds, b""
    while said.count(b"neighbour up") < ranks:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the neighbour job did not start (exit status {proc.poll()}; it said {said[-200:]})")
        if select.select([proc.stdout], [], [], 1.0)[0]:
            said += os.read(proc.stdout.fileno(), 4096)


def idle_percent(run: Run, n: int, seconds: float, fork: bool = True) -> tuple[float, str]:
    """% of one core that an idle cluster of n engines (MPI backend) uses, all its processes together, and how it
    splits among the kinds of process (in words). `fork`: ranks forked from a warm process (nbdist's default where it
    can) or fresh ones."""
    cluster = run.start(n, backend="mpi", fork=fork)
    cluster.run(lambda: 1)
    time.sleep(2.0)
    procs = cluster.processes()
    before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(seconds)
    used: dict[str, float] = {}
    for p in procs:
        if p.is_running():
            kind = _kind(p)
            used[kind] = used.get(kind, 0.0) + sum(p.cpu_times()[:2]) - before[p.pid]
    split = ", ".join(f"{kind} {100.0 * t / seconds:.2f}" for kind, t in sorted(used.items(), key=lambda kv: -kv[1]))
    return 100.0 * sum(used.values()) / seconds, split


def _kind(p: psutil.Process) -> str:
    """What a cluster's process is, in a word or two."""
    try:
        line = " ".join(p.cmdline())
    except psutil.Error:
        return "gone"
    for mark, kind in (("warm_stub.py", "stand-ins"), ("pmi_relay.py", "PMI relays"), ("ranks.zygote", "warm process"),
                       ("launching.controller", "controller"), ("ranks.main", "engines")):
        if mark in line:
            return kind
    return p.name()


def rows_for(n: int, sizes: list[int], gloo: dict, mpi: dict, raw: dict) -> list[Measure]:
    name = f"{n} ranks beside a neighbour, all_reduce"
    rows = [Measure(f"{name} {format_bytes(s)}: MPI backend vs gloo", "GB/s", mpi[s], gloo[s], "ratio>=", GLOO_RATIO,
                    anchor_name="gloo") for s in sizes]
    rows += [Measure(f"{name} {format_bytes(s)}: MPI backend vs raw mpi4py", "GB/s", mpi[s], raw[s], "ratio>=",
                     RAW_RATIO if s >= RAW_FROM else 0.0, counts=s >= RAW_FROM, anchor_name="raw mpi4py")
             for s in sizes]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--idle-engines", default="4")
    parser.add_argument("--idle-ranks", default="forked", help="forked, fresh or both (comma-separated)")
    parser.add_argument("--idle-only", action="store_true", help="measure idle clusters only (no neighbour)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = sorted({parse_size(s) for s in args.sizes.split(",")})
    measures: list[Measure] = []
    splits: list[str] = []
    with Run() as run:
        for ranks in args.idle_ranks.split(","):
            for n in (int(e) for e in args.idle_engines.split(",")):
                run.log(f"{n} engines idle (MPI backend, {ranks} ranks), no neighbour:")
                idle, split = idle_percent(run, n, args.idle_seconds, fork=ranks != "fresh")
                named = f"{n} idle engines" + ("" if ranks == "forked" else f" ({ranks} ranks)")
                measures.append(Measure(f"{named}: CPU used, % of one core", "%", [idle], [], "abs<=", IDLE_PERCENT))
                splits.append(f"{named}, % of one core by process: {split}")
                run.log("  " + splits[-1])
        for n in ([] if args.idle_only else (int(r) for r in args.ranks.split(","))):
            gloo_cluster = run.start(n, backend="gloo")
            with neighbour(run):
                run.log(f"{n} ranks, gloo:")
                gloo = busbw(gloo_cluster, sizes, ("torch",), args.repeats, run.log)["torch"]
            mpi_cluster = run.start(n, backend="mpi")
            with neighbour(run):
                run.log(f"{n} ranks, MPI backend (and raw mpi4py):")
                both = busbw(mpi_cluster, sizes, ("torch", "mpi"), args.repeats, run.log)
            measures += rows_for(n, sizes, gloo, both["torch"], both["mpi"])
    status = run.finish(measures, details="\n".join(splits), json_path=args.json,
                        settings={"sizes": sizes, "repeats": args.repeats, "idle_seconds": args.idle_seconds})
    print("ratios: " + "; ".join(f"{m.name}: {m.compared:.3g}" for m in measures))
    return status


if __name__ == "__main__":
    sys.exit(main())

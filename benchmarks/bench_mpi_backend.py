#!/usr/bin/env python
"""Does torch.distributed over nbdist's MPI backend beat gloo on CPU engines, and run at raw MPI's speed?

The question (issue 23, after issue 10): a `dist.all_reduce` in a cell on CPU engines, through `--backend mpi`
(torch.distributed over mpi4py, nbdist/backend/ranks/mpi_backend.py) against `--backend gloo` and against raw
mpi4py (`Allreduce` on the tensor's own memory, numpy views), on 2 and 4 ranks. Targets:
- against gloo: 1 KiB at least 20x gloo's speed; 4 MiB at least 3x;
- against raw mpi4py: within 1.2x from 64 KiB to 64 MiB (busbw ratio >= 0.833), within 2x at 1 KiB (>= 0.5).

How: `nbdist.collectives.benchmark(ops=("all_reduce",), via=...)`, the library's own timing loop (warm-up, barrier,
iterations chosen to last ~0.2 s, the slowest rank's time, busbw as nccl-tests defines it). Per rank count, one
cluster on gloo (via "torch": gloo), then one on the MPI backend (via "torch": the MPI backend, and via "mpi": raw
mpi4py on the same buffers, alternated at each size). Both backends in one run; medians over `--repeats`.
With more ranks than cores (4 on 2 cores) the figures are those of a laptop: ranks take turns on the cores.
Then, at 1, 64 and 256 KiB, where the call's time goes (on_ranks.small_call_costs): raw mpi4py, the agreement beside
the data as raw mpi4py, torch's own `dist.all_reduce` into a group that does nothing, and the MPI backend.

    python benchmarks/bench_mpi_backend.py [--ranks 2,4] [--sizes 1K,4K,...] [--repeats 3] [--json out.json]

About 3-5 minutes on 2 cores. Exit status 0 when every counted target is met and nothing was left running.
bench_mpi_backend_shared.py asks the same with another job's MPI ranks busy on every core.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import on_ranks
from common import Measure, Run
from workloads import parse_size

from nbdist.collectives.sweep import benchmark
from nbdist.units import format_bytes

DEFAULT_SIZES = "1K,4M,64K,256K,1M,16M,64M"
SPEEDUP_TARGETS = {1024: 20.0, 4 * 2**20: 3.0}  # size -> MPI backend busbw / gloo busbw at least
RAW_FROM, RAW_TO, RAW_RATIO = 64 * 2**10, 64 * 2**20, 1 / 1.2  # MPI backend busbw / raw mpi4py busbw at least
RAW_SMALL = {1024: 1 / 2}  # sizes below RAW_FROM with a target against raw mpi4py


def busbw(cluster, sizes: list[int], via: tuple[str, ...], repeats: int, log) -> dict[str, dict[int, list[float]]]:
    """via -> size -> busbw (GB/s) per repetition (several ways: alternated at each size by the library)."""
    out = {v: {s: [] for s in sizes} for v in via}
    for rep in range(repeats):
        order = via if rep % 2 == 0 else tuple(reversed(via))
        for size in sizes:
            for row in benchmark(ops=("all_reduce",), via=order, sizes=(size,), cluster=cluster):
                out[row["via"]][size].append(row["busbw"])
        log(f"    repetition {rep + 1}/{repeats} done")
    return out


def measures_for(n: int, sizes: list[int], gloo: dict, mpi: dict, raw: dict) -> list[Measure]:
    rows = []
    for size in sizes:
        target = SPEEDUP_TARGETS.get(size)
        rows.append(Measure(f"{n} ranks, all_reduce {format_bytes(size)}: MPI backend vs gloo", "GB/s", mpi[size],
                            gloo[size], "ratio>=", target or 1.0, counts=target is not None, anchor_name="gloo"))
    for size in sizes:
        target = RAW_RATIO if RAW_FROM <= size <= RAW_TO else RAW_SMALL.get(size)
        rows.append(Measure(f"{n} ranks, all_reduce {format_bytes(size)}: MPI backend vs raw mpi4py", "GB/s",
                            mpi[size], raw[size], "ratio>=", target or 0.0, counts=target is not None,
                            anchor_name="raw mpi4py"))
    return rows


BREAKDOWN_SIZES = (1024, 64 * 2**10, 256 * 2**10)  # where the targets against raw mpi4py are missed


def small_call_breakdown(cluster, n: int, repeats: int, size: int) -> str:
    """Where an all-reduce's time goes at a size below ~1 MiB, from one timing loop per piece on the ranks
    (on_ranks.small_call_costs, medians over `repeats`, rank 0's view): what bounds the MPI backend against raw
    mpi4py there (torch's own path into any Python backend; the agreement beside the data; the backend's own
    Python)."""
    calls = max(200, min(5000, int(2e5 / (size / 1024 + 10))))
    runs = [cluster.run(on_ranks.small_call_costs, size, calls, timeout=300)[0] for _ in range(repeats)]
    median = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    raw = median["raw mpi4py Allreduce"]
    lines = [f"{n} ranks, {format_bytes(size)} all-reduce, us per call ({calls} calls back to back, median of "
             f"{repeats}):"]
    lines += [f"  {us:8.2f} us ({us / raw:4.2f}x raw)  {name}" for name, us in median.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = sorted({parse_size(s) for s in args.sizes.split(",")})
    measures: list[Measure] = []
    details: list[str] = []
    with Run() as run:
        for n in (int(r) for r in args.ranks.split(",")):
            run.log(f"{n} ranks, gloo:")
            gloo = busbw(run.start(n, backend="gloo"), sizes, ("torch",), args.repeats, run.log)["torch"]
            run.log(f"{n} ranks, MPI backend (and raw mpi4py):")
            cluster = run.start(n, backend="mpi")
            both = busbw(cluster, sizes, ("torch", "mpi"), args.repeats, run.log)
            measures += measures_for(n, sizes, gloo, both["torch"], both["mpi"])
            details += [small_call_breakdown(cluster, n, args.repeats, size) for size in BREAKDOWN_SIZES
                        if size in sizes]
    status = run.finish(measures, details="\n".join(details), json_path=args.json,
                        settings={"sizes": sizes, "repeats": args.repeats})
    medians = {m.name: round(m.compared, 2) for m in measures}
    print("ratios (median busbw ratio): " + "; ".join(f"{k}: {v}" for k, v in medians.items()))
    return status


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Does torch.distributed over nbdist's MPI backend beat gloo on CPU engines, and come close to raw MPI?

The question (issue 10): a `dist.all_reduce` in a cell on CPU engines, through `--backend mpi` (torch.distributed
over mpi4py, nbdist/backend/ranks/mpi_backend.py) against `--backend gloo`, on 2 and 4 ranks. Targets:
- 1 KiB: at least 20x gloo's speed; 4 MiB: at least 3x;
- 64 KiB to 64 MiB: within 1.5x of raw mpi4py (`Allreduce` on the tensor's memory), i.e. busbw ratio >= 0.667.

How: `nbdist.collectives.benchmark(ops=("all_reduce",), via=...)`, the library's own timing loop (warm-up, barrier,
iterations chosen to last ~0.2 s, the slowest rank's time, busbw as nccl-tests defines it). Per rank count, one
cluster on gloo (via "torch": gloo), then one on the MPI backend (via "torch": the MPI backend, and via "mpi": raw
mpi4py on the same buffers, alternated at each size). Both backends in one run; medians over `--repeats`.

    python benchmarks/bench_mpi_backend.py [--ranks 2,4] [--sizes 1K,4K,...] [--repeats 3] [--json out.json]

About 3-5 minutes on 2 cores. Exit status 0 when every counted target is met and nothing was left running.
"""
from __future__ import annotations

import argparse
import sys

from common import Measure, Run
from workloads import parse_size

from nbdist.collectives.sweep import benchmark
from nbdist.units import format_bytes

DEFAULT_SIZES = "1K,4M,64K,256K,1M,16M,64M"
SPEEDUP_TARGETS = {1024: 20.0, 4 * 2**20: 3.0}  # size -> MPI backend busbw / gloo busbw at least
RAW_FROM, RAW_TO, RAW_RATIO = 64 * 2**10, 64 * 2**20, 1 / 1.5  # MPI backend busbw / raw mpi4py busbw at least


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
        if RAW_FROM <= size <= RAW_TO:
            rows.append(Measure(f"{n} ranks, all_reduce {format_bytes(size)}: MPI backend vs raw mpi4py", "GB/s",
                                mpi[size], raw[size], "ratio>=", RAW_RATIO, anchor_name="raw mpi4py"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = sorted({parse_size(s) for s in args.sizes.split(",")})
    measures: list[Measure] = []
    with Run() as run:
        for n in (int(r) for r in args.ranks.split(",")):
            run.log(f"{n} ranks, gloo:")
            gloo = busbw(run.start(n, backend="gloo"), sizes, ("torch",), args.repeats, run.log)["torch"]
            run.log(f"{n} ranks, MPI backend (and raw mpi4py):")
            both = busbw(run.start(n, backend="mpi"), sizes, ("torch", "mpi"), args.repeats, run.log)
            measures += measures_for(n, sizes, gloo, both["torch"], both["mpi"])
    status = run.finish(measures, json_path=args.json, settings={"sizes": sizes, "repeats": args.repeats})
    medians = {m.name: round(m.compared, 2) for m in measures}
    print("ratios (median busbw ratio): " + "; ".join(f"{k}: {v}" for k, v in medians.items()))
    return status


if __name__ == "__main__":
    sys.exit(main())

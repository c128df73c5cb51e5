#!/usr/bin/env python
"""What does the always-on flight recorder cost a small collective?

The question (issue 24): every collective and point-to-point call of nbdist's MPI backend is written into a ring on
its rank (nbdist/debugging/ranks/recorder.py), so that a hang can be explained; it must cost at most 2 % of the
collectives benchmark's 1 KiB all-reduce, the call where a fixed cost shows most.

How: one cluster per rank count (2, and 4: on 2 cores the laptop case), the library's own timing loop
(`nbdist.collectives.benchmark(ops=("all_reduce",), via=("torch",), sizes=(1024,))`: warm-up, barrier, iterations
lasting ~0.2 s, the slowest rank's time), with the recorder on and off on every rank (`recorder.on`), the two
alternated `--repeats` times, who goes first rotating. Target: median time with / without <= 1.02. Also printed:
the recorder's own cost per call in this process (begin + end, timeit), the floor of what it adds.

    python benchmarks/bench_flight_recorder.py [--ranks 2,4] [--repeats 15] [--json out.json]

About 2 minutes on 2 cores. Exit status 0 when every counted target is met and nothing was left running.
"""
from __future__ import annotations

import argparse
import sys
import timeit

import on_ranks
from common import Measure, Run, rotated

from nbdist.collectives.sweep import benchmark

SIZE = 1024
OVERHEAD_LIMIT = 1.02  # time with the recorder / time without, at most


def timed(cluster, recording: bool) -> float:
    """Seconds per 1 KiB all-reduce through torch.distributed, with the recorder on or off on every rank."""
    cluster.run(on_ranks.set_recording, recording)
    (row,) = benchmark(ops=("all_reduce",), via=("torch",), sizes=(SIZE,), cluster=cluster)
    return row["seconds"]


def recorder_cost_ns(calls: int = 200_000) -> float:
    """begin + end of one call, in this process: what the ring costs before any effect on caches."""
    import torch

    from nbdist.debugging.ranks import recorder

    group = ("0", (0, 1))

    def one() -> None:
        recorder.end(recorder.begin(group, 1, "all_reduce", None, 256, torch.float32))

    def nothing() -> None:
        pass

    spent = min(timeit.repeat(one, number=calls, repeat=5)) - min(timeit.repeat(nothing, number=calls, repeat=5))
    recorder.clear()
    return spent / calls * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    measures = []
    cost = recorder_cost_ns()
    with Run() as run:
        for n in (int(r) for r in args.ranks.split(",")):
            cluster = run.start(n, backend="mpi")
            timed(cluster, True), timed(cluster, False)  # warm-up of both
            samples: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.repeats):
                for recording in rotated([True, False], rep):
                    samples[recording].append(timed(cluster, recording))
            cluster.run(on_ranks.set_recording, True)
            run.log(f"{n} ranks: done")
            measures.append(Measure(f"{n} ranks, all_reduce 1 KiB: time with the flight recorder / without", "us",
                                    [s * 1e6 for s in samples[True]], [s * 1e6 for s in samples[False]],
                                    "ratio<=", OVERHEAD_LIMIT, anchor_name="recorder off"))
    details = f"the recorder's own cost per call (begin + end, in this process): {cost:.0f} ns"
    status = run.finish(measures, details=details, json_path=args.json,
                        settings={"repeats": args.repeats, "size": SIZE})
    print("ratios (median time with / without): " + "; ".join(f"{m.name}: {m.compared:.3f}" for m in measures))
    return status


if __name__ == "__main__":
    sys.exit(main())

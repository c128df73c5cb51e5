#!/usr/bin/env python
"""Does the MPI transport (what transport="auto" picks on CPU) move one activation faster than torch.distributed?

A pipeline's stages exchange one micro-batch's activation (and its gradient) per message. On CPU engines nbdist sends
them over MPI directly (MPICH's shared memory, the mesh's pp communicator) rather than through torch.distributed,
which torch's own pipelining uses: on the CPU default backend (mpi4py, nbdist's torch.distributed over MPI) or on
gloo (TCP loopback; --backend gloo). This checks that choice: one-way latency (ping-pong round trip / 2)
of one activation between two engines through each of nbdist's transports (`nbdist.pipeline_parallel.ranks.transport.make_transport`
over the mesh `nbdist.mesh(pp=2)`, as a pipeline makes them), sides interleaved (who goes first rotates), after a
warm-up; per repetition the median of --count round trips, medians over the repetitions.
Target: MPI / torch latency <= 1.0 at every size.

    python benchmarks/bench_p2p.py [--backend mpi|gloo] [--sizes 256x8/128,512x8/256] [--repeats 5] [--count 200]

Sizes are the pipeline benchmarks' WIDTHxLAYERS/BATCH: the message is one of 8 micro-batches' activation,
(BATCH / 8) x WIDTH float32.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import on_ranks
from common import Measure, Run, quantile, rotated
from workloads import Mlp

import nbdist

TRANSPORTS = ("mpi", "torch")
MICROBATCHES = 8
TAGS = (32000, 32001)  # no pipeline runs meanwhile: any tags will do
TARGET = 1.0
BACKEND_NAMES = {"mpi": "torch.distributed over mpi4py", "gloo": "gloo"}


def one_way_us(cluster: nbdist.Cluster, mesh, transport: str, shape: tuple, count: int) -> list[float]:
    """One-way latencies (microseconds) of `count` round trips, timed on pipeline rank 0."""
    round_trips = cluster.run(on_ranks.pingpong, mesh.name, transport, shape, count, TAGS)[0]
    return [1e6 * rtt / 2 for rtt in round_trips]


def measure(cluster: nbdist.Cluster, size: Mlp, args, log) -> tuple[Measure, dict]:
    mesh = nbdist.mesh(cluster, pp=2)
    shape = (size.batch // MICROBATCHES, size.width)
    kib = shape[0] * shape[1] * 4 / 1024
    for t in TRANSPORTS:
        one_way_us(cluster, mesh, t, shape, 20)  # warm-up
    medians: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    every: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    for rep in range(args.repeats):
        for t in rotated(list(TRANSPORTS), rep):
            got = one_way_us(cluster, mesh, t, shape, args.count)
            medians[t].append(statistics.median(got))
            every[t] += got
    log(f"  {size}: {kib:g} KiB: mpi {statistics.median(medians['mpi']):.0f} us, torch "
        f"{statistics.median(medians['torch']):.0f} us")
    row = Measure(f"one-way latency, {kib:g} KiB ({shape[0]}x{shape[1]} float32)", "us", medians["mpi"],
                  medians["torch"], "ratio<=", TARGET, anchor_name=f"torch transport ({BACKEND_NAMES[args.backend]})")
    spread = {t: {"p10_us": quantile(v, 0.1), "median_us": statistics.median(v), "p90_us": quantile(v, 0.9)}
              for t, v in every.items()}
    return row, {"message_kib": kib, **spread}


def details(spread: dict) -> str:
    lines = ["every round trip / 2 (all repetitions): p10, median, p90:"]
    for size, v in spread.items():
        lines.append(f"  {size} ({v['message_kib']:g} KiB): " + ", ".join(
            f"{t} {v[t]['p10_us']:.0f} / {v[t]['median_us']:.0f} / {v[t]['p90_us']:.0f} us" for t in TRANSPORTS))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256x8/128,512x8/256", help="pipeline sizes WIDTHxLAYERS/BATCH, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="repetitions per transport (default 5)")
    p.add_argument("--count", type=int, default=200, help="round trips per repetition (default 200)")
    p.add_argument("--backend", default="mpi", choices=("mpi", "gloo"),
                   help="the cluster's torch.distributed backend, which the torch transport goes through (default mpi, "
                        "the CPU engines' default)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    args.size_list = Mlp.parse_list(args.sizes)
    if args.repeats < 1 or args.count < 1 or not args.size_list:
        p.error("--repeats and --count must be at least 1, and --sizes must name a size")
    if any(s.batch % MICROBATCHES for s in args.size_list):
        p.error(f"every batch must split into {MICROBATCHES} micro-batches")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measures, spread = [], {}
    with Run() as run:
        run.log("2 engines: starting (point-to-point latency)")
        cluster = run.start(2, backend=args.backend)
        for size in args.size_list:
            row, spread[str(size)] = measure(cluster, size, args, run.log)
            measures.append(row)
    settings = {"repeats": args.repeats, "count": args.count, "sizes": args.sizes}
    return run.finish(measures, details(spread), True, args.json, settings, {"all_round_trips": spread})


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Does training on the MPI backend keep up: DDP at least as fast as nbdist's MPI hook, tensor parallelism 3x gloo?

The question (issue 10's training targets), 2 CPU engines, the package's MLP `nbdist.models.mlp(w, L)` (L x
Linear(w, w), a ReLU between consecutive ones; until the benchmarks used nbdist.models they built their own
L x (Linear(w, w) + ReLU): the same Linear layers, plus a ReLU after the last, torch's default init), SGD, MSE:
1. DDP: on a cluster started with `backend="mpi"`, DistributedDataParallel with no hook (its built-in all-reduce,
   which now goes through nbdist's MPI backend) against the same DDP with nbdist's MPI hook (what CPU engines used
   until now). benchmarks/on_ranks.py DdpSides: on this cluster its "gloo" side *is* the MPI backend. Target:
   backend / hook samples/s >= 1.0.
2. Tensor parallelism: the same MLP split over both ranks with DTensor (`parallelize_module`, column- then
   row-parallel), every rank on the whole batch: steps/s on the MPI backend against the same on gloo (two clusters,
   one after the other, in this run). Target: >= 3x. Shown beside it (not counted): the same step on a mesh whose
   collectives do nothing (on_ranks.no_communication_mesh: torch's own path into a backend, DTensor's dispatch and
   the compute only), against gloo: the most any backend could reach; and the MPI backend against it.
Samples are k steps back to back from a barrier to the last rank's end, after warm-up; medians over --repeats.

    python benchmarks/bench_mpi_backend_training.py [--ddp 1024x10/64] [--tp 256x4/32] [--repeats 7]
"""
from __future__ import annotations

import argparse
import sys

import cloudpickle
import on_ranks
from common import Measure, Run, rotated
from workloads import Mlp

import nbdist

LR = 1e-3
DDP_TARGET, TP_TARGET = 1.0, 3.0


def ddp_rows(cluster: nbdist.Cluster, size: Mlp, repeats: int, steps: int, log) -> list[Measure]:
    x, y = size.batch_tensors()
    build = cloudpickle.dumps(size.builder())
    key = f"ddp-{size}"
    cluster.run_each(on_ranks.ddp_setup, {r: (key, build, xs, ys, LR) for r, (xs, ys) in
                                          enumerate(zip(x.chunk(2), y.chunk(2)))})
    sides = {"backend": "gloo", "hook": "mpi"}  # DdpSides' names: its "gloo" side uses the cluster's backend
    samples = {side: [] for side in sides}
    for side in sides.values():
        cluster.run(on_ranks.ddp_steps, key, side, 3)  # warm-up (DDP regroups its buckets after a first step)
    for rep in range(repeats):
        for name in rotated(list(sides), rep):
            ends = cluster.run(on_ranks.ddp_steps, key, sides[name], steps)
            samples[name].append(steps * size.batch / (max(e["end"] for e in ends) - min(e["start"] for e in ends)))
        log(f"  DDP repetition {rep + 1}/{repeats}: backend/hook {samples['backend'][-1] / samples['hook'][-1]:.2f}")
    cluster.run(on_ranks.drop, key)
    return [Measure(f"DDP {size}: MPI backend vs MPI hook", "samples/s", samples["backend"], samples["hook"],
                    "ratio>=", DDP_TARGET, anchor_name="MPI hook")]


def tp_samples(cluster: nbdist.Cluster, size: Mlp, repeats: int, steps: int, log,
               communicate: bool = True) -> list[float]:
    x, y = size.batch_tensors()
    key = f"tp-{size}-{communicate}"
    backend = cluster.run(on_ranks.tp_setup, key, cloudpickle.dumps(size.builder()), x, y, LR, communicate)[0]
    cluster.run(on_ranks.tp_steps, key, 3)
    out = []
    for rep in range(repeats):
        ends = cluster.run(on_ranks.tp_steps, key, steps)
        out.append(steps / (max(e["end"] for e in ends) - min(e["start"] for e in ends)))
    log(f"  tensor parallel on {backend}: {sorted(out)[len(out) // 2]:.1f} steps/s (median)")
    cluster.run(on_ranks.drop, key)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", default="1024x10/64", help="DDP's MLP, WIDTHxLAYERS/GLOBAL_BATCH")
    parser.add_argument("--tp", default="256x4/32", help="the tensor-parallel MLP, WIDTHxLAYERS/BATCH")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed sample")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ddp_size, tp_size = Mlp.parse(args.ddp), Mlp.parse(args.tp)
    with Run() as run:
        run.log("2 engines on the MPI backend")
        mpi_cluster = run.start(2, backend="mpi")
        measures = ddp_rows(mpi_cluster, ddp_size, args.repeats, args.steps, run.log)
        tp_mpi = tp_samples(mpi_cluster, tp_size, args.repeats, args.steps, run.log)
        tp_free = tp_samples(mpi_cluster, tp_size, args.repeats, args.steps, run.log, communicate=False)
        run.log("2 engines on gloo")
        tp_gloo = tp_samples(run.start(2, backend="gloo"), tp_size, args.repeats, args.steps, run.log)
        measures.append(Measure(f"tensor-parallel MLP {tp_size}: MPI backend vs gloo", "steps/s", tp_mpi, tp_gloo,
                                "ratio>=", TP_TARGET, anchor_name="gloo"))
        measures.append(Measure(f"tensor-parallel MLP {tp_size}: collectives that cost nothing vs gloo (the most "
                                "any backend could reach)", "steps/s", tp_free, tp_gloo, "ratio>=", TP_TARGET,
                                counts=False, anchor_name="gloo"))
        measures.append(Measure(f"tensor-parallel MLP {tp_size}: MPI backend vs collectives that cost nothing",
                                "steps/s", tp_mpi, tp_free, "ratio>=", 0.95, counts=False,
                                anchor_name="no communication"))
    return run.finish(measures, json_path=args.json, settings=vars(args))


if __name__ == "__main__":
    sys.exit(main())

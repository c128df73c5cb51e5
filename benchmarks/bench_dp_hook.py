#!/usr/bin/env python
"""Does nbdist's MPI all-reduce hook train faster than DDP's own gloo all-reduce on CPU engines (1.2x at least)?

Two MPI engines from `nbdist.start(2)`; the package's MLP, `nbdist.models.mlp(w, L)` (L x Linear(w, w), a ReLU
between consecutive ones), built on every rank with seed 0, trained with SGD (lr 1e-3), MSE loss, every rank on its
half of one global batch (until the benchmarks used nbdist.models they built their own L x (Linear(w, w) + ReLU):
the same Linear layers, plus a ReLU after the last, torch's default init). Four sides on the same ranks
(benchmarks/on_ranks.py, DdpSides):
  mpi    DistributedDataParallel with DDP's defaults (25 MB buckets) + `register_hook(model, "mpi")`: nbdist's hook,
         what "auto" picks on CPU;
  gloo   the same DDP with no hook: DDP's built-in all-reduce over gloo (the anchor);
  ddp    `nbdist.data_parallel.ranks.ddp.ddp(model)` as a notebook gets it: the MPI hook and gradient_as_bucket_view=True
         (shown, not counted: DDP's defaults differ);
  local  the bare model, no DDP: the compute alone, so each side's communication cost is its step minus this.

Throughput (samples/s of the global batch): one `cluster.run` call per side runs k training steps back to back,
timed from an MPI barrier to the last rank's end, after warm-up; k is chosen so that a sample lasts about
--seconds. Sides rotate within every repetition; medians over repetitions. Target: mpi / gloo >= 1.2.
Sanity: every DDP side takes the same steps from the same start, so their parameters must stay equal.
Why: the all-reduce latency of each of DDP's buckets, gloo (`dist.all_reduce`, as DDP's built-in calls it)
against the MPI hook itself, interleaved; their sum per step against each side's step beyond the compute.

    python benchmarks/bench_dp_hook.py [--sizes 512x4/64,1024x10/64] [--repeats 9] [--seconds 0.5]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import cloudpickle
import on_ranks
from common import Measure, Run, rotated
from workloads import Mlp

import nbdist

SIDES = on_ranks.DDP_SIDES  # see the module docstring
TARGET = 1.2
LR = 1e-3
SANITY_ATOL = 1e-5


def samples_per_second(cluster: nbdist.Cluster, key: str, side: str, k: int, batch: int) -> float:
    """k steps of one side: barrier to the last rank's end."""
    ends = cluster.run(on_ranks.ddp_steps, key, side, k)
    return k * batch / (max(r["end"] for r in ends) - min(r["start"] for r in ends))


def measure_size(cluster: nbdist.Cluster, size: Mlp, args, log) -> tuple[list[Measure], dict]:
    """The counted row (mpi vs gloo) and the ddp() row for one model, and what explains them."""
    key = f"ddp-{size}"
    x, y = size.batch_tensors()
    build = cloudpickle.dumps(size.builder())
    shards = {r: (key, build, xs, ys, LR) for r, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2)))}
    threads = cluster.run_each(on_ranks.ddp_setup, shards)[0]
    # warm up every side (DDP regroups its buckets after its first step), then size a sample by the slowest side
    slowest = min(samples_per_second(cluster, key, side, args.warmup, size.batch) for side in SIDES)
    k = args.steps or max(3, min(100, round(args.seconds * slowest / size.batch)))
    log(f"  {k} steps per sample")
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    for rep in range(args.repeats):
        for side in rotated(list(SIDES), rep):
            samples[side].append(samples_per_second(cluster, key, side, k, size.batch))
        log(f"  {size}: repetition {rep + 1}/{args.repeats}: "
            + ", ".join(f"{side} {samples[side][-1]:.0f}" for side in SIDES)
            + f" samples/s, mpi/gloo {samples['mpi'][-1] / samples['gloo'][-1]:.2f}")
    compared = cluster.run(on_ranks.ddp_compare, key)
    cluster.run(on_ranks.drop, key)
    model = f"MLP {size.width}x{size.layers} ({size.parameters / 1e6:.2f} M params), batch {size.batch}"
    rows = [Measure(f"{model}: MPI hook", "samples/s", samples["mpi"], samples["gloo"], "ratio>=", TARGET,
                    anchor_name="DDP default (gloo)", notes={"steps_per_sample": k}),
            Measure(f"{model}: ddp()", "samples/s", samples["ddp"], samples["gloo"], "ratio>=", TARGET,
                    counts=False, anchor_name="DDP default (gloo)", notes={"steps_per_sample": k})]
    facts = {"engine_threads": threads, "steps_per_sample": k, "samples": samples,
             "max_param_diff": max(c["max_param_diff"] for c in compared),
             "bucket_bytes": compared[0]["bucket_bytes"]}
    return rows, facts


def explain(size: Mlp, facts: dict, latency: dict) -> dict:
    """Per step (ms): each side's step, what it spent beyond the compute (its step minus the local step), and the
    all-reduces alone (sum over the step's buckets, from the microbenchmark)."""
    step = {side: 1e3 * size.batch / statistics.median(v) for side, v in facts["samples"].items()}
    return {"step_ms": step,
            "beyond_compute_ms": {side: step[side] - step["local"] for side in ("mpi", "gloo", "ddp")},
            "allreduce_ms_per_step": {side: 1e3 * sum(latency[b][side] for b in facts["bucket_bytes"])
                                      for side in ("mpi", "gloo")}}


def details(facts: dict, latency: dict) -> str:
    sane = all(f["max_param_diff"] <= SANITY_ATOL for f in facts.values())
    lines = [f"sanity (same init, same steps, mpi and ddp() vs gloo): {'parameters equal' if sane else 'MISMATCH'} "
             "(max |diff| " + ", ".join(f"{s}: {f['max_param_diff']:.1e}" for s, f in facts.items()) + ")"]
    for size, f in facts.items():
        e = f["explained"]
        local = statistics.median(f["samples"]["local"])
        lines += [f"{size}: no DDP (compute only) {local:.0f} samples/s; buckets "
                  + ", ".join(f"{b / 2**20:.2f}" for b in f["bucket_bytes"]) + " MiB",
                  "    step (ms): " + ", ".join(f"{s} {v:.1f}" for s, v in e["step_ms"].items())
                  + "; beyond compute: " + ", ".join(f"{s} {v:.1f}" for s, v in e["beyond_compute_ms"].items())
                  + "; all-reduces alone: " + ", ".join(f"{s} {v:.1f}" for s, v in e["allreduce_ms_per_step"].items())]
    lines.append("all-reduce latency per bucket (median; gloo = dist.all_reduce, mpi = nbdist's hook):")
    lines += [f"  {n / 2**20:7.2f} MiB: gloo {1e3 * v['gloo']:.2f} ms, mpi {1e3 * v['mpi']:.2f} ms "
              f"({v['gloo'] / v['mpi']:.1f}x)" for n, v in sorted(latency.items())]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="512x4/64,1024x10/64",
                   help="MLPs WIDTHxLAYERS/GLOBAL_BATCH, comma-separated (default: 1.05 M and 10.5 M parameters)")
    p.add_argument("--repeats", type=int, default=9, help="timed repetitions per side (default 9)")
    p.add_argument("--seconds", type=float, default=0.5, help="about how long one timed sample lasts (default 0.5)")
    p.add_argument("--steps", type=int, default=0, help="training steps per timed sample (default: from --seconds)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (default 3)")
    p.add_argument("--latency-count", type=int, default=10, help="all-reduces per bucket size and side, x 3")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    args.size_list = Mlp.parse_list(args.sizes)
    if args.repeats < 1 or args.steps < 0 or args.warmup < 2 or args.seconds <= 0 or not args.size_list:
        p.error("--repeats must be at least 1, --warmup at least 2, --seconds positive, and --sizes must name a size")
    if any(s.batch % 2 for s in args.size_list):
        p.error("every global batch must split evenly over the 2 engines")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measures, facts, latency = [], {}, {}
    with Run() as run:
        run.log("2 engines: starting")
        cluster = run.start(2)
        for size in args.size_list:
            run.log(f"size {size}: {size.parameters:,} parameters, {size.parameters * 4 / 2**20:.1f} MiB of gradients")
            rows, facts[str(size)] = measure_size(cluster, size, args, run.log)
            measures += rows
        run.log("all-reduce latency per bucket size")
        buckets = sorted({b for f in facts.values() for b in f["bucket_bytes"]})
        raw = cluster.run(on_ranks.allreduce_latency, buckets, args.latency_count, 3)[0]
        latency = {int(n): {side: statistics.median(v) for side, v in per.items()} for n, per in raw.items()}
    for size in args.size_list:
        facts[str(size)]["explained"] = explain(size, facts[str(size)], latency)
    sane = bool(facts) and all(f["max_param_diff"] <= SANITY_ATOL for f in facts.values())
    settings = {"repeats": args.repeats, "seconds_per_sample": args.seconds, "sizes": args.sizes, "lr": LR}
    return run.finish(measures, details(facts, latency), sane, args.json, settings,
                      {"per_size": facts, "allreduce_latency_s": {str(n): v for n, v in latency.items()}})


if __name__ == "__main__":
    sys.exit(main())

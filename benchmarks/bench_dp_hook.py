#!/usr/bin/env python
"""Data-parallel training on 2 CPU engines: nbdist's MPI all-reduce hook against DDP's default gloo all-reduce.

What is measured (2 MPI engines from `nbdist.start(2)`, torch.distributed/gloo initialised by nbdist): an MLP of
L x (Linear(w, w) + ReLU), built on every rank with the same seed, trained with SGD (lr 1e-3) on the same data:
every rank holds its own half of one global batch of random inputs and targets, MSE loss. Four sides:
  mpi    DistributedDataParallel with DDP's defaults (25 MB buckets, 1 MB first bucket after DDP's regrouping)
         and `register_hook(model, "mpi")`: nbdist's hook, what "auto" picks on CPU;
  gloo   the same DDP with no hook: DDP's built-in all-reduce over gloo (the anchor);
  ddp    `nbdist.data_parallel.ddp(model)` as a notebook gets it: the MPI hook and gradient_as_bucket_view=True
         (informative: DDP's defaults differ);
  local  the bare model, no DDP: the compute alone, to show what communication costs each side.

1. throughput (samples/s of the global batch): one `cluster.run` call per side runs k training steps (zero_grad,
   forward, backward, optimizer step) back to back on both ranks, timed from an MPI barrier to the last rank's
   end, after warm-up; k is chosen so that a sample lasts about --seconds. Sides alternate within each repetition
   (who goes first rotates); medians over the repetitions. Target: median mpi / median gloo >= 1.2.
   Sanity: every DDP side takes the same steps from the same start, so their parameters must stay equal.
2. why: the all-reduce latency of each of DDP's buckets, gloo (`dist.all_reduce`, as DDP's built-in calls it)
   against the MPI hook itself (called on a stand-in bucket of the same size), interleaved, medians; their sum per
   step against what each side's step costs beyond the compute (its step time minus the local step time).

Run (the mpich wheel's mpiexec beside this Python, or one on PATH):

    python benchmarks/bench_dp_hook.py [--sizes 512x4/64,1024x10/64] [--repeats 5] [--steps 20] [--json out.json]

A run takes about a minute on 2 cores. The exit status is 0 when every target is met, the sanity check holds and
no process was left running. ipyparallel logs to stderr; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field


from common import ClusterTracker, put_mpiexec_on_path  # noqa: E402 (benchmarks/ is on sys.path)

put_mpiexec_on_path()

import torch  # noqa: E402

import nbdist  # noqa: E402

SIDES = ("mpi", "gloo", "local", "ddp")  # see the module docstring
TARGET = 1.2
LR = 1e-3
SANITY_ATOL = 1e-5


@dataclass(frozen=True)
class Size:
    width: int
    layers: int
    batch: int  # global: every rank trains on batch / world size samples

    @classmethod
    def parse(cls, text: str) -> Size:
        shape, _, batch = text.partition("/")
        width, _, layers = shape.partition("x")
        return cls(int(width), int(layers), int(batch))

    def __str__(self) -> str:
        return f"{self.width}x{self.layers}/{self.batch}"

    @property
    def parameters(self) -> int:
        return self.layers * (self.width * self.width + self.width)


# -- engine-side functions ---------------------------------------------------------------------------------------
# ipyparallel sends a function defined in __main__ as its code only (its globals on the engine are the engine's
# namespace), so each of these imports what it needs and shares state through a module it puts in sys.modules.
# Keep their imports inside them (a linter's "redefinition" fix would break them on the engines).


def _engine_setup(key: str, width: int, layers: int, batch: int, lr: float) -> dict:
    """Build both sides' DDP models (same seed), optimizers and this rank's shard of one global batch."""
    import sys
    import types

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.collectives.hooks import register_hook
    from nbdist.data_parallel import ddp

    store = sys.modules.setdefault("_bench_dp_hook_engine", types.ModuleType("_bench_dp_hook_engine")).__dict__
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    shard = x.chunk(world)[rank], y.chunk(world)[rank]
    sides = {}
    for side in ("mpi", "gloo", "local", "ddp"):
        torch.manual_seed(0)
        blocks = [(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
        module = torch.nn.Sequential(*[m for block in blocks for m in block])
        if side == "ddp":
            model = ddp(module)
        else:
            model = module if side == "local" else DistributedDataParallel(module)
        state = register_hook(model, "mpi") if side == "mpi" else None
        sides[side] = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=lr), "state": state}
    store[key] = {"sides": sides, "shard": shard}
    return {"parameters": sum(p.numel() for p in module.parameters()), "threads": torch.get_num_threads()}


def _engine_loop(key: str, side: str, k: int) -> dict:
    """k training steps of one side, from an MPI barrier; this rank's start and end (perf_counter)."""
    import sys
    import time

    import torch
    from mpi4py import MPI

    entry = sys.modules["_bench_dp_hook_engine"].__dict__[key]
    model, optimizer = entry["sides"][side]["model"], entry["sides"][side]["optimizer"]
    x, y = entry["shard"]
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(k):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return {"start": start, "end": time.perf_counter(), "loss": loss.item()}


def _engine_compare(key: str) -> dict:
    """Largest parameter difference of the MPI and ddp() sides from the gloo side, and the MPI side's bucket
    sizes (bytes)."""
    import sys

    sides = sys.modules["_bench_dp_hook_engine"].__dict__[key]["sides"]
    diff = 0.0
    for side in ("mpi", "ddp"):
        pairs = zip(sides[side]["model"].parameters(), sides["gloo"]["model"].parameters())
        diff = max(diff, *(float((a - b).abs().max()) for a, b in pairs))
    return {"max_param_diff": diff, "bucket_bytes": list(sides["mpi"]["state"].bucket_bytes)}


def _engine_drop(key: str) -> None:
    import sys

    sys.modules["_bench_dp_hook_engine"].__dict__.pop(key, None)


def _engine_allreduce(sizes: list, count: int, repeats: int) -> dict:
    """Seconds per all-reduce of a float32 bucket of each size: gloo (dist.all_reduce, as DDP's built-in) and
    nbdist's MPI hook called on a stand-in bucket; sides interleaved, an MPI barrier before each call."""
    import time

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from nbdist.collectives.hooks import mpi_allreduce_hook

    class Bucket:
        def __init__(self, tensor):
            self.tensor = tensor

        def buffer(self):
            return self.tensor

    comm = MPI.COMM_WORLD
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        calls = {"gloo": lambda: dist.all_reduce(t), "mpi": lambda: mpi_allreduce_hook(None, Bucket(t)).wait()}
        samples = {"gloo": [], "mpi": []}
        for rep in range(repeats * count + 2):
            for side in (("gloo", "mpi") if rep % 2 else ("mpi", "gloo")):
                comm.Barrier()
                started = time.perf_counter()
                calls[side]()
                if rep >= 2:  # the first two are warm-up
                    samples[side].append(time.perf_counter() - started)
        out[str(nbytes)] = samples
    return out


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class Measure:
    """One model size: samples/s of the MPI hook, of DDP's default (gloo) and of no DDP at all (the compute alone),
    one sample per side and repetition; judged by median(MPI) / median(gloo) >= limit."""

    size: Size
    samples: dict[str, list[float]]  # side -> samples/s per repetition
    steps: int  # training steps per sample
    limit: float = TARGET
    notes: dict = field(default_factory=dict)

    def median(self, side: str) -> float:
        return statistics.median(self.samples[side])

    def step_ms(self, side: str) -> float:
        return 1e3 * self.size.batch / self.median(side)

    @property
    def ratio(self) -> float:
        return self.median("mpi") / self.median("gloo")

    @property
    def per_repetition(self) -> list[float]:
        return [a / b for a, b in zip(self.samples["mpi"], self.samples["gloo"])]

    @property
    def passed(self) -> bool:
        return self.ratio >= self.limit

    def as_dict(self) -> dict:
        return {
            "size": str(self.size),
            "parameters": self.size.parameters,
            "global_batch": self.size.batch,
            "unit": "samples/s",
            **{f"{side}_median": self.median(side) for side in SIDES},
            "ratio": self.ratio,
            "ddp_ratio_info": self.median("ddp") / self.median("gloo"),
            "per_repetition_ratio": self.per_repetition,
            "median_per_repetition_ratio": statistics.median(self.per_repetition),
            "target": f"ratio >= {self.limit:g}",
            "passed": self.passed,
            "steps_per_sample": self.steps,
            "samples": self.samples,
            **self.notes,
        }


class Tracker(ClusterTracker):
    """The one cluster this run uses."""

    @property
    def cluster(self):
        return self.clusters[-1] if self.clusters else None

    def stop(self) -> None:
        self.stop_all()


# -- measuring ------------------------------------------------------------------------------------------------------


def timed_loop(cluster: nbdist.Cluster, key: str, side: str, k: int, batch: int) -> float:
    """Samples/s of k steps: barrier to the last rank's end."""
    ends = cluster.run(_engine_loop, key, side, k)
    seconds = max(r["end"] for r in ends) - min(r["start"] for r in ends)
    return k * batch / seconds


def steps_per_sample(cluster: nbdist.Cluster, key: str, size: Size, args) -> int:
    """Warm up every side (DDP regroups its buckets after its first step), then pick k so that one timed sample
    of the slowest side lasts about --seconds: short samples, many repetitions, sides close together in time."""
    slowest = min(timed_loop(cluster, key, side, args.warmup, size.batch) for side in SIDES)
    return args.steps or max(3, min(100, round(args.seconds * slowest / size.batch)))


def measure_size(cluster: nbdist.Cluster, size: Size, args, log) -> Measure:
    key = str(size)
    setup = cluster.run(_engine_setup, key, size.width, size.layers, size.batch, LR)[0]
    k = steps_per_sample(cluster, key, size, args)
    log(f"  {k} steps per sample")
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    for rep in range(args.repeats):
        for side in SIDES[rep % len(SIDES) :] + SIDES[: rep % len(SIDES)]:  # who goes first rotates
            samples[side].append(timed_loop(cluster, key, side, k, size.batch))
        log(
            f"  {size}: repetition {rep + 1}/{args.repeats}: "
            + ", ".join(f"{side} {samples[side][-1]:.0f}" for side in SIDES)
            + f" samples/s, mpi/gloo {samples['mpi'][-1] / samples['gloo'][-1]:.2f}"
        )
    compared = cluster.run(_engine_compare, key)
    cluster.run(_engine_drop, key)
    notes = {
        "engine_threads": setup["threads"],
        "max_param_diff": max(c["max_param_diff"] for c in compared),
        "bucket_bytes": compared[0]["bucket_bytes"],
    }
    return Measure(size, samples, k, notes=notes)


def measure_buckets(cluster: nbdist.Cluster, bucket_bytes: list[int], count: int, repeats: int) -> dict:
    """Median all-reduce seconds per bucket size, both sides."""
    raw = cluster.run(_engine_allreduce, sorted(set(bucket_bytes)), count, repeats)[0]
    return {int(n): {side: statistics.median(v) for side, v in per.items()} for n, per in raw.items()}


def explain(measure: Measure, latency: dict) -> dict:
    """Per step: the all-reduces alone (sum over the step's buckets, from the microbenchmark) and what each side
    spent beyond the compute (its step time minus the no-DDP step time)."""
    buckets = measure.notes["bucket_bytes"]
    local = measure.step_ms("local")
    return {
        "step_ms": {side: measure.step_ms(side) for side in SIDES},
        "allreduce_ms_per_step": {side: 1e3 * sum(latency[b][side] for b in buckets) for side in ("mpi", "gloo")},
        "beyond_compute_ms": {side: measure.step_ms(side) - local for side in ("mpi", "gloo", "ddp")},
    }


# -- report ---------------------------------------------------------------------------------------------------------


def table(measures: list[Measure]) -> str:
    header = ["model", "params", "batch", "mpi hook", "DDP default (gloo)", "ratio", "target", "result", "ddp()",
              "ddp()/gloo (info)", "no DDP (compute only)"]
    rows = [
        [
            f"MLP {m.size.width}x{m.size.layers}",
            f"{m.size.parameters / 1e6:.2f} M",
            str(m.size.batch),
            f"{m.median('mpi'):.0f} samples/s",
            f"{m.median('gloo'):.0f} samples/s",
            f"{m.ratio:.2f}",
            f">= {m.limit:g}",
            "PASS" if m.passed else "MISS",
            f"{m.median('ddp'):.0f} samples/s",
            f"{m.median('ddp') / m.median('gloo'):.2f}",
            f"{m.median('local'):.0f} samples/s",
        ]
        for m in measures
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def details(measures: list[Measure], latency: dict) -> str:
    lines = []
    for m in measures:
        e = m.notes
        spread = ", ".join(f"{side} {min(v):.0f}..{max(v):.0f}" for side, v in m.samples.items())
        lines += [
            f"{m.size} ({m.steps} steps per sample): {spread} samples/s; mpi/gloo per repetition "
            + ", ".join(f"{r:.2f}" for r in m.per_repetition)
            + f" (median {statistics.median(m.per_repetition):.2f})",
            f"    buckets {', '.join(f'{b / 2**20:.2f}' for b in e['bucket_bytes'])} MiB; step (ms): "
            + ", ".join(f"{side} {v:.1f}" for side, v in e["step_ms"].items())
            + "; beyond compute: "
            + ", ".join(f"{side} {v:.1f}" for side, v in e["beyond_compute_ms"].items())
            + "; all-reduces alone: "
            + ", ".join(f"{side} {v:.1f}" for side, v in e["allreduce_ms_per_step"].items()),
        ]
    lines.append("all-reduce latency per bucket (median; gloo = dist.all_reduce, mpi = nbdist's hook):")
    for n, v in sorted(latency.items()):
        lines.append(
            f"  {n / 2**20:7.2f} MiB: gloo {1e3 * v['gloo']:.2f} ms, mpi {1e3 * v['mpi']:.2f} ms "
            f"({v['gloo'] / v['mpi']:.1f}x)"
        )
    return "\n".join(lines)


def environment(args, threads: int | None) -> dict:
    import ipyparallel
    import mpi4py

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ipyparallel": ipyparallel.__version__,
        "mpi4py": mpi4py.__version__,
        "nbdist": nbdist.__version__,
        "cpus": os.cpu_count(),
        "engine_threads": threads,
        "machine": platform.platform(),
        "repeats": args.repeats,
        "seconds_per_sample": args.seconds,
        "sizes": args.sizes,
        "lr": LR,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes",
        default="512x4/64,1024x10/64",
        help="MLP sizes WIDTHxLAYERS/GLOBAL_BATCH, comma-separated (default 512x4/64,1024x10/64: 1.05 M and 10.5 M "
        "parameters)",
    )
    p.add_argument("--repeats", type=int, default=9, help="timed repetitions per side (default 9)")
    p.add_argument("--seconds", type=float, default=0.5, help="about how long one timed sample lasts (default 0.5)")
    p.add_argument("--steps", type=int, default=0, help="training steps per timed sample (default: from --seconds)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (default 3)")
    p.add_argument("--latency-count", type=int, default=10, help="all-reduces per bucket size and side, x 3")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    args.size_list = [Size.parse(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeats < 1 or args.steps < 0 or args.warmup < 2 or args.seconds <= 0 or not args.size_list:
        p.error("--repeats must be at least 1, --warmup at least 2, --seconds positive, and --sizes must name a size")
    if any(s.batch % 2 for s in args.size_list):
        p.error("every global batch must split evenly over the 2 engines")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tracker = Tracker()
    measures: list[Measure] = []
    latency: dict = {}
    left: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        tracker.note_foreign(text.strip()[:60])

    torch.set_num_threads(1)  # this process only waits; leave the cores to the engines
    try:
        log("2 engines: starting")
        cluster = tracker.start(2)
        for size in args.size_list:
            log(f"size {size}: {size.parameters:,} parameters, {size.parameters * 4 / 2**20:.1f} MiB of gradients")
            measures.append(measure_size(cluster, size, args, log))
        log("all-reduce latency per bucket size")
        buckets = sorted({b for m in measures for b in m.notes["bucket_bytes"]})
        latency = measure_buckets(cluster, buckets, args.latency_count, 3)
        for m in measures:
            m.notes.update(explain(m, latency))
    finally:
        tracker.stop()
        left = tracker.leftovers()
        if left:
            print("warning: processes left running:\n  " + "\n  ".join(left), file=sys.stderr)
    report(args, measures, latency, left, tracker.foreign)
    sane = all(m.notes["max_param_diff"] <= SANITY_ATOL for m in measures)
    return 0 if measures and all(m.passed for m in measures) and sane and not left else 1


def report(args, measures: list[Measure], latency: dict, left: list[str], foreign: dict) -> None:
    sane = all(m.notes["max_param_diff"] <= SANITY_ATOL for m in measures)
    print()
    print(table(measures))
    print()
    print(details(measures, latency))
    print()
    diffs = ", ".join(f"{m.size}: {m.notes['max_param_diff']:.1e}" for m in measures)
    verdict = "parameters equal" if sane else "MISMATCH"
    print(f"sanity (same init, same steps, mpi vs gloo): {verdict} (max |diff| {diffs})")
    print("leftover processes: " + ("none" if not left else "\n  " + "\n  ".join(left)))
    if foreign:
        print(
            f"warning: {len(foreign)} process(es) of another nbdist/ipyparallel run shared the machine "
            "during this run (figures skewed; rerun when it is quiet):"
        )
        for line, when in list(foreign.items())[:8]:
            print(f"  {line[:100]}  (first seen at: {when})")
    if args.json:
        threads = measures[0].notes["engine_threads"] if measures else None
        results = {
            "environment": environment(args, threads),
            "measures": [m.as_dict() for m in measures],
            "allreduce_latency_s": {str(n): v for n, v in latency.items()},
            "sanity_ok": sane,
            "leftover_processes": left,
            "foreign_processes_seen": foreign,
        }
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results written to {args.json}")


if __name__ == "__main__":
    sys.exit(main())

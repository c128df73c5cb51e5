#!/usr/bin/env python
"""Is nbdist's pipeline at least as fast as torch.distributed.pipelining, same model, batch and engines?

Two MPI engines from `nbdist.start(2)`; the model is the package's MLP, `nbdist.models.mlp(w, L)` (L x Linear(w, w),
a ReLU between consecutive ones), built on every rank with seed 0, cut with nbdist's own split (`pipe.ranges`) for
both sides; m = 8 micro-batches, MSE loss, no optimizer, gradients cleared before every step on both sides.
Until the benchmarks used nbdist.models they built their own L x (Linear(w, w) + ReLU): the same Linear layers, plus
a ReLU after the last, torch's default init. Per schedule ("gpipe", "1f1b"):

  nbdist  `nbdist.pipeline(..., stages=2, transport=T)`: T = "mpi" (what "auto" picks on CPU; counted) and "torch"
          (gloo; shown for comparison)
  anchor  torch's `ScheduleGPipe` / `Schedule1F1B` over `PipelineStage(its layers, rank, 2, device=cpu)`

measured two ways, samples per second of whole steps (forward and backward of every micro-batch):
  engine loop    one call per side runs k steps back to back on the ranks (nbdist: `nbdist.pipeline_parallel.ranks.pipeline.step`
                 with the arguments `Pipeline.step_args` gives, as `Pipeline.step` runs it; torch:
                 `schedule.step`), timed from a barrier to the last rank's end;
  per-step call  k calls from this process: `pipe.step(x, y, loss)` against `cluster.run_each(torch step)` with the
                 same per-rank arguments (inputs to rank 0, targets to rank 1): the same round trip on each side.
Sides are interleaved (who goes first rotates): engine loops side after side in every repetition, per-step calls
side after side at every step (each side's k calls timed and summed), after warm-up; medians over repetitions.
Target: nbdist / torch >= 1.0 (rows of the default transport count). Sanity: on the same batch torch's loss and
gradients equal nbdist's (both transports). Also shown: torch's implied bubble (1 - nbdist's compute per rank in
its engine loops / torch's step time: torch's stages run the same modules).

    python benchmarks/bench_pipeline_throughput.py [--sizes 256x8/128,512x8/256] [--repeats 5] [--steps 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import on_ranks
from common import Measure, Run, rotated
from torch import nn
from workloads import Mlp

import nbdist
from nbdist.pipeline_parallel.stages import unsplit_key
from nbdist.wire import portable

SCHEDULES = ("gpipe", "1f1b")
TRANSPORTS = ("mpi", "torch")  # nbdist's; "mpi" is what transport="auto" picks for CPU tensors
DEFAULT_TRANSPORT = "mpi"
WAYS = ("engine loop", "per-step call")
MICROBATCHES = 8
LOSS = nn.functional.mse_loss
TARGET = 1.0
TOLERANCE = 1e-5  # loss and gradients, float32
ANCHORS = {"gpipe": "torch ScheduleGPipe", "1f1b": "torch Schedule1F1B"}


class Sides:
    """One model size on one cluster: nbdist's pipelines (per schedule and transport) and torch's stages."""

    def __init__(self, cluster: nbdist.Cluster, size: Mlp):
        self.cluster, self.size = cluster, size
        self.x, self.y = size.batch_tensors()
        build = size.builder()
        self.pipes = {(s, t): nbdist.pipeline(build, stages=2, schedule=s, microbatches=MICROBATCHES,
                                              cluster=cluster, transport=t) for s in SCHEDULES for t in TRANSPORTS}
        self.ranges = self.pipes[(SCHEDULES[0], DEFAULT_TRANSPORT)].ranges
        self.keys = {s: f"torch-{s}-{size}" for s in SCHEDULES}
        for s, key in self.keys.items():
            cluster.run(on_ranks.torch_setup, key, portable(build), self.ranges, s, MICROBATCHES, portable(LOSS))
        self.compute_per_rank: dict[str, list[float]] = {s: [] for s in SCHEDULES}  # nbdist[mpi], engine loops

    def torch_args(self, schedule: str, *extra) -> dict:
        return {0: (self.keys[schedule], self.x, None, *extra), 1: (self.keys[schedule], None, self.y, *extra)}

    def loop(self, schedule: str, transport: str | None, k: int) -> float:
        """Samples/s of k steps back to back on the ranks (transport None: torch's side), barrier to last end."""
        if transport is None:
            results = self.cluster.run_each(on_ranks.torch_steps, self.torch_args(schedule, k))
        else:
            results = self._nbdist_loop(self.pipes[(schedule, transport)], k)
        return k * self.size.batch / (max(r["end"] for r in results) - min(r["start"] for r in results))

    def call(self, schedule: str, transport: str | None) -> float:
        """Seconds of one step called from here (transport None: torch's side)."""
        started = time.perf_counter()
        if transport is None:
            self.cluster.run_each(on_ranks.torch_step, self.torch_args(schedule))
        else:
            self.pipes[(schedule, transport)].step(self.x, self.y, LOSS)
        return time.perf_counter() - started

    def _nbdist_loop(self, pipe, k: int) -> list[dict]:
        args = {rank: (step_args, k) for rank, step_args in pipe.step_args(self.x, self.y, LOSS).items()}
        results = self.cluster.run_each(on_ranks.nbdist_steps, args)
        if pipe.transport == DEFAULT_TRANSPORT:
            for i in range(k):
                timeline = pipe.measured_timeline({r["reports"][i]["rank"]: r["reports"][i] for r in results},
                                                  stepped=False)
                busy = timeline.busy_time
                self.compute_per_rank[pipe.schedule.name].append(sum(busy.values()) / len(busy))
        return results

    def sanity(self, schedule: str) -> dict:
        """torch's loss and gradients on the batch against nbdist's, each transport."""
        losses = self.cluster.run_each(on_ranks.torch_step, self.torch_args(schedule))
        out = {"torch_loss": next(v for v in losses if v is not None)}
        torch_grads = {unsplit_key(part["first_layer"], k): g
                       for part in self.cluster.run(on_ranks.torch_grads, self.keys[schedule])
                       for k, g in part["grads"].items()}
        ok = True
        for t in TRANSPORTS:
            pipe = self.pipes[(schedule, t)]
            loss, grads = pipe.step(self.x, self.y, LOSS), pipe.grads()
            same = set(grads) == set(torch_grads)
            diff = max((grads[k] - torch_grads[k]).abs().max().item() for k in grads) if same else float("inf")
            out[f"nbdist_{t}_loss"], out[f"nbdist_{t}_max_grad_diff"] = loss, diff
            ok &= abs(loss - out["torch_loss"]) <= TOLERANCE * max(1.0, abs(loss)) and diff <= TOLERANCE
        out["ok"] = ok
        return out

    def close(self) -> None:
        for pipe in self.pipes.values():
            pipe.close()
        for key in self.keys.values():
            self.cluster.run(on_ranks.drop, key)


def measure(sides: Sides, args, log) -> tuple[list[Measure], dict]:
    """Every side, both ways, interleaved: engine loops side after side, per-step calls side after side at every
    step (so that every side sees the same moments of a shared machine). The rows, and per schedule torch's
    median seconds per step in its engine loops."""
    everyone = [("nbdist", t) for t in TRANSPORTS] + [("torch", None)]
    samples: dict = {}
    for schedule in SCHEDULES:  # warm-up: every side, both ways
        for _, transport in everyone:
            sides.loop(schedule, transport, args.warmup)
            for _ in range(args.warmup):
                sides.call(schedule, transport)
    for key in sides.compute_per_rank:
        sides.compute_per_rank[key].clear()
    for rep in range(args.repeats):
        for j, schedule in enumerate(SCHEDULES):
            for who, transport in rotated(everyone, rep + j):
                samples.setdefault((WAYS[0], schedule, who, transport), []).append(
                    sides.loop(schedule, transport, args.steps))
            seconds = {side: 0.0 for side in everyone}
            for i in range(args.steps):
                for side in rotated(everyone, rep + j + i):
                    seconds[side] += sides.call(schedule, side[1])
            for (who, transport), total in seconds.items():
                tput = args.steps * sides.size.batch / total
                samples.setdefault((WAYS[1], schedule, who, transport), []).append(tput)
        ratios = {(s, way): samples[(way, s, "nbdist", DEFAULT_TRANSPORT)][-1] / samples[(way, s, "torch", None)][-1]
                  for s in SCHEDULES for way in WAYS}
        log(f"  {sides.size}: repetition {rep + 1}/{args.repeats}: nbdist[{DEFAULT_TRANSPORT}]/torch "
            + ", ".join(f"{s} {way} {r:.2f}" for (s, way), r in ratios.items()))
    rows = [Measure(f"{sides.size} {schedule} {way}, nbdist[{t}]", "samples/s",
                    samples[(way, schedule, "nbdist", t)], samples[(way, schedule, "torch", None)], "ratio>=",
                    TARGET, counts=t == DEFAULT_TRANSPORT, anchor_name=ANCHORS[schedule],
                    notes={"steps_per_sample": args.steps})
            for way in WAYS for schedule in SCHEDULES for t in TRANSPORTS]
    torch_step_s = {s: sides.size.batch / statistics.median(samples[(WAYS[0], s, "torch", None)])
                    for s in SCHEDULES}
    return rows, torch_step_s


def implied_bubble(sides: Sides, torch_step_s: dict) -> dict:
    """torch's implied bubble per schedule: 1 - nbdist's median compute per rank and step / torch's step time."""
    out = {}
    for s in SCHEDULES:
        compute = statistics.median(sides.compute_per_rank[s])
        out[s] = {"torch_step_ms": 1e3 * torch_step_s[s], "compute_per_rank_ms": 1e3 * compute,
                  "torch_implied_bubble_pct": 100 * (1 - compute / torch_step_s[s])}
    return out


def details(sanity: dict, implied: dict, ranges: dict) -> str:
    ok = all(v["ok"] for per in sanity.values() for v in per.values())
    lines = ["sanity (same batch, same init): " + ("torch's loss and gradients equal nbdist's" if ok else "MISMATCH")]
    for size, per in sanity.items():
        lines.append(f"  {size}: layers per stage {ranges[size]}")
        for s, v in per.items():
            lines.append(f"  {size} {s}: loss torch {v['torch_loss']:.7f}, nbdist[mpi] {v['nbdist_mpi_loss']:.7f}, "
                         f"nbdist[torch] {v['nbdist_torch_loss']:.7f}; max |grad diff| mpi "
                         f"{v['nbdist_mpi_max_grad_diff']:.2e}, torch {v['nbdist_torch_max_grad_diff']:.2e}")
    lines.append("torch's implied bubble (1 - nbdist's compute per rank in its engine loops / torch's step time):")
    for size, per in implied.items():
        lines += [f"  {size} {s}: torch step {v['torch_step_ms']:.1f} ms, compute per rank "
                  f"{v['compute_per_rank_ms']:.1f} ms -> {v['torch_implied_bubble_pct']:.1f} %" for s, v in per.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256x8/128,512x8/256", help="MLPs WIDTHxLAYERS/BATCH, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per side (default 5)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed sample (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side and way first (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    args.size_list = Mlp.parse_list(args.sizes)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 1 or not args.size_list:
        p.error("--repeats, --steps and --warmup must be at least 1, and --sizes must name a size")
    if any(s.batch % MICROBATCHES for s in args.size_list):
        p.error(f"every batch must split into {MICROBATCHES} micro-batches")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measures, sanity, implied, ranges = [], {}, {}, {}
    with Run() as run:
        run.log("2 engines: starting")
        cluster = run.start(2)
        for size in args.size_list:
            run.log(f"size {size}: setting up")
            sides = Sides(cluster, size)
            ranges[str(size)] = sides.ranges
            sanity[str(size)] = {s: sides.sanity(s) for s in SCHEDULES}
            rows, torch_step_s = measure(sides, args, run.log)
            measures += rows
            implied[str(size)] = implied_bubble(sides, torch_step_s)
            sides.close()
    sane = all(v["ok"] for per in sanity.values() for v in per.values())
    settings = {"microbatches": MICROBATCHES, "repeats": args.repeats, "steps": args.steps, "sizes": args.sizes}
    return run.finish(measures, details(sanity, implied, ranges), sane, args.json, settings,
                      {"sanity": sanity, "torch_implied_bubble": implied})


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Is the bubble nbdist measures the one its schedule predicts from the measured durations (within 5 points)?

A pipeline's measured step (`Timeline.bubble_fraction`: 1 - compute / (ranks x makespan)) against its ideal: the
same schedule simulated by `Schedule.simulate` with that step's own measured durations as
`nbdist.schedules.simulate.measured_durations` gives them (per stage and kind the median compute time, and the
median message latency `comm`). The gap is what nbdist itself costs on top of the schedule: Python between
actions, MPI progress, waits that are no message's. `Pipeline.ideal()`, which the live view draws under the
measured Gantt, is the same simulation with medians over the last 5 steps (a cold step is outvoted); its bubble is
shown with each row's details, not counted.

MPI engines from `nbdist.start(p)`; the package's MLP `nbdist.models.mlp(w, L)` (L x Linear(w, w), a ReLU between
consecutive ones; until the benchmarks used nbdist.models they built their own L x (Linear(w, w) + ReLU): the same
Linear layers, plus a ReLU after the last, torch's default init) split by nbdist, m = 8 micro-batches, MSE loss,
transport "mpi" (the CPU default), schedules "gpipe" and "1f1b". Two ways, interleaved in every repetition:
  engine steps   k steps back to back on the ranks (`nbdist.pipeline_parallel.ranks.pipeline.step`, as `Pipeline.step` runs it;
                 each starts with the pipeline's barrier), each recorded in the pipeline as `Pipeline.step`
                 records its own;
  pipe.step()    k calls from this process, `pipe.timeline` after each: what a notebook user sees.
Target: |median measured - median ideal| <= 5 percentage points, p = 2 (p = 4 on a 4-engine cluster is shown, not
counted: 4 engines on 2 cores). Also shown, per schedule: the stages' median F and B, the message latency, the
ideal without message latency, and where a median step's time goes per rank (compute, receive wait, other).

    python benchmarks/bench_pipeline_bubble.py [--size 512x8/256] [--repeats 5] [--steps 10] [--no-p4]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import on_ranks
from common import Measure, Run, rotated
from torch import nn
from workloads import Mlp

import nbdist
from nbdist.schedules.simulate import Timeline, measured_durations

SCHEDULES = ("gpipe", "1f1b")
WAYS = ("engine steps", "pipe.step()")
MICROBATCHES = 8
LOSS = nn.functional.mse_loss
BUBBLE_PP = 5.0


def simulated(pipe, timelines: list[Timeline], comm: bool = True) -> Timeline:
    """The schedule simulated with the median durations of these measured steps, with or without their message
    latency (with it, over one step: that step's ideal; over the last 5: `Pipeline.ideal()`)."""
    durations = measured_durations(timelines, pipe.schedule.stages, pipe.schedule.chunks)
    return pipe.schedule.simulate(**{**durations, "comm": durations["comm"] if comm else 0.0})


def engine_steps(cluster: nbdist.Cluster, pipe, x, y, k: int) -> list[tuple]:
    """k steps on the ranks, each then recorded in the pipeline as Pipeline.step records its own: per step, (its
    measured timeline, its ideal, `pipe.ideal()`)."""
    results = cluster.run_each(on_ranks.nbdist_steps, {r: (a, k) for r, a in pipe.step_args(x, y, LOSS).items()})
    out = []
    for i in range(k):
        reports = [r["reports"][i] for r in results]
        pipe.record(reports, pipe.measured_timeline({r["rank"]: r for r in reports}, stepped=False))
        out.append((pipe.timeline, simulated(pipe, [pipe.timeline]), pipe.ideal()))
    return out


def notebook_steps(pipe, x, y, k: int) -> list[tuple]:
    """k pipe.step() calls: per step, (pipe.timeline, its ideal, pipe.ideal())."""
    out = []
    for _ in range(k):
        pipe.step(x, y, LOSS)
        out.append((pipe.timeline, simulated(pipe, [pipe.timeline]), pipe.ideal()))
    return out


def measure(cluster: nbdist.Cluster, p: int, size: Mlp, args, counts: bool, log) -> tuple[list[Measure], dict]:
    """Both ways for every schedule, interleaved; the rows and, per schedule, what explains them."""
    x, y = size.batch_tensors()
    pipes = {s: nbdist.pipeline(size.builder(), stages=p, schedule=s, microbatches=MICROBATCHES, cluster=cluster,
                                transport="mpi") for s in SCHEDULES}
    run_way = {WAYS[0]: lambda pipe, k: engine_steps(cluster, pipe, x, y, k),
               WAYS[1]: lambda pipe, k: notebook_steps(pipe, x, y, k)}
    for pipe in pipes.values():  # warm-up
        for way in WAYS:
            run_way[way](pipe, args.warmup)
    steps: dict = {(s, way): [] for s in SCHEDULES for way in WAYS}
    for rep in range(args.repeats):
        for j, schedule in enumerate(SCHEDULES):
            for way in rotated(list(WAYS), rep + j):
                steps[(schedule, way)] += run_way[way](pipes[schedule], args.steps)
        log(f"  p={p}: repetition {rep + 1}/{args.repeats} done")
    rows, explained = [], {}
    for (schedule, way), triples in steps.items():
        measured, ideals, pipe_ideals = ([100 * t.bubble_fraction for t in column] for column in zip(*triples))
        rows.append(Measure(f"p={p} {schedule} bubble, {way}", "%", measured, ideals, "diff<=", BUBBLE_PP,
                            counts=counts, anchor_name="ideal", per="step",
                            notes={"makespan_ms": [1e3 * m.makespan for m, _, _ in triples],
                                   "pipe_ideal_pct": pipe_ideals}))
        explained[f"p={p} {schedule} {way}"] = {**explain(pipes[schedule], [m for m, _, _ in triples]),
                                                 "pipe_ideal_pct_median": statistics.median(pipe_ideals)}
    for pipe in pipes.values():
        pipe.close()
    return rows, explained


def explain(pipe, timelines: list[Timeline]) -> dict:
    """The durations the ideals are made of (medians over these steps), the ideal without message latency, and
    per rank where the median step's time goes (ms)."""
    durations = measured_durations(timelines, pipe.schedule.stages, pipe.schedule.chunks)
    median_step = sorted(timelines, key=lambda t: t.makespan)[len(timelines) // 2]
    busy, wait = median_step.busy_time, median_step.wait_time
    return {
        "forward_ms": [1e3 * f for f in durations["forward"]],
        "backward_ms": [1e3 * b for b in durations["backward"]],
        "comm_ms": 1e3 * durations["comm"],
        "ideal_pct": 100 * simulated(pipe, timelines).bubble_fraction,
        "ideal_without_comm_pct": 100 * simulated(pipe, timelines, comm=False).bubble_fraction,
        "median_step_ms": {r: {"compute": 1e3 * busy[r], "recv_wait": 1e3 * wait[r],
                               "other": 1e3 * (median_step.makespan - busy[r] - wait[r])} for r in busy},
        "median_makespan_ms": 1e3 * median_step.makespan,
    }


def details(explained: dict) -> str:
    lines = ["the durations of all steps of a row (medians), the schedule simulated with them, and where a median "
             "step's time goes:"]
    for name, e in explained.items():
        stages = ", ".join(f"stage {s}: F {f:.2f} B {b:.2f}" for s, (f, b) in
                           enumerate(zip(e["forward_ms"], e["backward_ms"])))
        ranks = "; ".join(f"rank {r}: compute {v['compute']:.1f}, recv wait {v['recv_wait']:.1f}, other "
                          f"{v['other']:.1f}" for r, v in e["median_step_ms"].items())
        lines += [f"  {name}: {stages} ms; message latency {e['comm_ms']:.3f} ms",
                  f"    simulated with these: {e['ideal_pct']:.1f} %, without message latency "
                  f"{e['ideal_without_comm_pct']:.1f} %; pipe.ideal() after each step (median) "
                  f"{e['pipe_ideal_pct_median']:.1f} %",
                  f"    median step {e['median_makespan_ms']:.1f} ms: {ranks}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512x8/256", help="the MLP, WIDTHxLAYERS/BATCH (default 512x8/256)")
    p.add_argument("--repeats", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--steps", type=int, default=10, help="steps per way, schedule and repetition (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per way and schedule first (default 3)")
    p.add_argument("--no-p4", action="store_true", help="skip the 4-engine cluster (p = 4, not counted)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    args.mlp = Mlp.parse(args.size)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--repeats, --steps and --warmup must be at least 1")
    if args.mlp.batch % MICROBATCHES or args.mlp.layers < 4:
        p.error(f"the batch must split into {MICROBATCHES} micro-batches and the model have at least 4 layers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measures, explained = [], {}
    with Run() as run:
        for p in (2,) if args.no_p4 else (2, 4):
            run.log(f"{p} engines: starting ({args.mlp}, bubble, {'counted' if p == 2 else 'shown, not counted'})")
            cluster = run.start(p)
            rows, why = measure(cluster, p, args.mlp, args, p == 2, run.log)
            measures += rows
            explained.update(why)
            cluster.stop()
    settings = {"microbatches": MICROBATCHES, "repeats": args.repeats, "steps": args.steps, "size": args.size}
    return run.finish(measures, details(explained), True, args.json, settings, {"explained": explained})


if __name__ == "__main__":
    sys.exit(main())

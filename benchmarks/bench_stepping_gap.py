#!/usr/bin/env python
"""How far is a stepped step's bubble from the same step at full speed, and how much of that does the view name as
stepping's own cost?

The question (issue 24): a person clicking Step with pauses between clicks sees the measured bubble of the step's
work (pauses removed); it should read within 5 points of full speed, or the view should say which part of it is
stepping's own cost. Per pause (0 s: the tests' clicks; 1.5 s: a person reading between clicks), alternated with
full-speed steps of the same pipeline on the same cluster:
- the bubble at full speed (`Pipeline.step`, `pipe.timeline.bubble_fraction`) and stepped (`Stepper.next()` to the
  end, then `pipe.timeline`): counted, stepped - full <= 5 points;
- stepping's own cost in points of the stepped bubble (`debugging.bubbles.stepping_cost`, what the stepper view
  shows), and the rest of the stepped bubble beside the full-speed bubble;
- how much slower the stepped step's compute actions ran (median busy per action, stepped / full speed).

Two MPI engines from `nbdist.start(2)`, `nbdist.models.mlp(256, 8)` split in 2 stages, 1F1B, m = 8, MSE.

    python benchmarks/bench_stepping_gap.py [--pauses 0,1.5] [--steps 3] [--json out.json]

About 2 minutes on 2 cores (the 1.5 s pauses are most of it). Exit 0 when every counted target is met.
"""
from __future__ import annotations

import argparse
import sys
import time

from common import Measure, Run
from torch import nn
from workloads import Mlp

import nbdist
from nbdist.debugging.bubbles import median_compute, stepping_cost

LOSS = nn.functional.mse_loss
POINTS = 0.05  # stepped bubble - full-speed bubble, at most


def stepped(pipe, x, y, pause: float):
    """One step run tick by tick with `pause` seconds between the calls; its work timeline."""
    stepper = pipe.stepper(x, y, LOSS)
    while not stepper.done:
        stepper.next()
        time.sleep(pause)
    return pipe.timeline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pauses", default="0,1.5")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    size = Mlp(256, 8, 64)
    x, y = size.batch_tensors()
    measures = []
    with Run() as run:
        cluster = run.start(2)
        pipe = nbdist.pipeline(size.builder(), stages=2, schedule="1f1b", microbatches=8, cluster=cluster)
        for _ in range(3):
            pipe.step(x, y, LOSS)  # warm
        for pause in (float(p) for p in args.pauses.split(",")):
            full, step, cost, slower = [], [], [], []
            for _ in range(args.steps):
                pipe.step(x, y, LOSS)
                fast = pipe.timeline
                slow = stepped(pipe, x, y, pause)
                full.append(100 * fast.bubble_fraction)
                step.append(100 * slow.bubble_fraction)
                cost.append(100 * stepping_cost(slow) / (slow.ranks * slow.makespan))
                slower.append(median_compute(slow) / median_compute(fast))
            run.log(f"pause {pause:g} s: done")
            label = f"1F1B 2 ranks m=8, clicks {pause:g} s apart"
            measures += [
                Measure(f"{label}: stepped bubble - full-speed bubble", "points", step, full, "diff<=", 100 * POINTS,
                        anchor_name="full speed"),
                Measure(f"{label}: stepping's own cost named by the view", "points", cost, [], "abs>=", 0.0,
                        counts=False),
                Measure(f"{label}: the stepped bubble without it, beside full speed", "points",
                        [s - c for s, c in zip(step, cost)], full, "diff<=", 100 * POINTS, counts=False,
                        anchor_name="full speed"),
                Measure(f"{label}: compute per action, stepped / full speed", "x", slower, [], "abs>=", 0.0,
                        counts=False),
            ]
    status = run.finish(measures, json_path=args.json, settings={"pauses": args.pauses, "steps": args.steps})
    return status


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""What do the live dashboard and the ranks' telemetry cost a training step?

The question (issue 12: dashboard and telemetry on vs off, step-time ratio <= 1.02): the same Trainer (the
package's transformer, data parallel on 2 engines) fits K steps with the dashboard drawn (`live="always"`: the
ranks sample psutil and publish every 0.25 s, this process merges and redraws the figure every 0.5 s, as in a
notebook) and with nothing (`live=False`). Step time = wall time of fit(steps=K) / K seen from here, so the
drawing's CPU time, which on this 2-core machine competes with the engines, counts, and so does opening and closing
the dashboard (about 0.1 s per fit call: K is large enough that this is not what is measured). Sides alternate;
medians.

    python benchmarks/bench_trainer_telemetry.py [--model 4,128,64] [--batch 32] [--steps 150] [--repeats 5]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from common import Measure, Run
from workloads import Gpt, adam

import nbdist
from nbdist import models


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="4,128,64")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    gpt = Gpt.parse(args.model)
    model_fn, data_fn = gpt.builder(), gpt.text()

    on, off = [], []
    with Run() as run:
        cluster = run.start(2)
        trainer = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, batch_size=args.batch, live=False,
                                 cluster=cluster)
        trainer.fit(steps=3)

        def step_seconds(live) -> float:
            trainer.telemetry = replace(trainer.telemetry, live=live)
            started = time.perf_counter()
            trainer.fit(steps=args.steps)
            return (time.perf_counter() - started) / args.steps

        for rep in range(args.repeats):
            order = [("always", on), (False, off)] if rep % 2 == 0 else [(False, off), ("always", on)]
            for live, samples in order:
                samples.append(step_seconds(live))
            run.log(f"  repetition {rep + 1}/{args.repeats}: on {on[-1] * 1e3:.2f} ms, off {off[-1] * 1e3:.2f} ms")
        trainer.close()
    measures = [Measure(f"step time, dashboard + telemetry on / off (gpt {args.model}, batch {args.batch}, 2 ranks)",
                        "s", on, off, "ratio<=", 1.02, anchor_name="off")]
    return run.finish(measures, json_path=args.json, settings=vars(args))


if __name__ == "__main__":
    sys.exit(main())

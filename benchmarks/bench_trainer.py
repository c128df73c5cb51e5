#!/usr/bin/env python
"""Does nbdist.Trainer (data parallel) train at least as fast as the same DDP script under torchrun (gloo)?

The question (issue 12's second performance target, and issue 11's first: DDP through nbdist >= 1.5x torchrun
once MPI is the CPU default): the package's transformer, the same data set read the same way (nbdist.data.
text_dataset, batch_indices, collate), the same global batch, Adam, 2 processes either way:
  nbdist   `nbdist.Trainer(..., plan=None)` on `nbdist.start(2)` (torch.distributed over MPI, the CPU default):
           the loop runs on the ranks; samples/s = K * batch / wall time of `fit(steps=K)` seen from here;
  anchor   benchmarks/torchrun_ddp.py --dataset under `python -m torch.distributed.run --nproc_per_node 2` (gloo,
           DDP's defaults): samples/s over K steps in its own loop, barrier to barrier.
Sides alternate repetition by repetition; medians. Targets: >= 1.0 (issue 12), >= 1.5 (issue 11).

    python benchmarks/bench_trainer.py [--model 4,128,64] [--batch 32] [--steps 20] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import Measure, Run
from workloads import Gpt, adam

import nbdist
from nbdist import models

HERE = Path(__file__).resolve().parent


def torchrun_rates(model: str, batch: int, steps: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29519", str(HERE / "torchrun_ddp.py"), "--model", model,
                           "--batch", str(batch), "--steps", str(steps), "--repeats", "1", "--dataset"],
                          capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        raise RuntimeError(f"torchrun failed: {done.stderr[-2000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))["samples_per_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="4,128,64", help="layers,hidden,seq of nbdist.models.gpt")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    gpt = Gpt.parse(args.model)
    model_fn, data_fn = gpt.builder(), gpt.text()

    ours, theirs = [], []
    with Run() as run:
        run.log("2 engines (the CPU default backend)")
        cluster = run.start(2)
        trainer = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, batch_size=args.batch, live=False,
                                 cluster=cluster)
        trainer.fit(steps=3)  # warm-up, as the anchor's
        for rep in range(args.repeats):
            def measure_ours() -> None:
                started = time.perf_counter()
                trainer.fit(steps=args.steps)
                ours.append(args.steps * args.batch / (time.perf_counter() - started))
            if rep % 2 == 0:
                measure_ours()
            theirs.extend(torchrun_rates(args.model, args.batch, args.steps))
            if rep % 2 == 1:
                measure_ours()
            run.log(f"  repetition {rep + 1}/{args.repeats}: Trainer {ours[-1]:.0f}, torchrun {theirs[-1]:.0f} "
                    "samples/s")
        split = trainer.history.summary()
        trainer.close()
    name = f"DDP gpt {args.model} batch {args.batch}: Trainer(dp=2) vs torchrun (gloo)"
    measures = [Measure(name, "samples/s", ours, theirs, "ratio>=", 1.0, anchor_name="torchrun + DDP (gloo)"),
                Measure(name + " [issue 11 target]", "samples/s", ours, theirs, "ratio>=", 1.5,
                        anchor_name="torchrun + DDP (gloo)")]
    return run.finish(measures, details=split, json_path=args.json, settings=vars(args))


if __name__ == "__main__":
    sys.exit(main())

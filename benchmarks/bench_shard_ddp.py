#!/usr/bin/env python
"""Does data parallelism through nbdist train at least 1.5x as fast as the same DDP script under torchrun (gloo)?

The question (issue 11's first performance target): the package's transformer (nbdist.models.gpt), the same global
batch, Adam, 2 processes either way:
  nbdist   `nbdist.shard(model_fn, dp=2).apply(adam)` on `nbdist.start(2)` (CPU engines: torch.distributed over
           MPI, the default), `step()` called from here once per step, as a notebook does; samples/s over K steps
           from the first call to the last return (the notebook's round trip per step counted);
  anchor   benchmarks/torchrun_ddp.py under `python -m torch.distributed.run --nproc_per_node 2` (gloo, DDP's
           defaults): samples/s over K steps in its own loop.
Both draw each step's batch with nbdist.data.token_batch. Sides alternate repetition by repetition (who goes first
rotates); medians. Target: nbdist / torchrun >= 1.5 (the issue: >= 1.0, >= 1.5 once MPI is the CPU default).

    python benchmarks/bench_shard_ddp.py [--model 4,128,64] [--batch 32] [--steps 10] [--repeats 5]
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
from nbdist import data, models

TARGET = 1.5
HERE = Path(__file__).resolve().parent


def nbdist_rates(sharded, seq: int, batch: int, steps: int, start_step: int) -> float:
    corpus = data.byte_corpus()
    started = time.perf_counter()
    for s in range(start_step, start_step + steps):
        x, y = data.token_batch(corpus, s, batch, seq)
        sharded.step(x, y, models.lm_loss)
    return steps * batch / (time.perf_counter() - started)


def torchrun_rates(model: str, batch: int, steps: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29517", str(HERE / "torchrun_ddp.py"), "--model", model,
                           "--batch", str(batch), "--steps", str(steps), "--repeats", "1"],
                          capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        raise RuntimeError(f"torchrun failed: {done.stderr[-2000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    return json.loads(line)["samples_per_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="4,128,64", help="layers,hidden,seq of nbdist.models.gpt (default 4,128,64)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    gpt = Gpt.parse(args.model)
    ours, theirs = [], []
    with Run() as run:
        run.log("2 engines (the CPU default backend)")
        cluster = run.start(2)
        sharded = nbdist.shard(gpt.builder(), dp=2, cluster=cluster).apply(adam)
        nbdist_rates(sharded, gpt.seq, args.batch, 3, 0)  # warm-up
        for rep in range(args.repeats):
            first_ours = rep % 2 == 0
            if first_ours:
                ours.append(nbdist_rates(sharded, gpt.seq, args.batch, args.steps, 1000 * (rep + 1)))
            theirs += torchrun_rates(args.model, args.batch, args.steps)
            if not first_ours:
                ours.append(nbdist_rates(sharded, gpt.seq, args.batch, args.steps, 1000 * (rep + 1)))
            run.log(f"  repetition {rep + 1}/{args.repeats}: nbdist {ours[-1]:.0f}, torchrun {theirs[-1]:.0f} samples/s")
        sharded.close()
    measures = [Measure(f"DDP gpt {args.model} batch {args.batch}: nbdist.shard(dp=2) vs torchrun (gloo)",
                        "samples/s", ours, theirs, "ratio>=", TARGET, anchor_name="torchrun + DDP (gloo)")]
    return run.finish(measures, json_path=args.json, settings=vars(args))


if __name__ == "__main__":
    sys.exit(main())

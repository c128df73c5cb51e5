#!/usr/bin/env python
"""Does the Trainer train a user's model as fast as torch's own DDP and FSDP2 on the same engines and backend?

The question (issue 40): a Hugging Face LlamaForCausalLM (benchmarks/workloads.py Llama, random weights), trained on
dicts of token ids with its own loss, Adam, global batch B, 2 engines from `nbdist.start(2)` (the CPU default
backend: torch.distributed over MPI), two plans:
  nbdist   `nbdist.Trainer(llama, data, None, adam, plan={"dp": 2})` and `plan={"dp": 2, "zero": 3}`: seconds per
           step as the ranks ran them (the first step's start to the last step's end, over every rank, from the
           Trainer's history), K steps per sample;
  anchor   the same model, data set and order on the same cluster and process group, in a loop on the ranks:
           torch's DistributedDataParallel, and FSDP2 (`fully_shard` on each decoder layer, then the root: the
           units nbdist's ZeRO-3 makes); seconds per step from a barrier to the last rank's end
           (benchmarks/on_ranks.py TorchDataParallel).
Both read global batch k in nbdist.data's order (DistributedSampler's) and keep their share. Sides interleaved,
who goes first rotating; medians over repetitions. Target: nbdist / torch <= 1.05 (seconds per step).

    python benchmarks/bench_user_model_training.py [--model 4,128,64] [--batch 16] [--steps 10] [--repeats 5]
"""
from __future__ import annotations

import argparse
import sys
import time

import cloudpickle
import on_ranks
from common import Measure, Run, rotated
from workloads import Llama, adam

import nbdist

TARGET = 1.05
PLANS = {"DDP": ({"dp": 2}, "ddp"), "ZeRO-3": ({"dp": 2, "zero": 3}, "fsdp")}


def trainer_seconds(trainer, steps: int) -> tuple[float, float]:
    """(seconds per step as the ranks ran them, seconds per step seen from here) of `steps` more steps."""
    first = trainer.step
    started = time.perf_counter()
    trainer.fit(steps=steps)
    wall = time.perf_counter() - started
    rows = [trainer.history.by_step[k] for k in range(first, first + steps)]
    begin = min(v["started"] for v in rows[0]["ranks"].values())
    end = max(v["ended"] for v in rows[-1]["ranks"].values())
    return (end - begin) / steps, wall / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="4,128,64", help="layers,hidden,seq of the Hugging Face Llama")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llama = Llama.parse(args.model)
    measures, details = [], []
    with Run() as run:
        cluster = run.start(2)
        run.log(f"2 engines, {llama}, global batch {args.batch}")
        for name, (plan, kind) in PLANS.items():
            trainer = nbdist.Trainer(llama.builder(), llama.data(), None, adam, plan=plan, batch_size=args.batch,
                                     live=False, cluster=cluster)
            key = f"user-model-{kind}"
            cluster.run(on_ranks.data_parallel_setup, key, cloudpickle.dumps(llama.builder()),
                        cloudpickle.dumps(llama.data()), kind, args.batch)
            trainer.fit(steps=3)  # warm-up, both sides
            cluster.run(on_ranks.data_parallel_steps, key, 3)
            ours, theirs, seen = [], [], []
            for rep in range(args.repeats):
                for side in rotated(["nbdist", "torch"], rep):
                    if side == "nbdist":
                        ranks, wall = trainer_seconds(trainer, args.steps)
                        ours.append(ranks)
                        seen.append(wall)
                    else:
                        ends = cluster.run(on_ranks.data_parallel_steps, key, args.steps)
                        theirs.append((max(e["end"] for e in ends) - min(e["start"] for e in ends)) / args.steps)
                run.log(f"  {name} repetition {rep + 1}/{args.repeats}: Trainer {ours[-1] * 1e3:.1f} ms, torch "
                        f"{theirs[-1] * 1e3:.1f} ms per step")
            trainer.close()
            cluster.run(on_ranks.drop, key)
            anchor = "torch DDP" if kind == "ddp" else "torch fully_shard (per layer + root)"
            measures.append(Measure(f"{name} {llama} batch {args.batch}: Trainer vs {anchor}", "s", ours, theirs,
                                    "ratio<=", TARGET, anchor_name=anchor))
            measures.append(Measure(f"{name}: the Trainer's step seen from the notebook (fit's wall time / steps)",
                                    "s", seen, theirs, "ratio<=", TARGET, counts=False, anchor_name=anchor))
            details.append(f"{name}: plan {trainer.plan.describe()}")
    return run.finish(measures, details="\n".join(details), json_path=args.json, settings=vars(args))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""How long does nbdist.shard take to profile a user's model: within 2 s on 2 engines?

The question (issue 40): models nbdist did not write (a Hugging Face Llama, GPT-2 and BERT with random weights, a
ResNet-style CNN with BatchNorm: tests/user_models.py) planned with an example input on `nbdist.start(2)`:
  shard    `nbdist.shard(model_fn, dp=2, example_input=...)`: the kernel builds the model, reads its units in one
           forward and profiles every unit's parameters and saved activations (nbdist/sharding/profile.py);
  profile  `plan.profile()`: every unit timed on rank 0, the dp group's all-reduce fitted, the libraries' costs
           measured on the ranks: what the step-time prediction needs.
Seconds from the call to its return, seen from here, after one warm-up plan of the same model (a first plan in a
fresh process also imports the model's library: shown apart, not counted). Medians over repetitions. Target: shard
+ profile <= 2 s for each model.

    python benchmarks/bench_user_model_profile.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import Measure, Run

import nbdist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from user_models import BUILDERS, example  # noqa: E402 - the tests' models, built as a user would

TARGET = 2.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", default="llama,gpt2,bert,resnet")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    measures, firsts = [], []
    with Run() as run:
        cluster = run.start(2)
        for name in args.models.split(","):
            options = dict(dp=2, example_input=example(name), cluster=cluster)
            if name == "resnet":
                options["sync_batchnorm"] = True
            started = time.perf_counter()
            nbdist.shard(BUILDERS[name], **options).profile()  # warm-up: imports, the ranks' first timings
            firsts.append(f"{name}: first plan in this process {time.perf_counter() - started:.2f} s (not counted)")
            totals, shards, profiles = [], [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = nbdist.shard(BUILDERS[name], **options)
                t1 = time.perf_counter()
                plan.profile()
                t2 = time.perf_counter()
                shards.append(t1 - t0)
                profiles.append(t2 - t1)
                totals.append(t2 - t0)
            run.log(f"  {name}: shard {sorted(shards)[len(shards) // 2]:.2f} s, profile "
                    f"{sorted(profiles)[len(profiles) // 2]:.2f} s (medians)")
            measures.append(Measure(f"{name}: shard + profile, 2 engines", "s", totals, [], "abs<=", TARGET))
            measures.append(Measure(f"{name}: shard (the kernel's profile)", "s", shards, [], "abs<=", TARGET,
                                    counts=False))
            measures.append(Measure(f"{name}: profile() (timings on the ranks)", "s", profiles, [], "abs<=", TARGET,
                                    counts=False))
    return run.finish(measures, details="\n".join(firsts), json_path=args.json, settings=vars(args))


if __name__ == "__main__":
    sys.exit(main())

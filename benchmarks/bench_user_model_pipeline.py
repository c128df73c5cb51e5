#!/usr/bin/env python
"""Is nbdist's pipeline of a user's model at least as fast as torch's PipelineStage + Schedule1F1B on the same
stages?

The question (issue 40): a Hugging Face LlamaForCausalLM (benchmarks/workloads.py Llama, random weights), 2 stages
cut before its middle decoder layer, 1F1B over m micro-batches, 2 engines from `nbdist.start(2)`:
  nbdist  `nbdist.shard(llama, pp=2, microbatches=m, split_points=[...]).apply()`: each rank's stage a pruned copy of
          the model (pipeline_parallel/split.py), messages over MPI (what "auto" picks on CPU engines); k full-speed
          steps back to back on the ranks, each exactly as Pipeline.step runs it (on_ranks.nbdist_steps with the
          arguments Pipeline.step_args gives);
  anchor  torch's `PipelineStage` + `Schedule1F1B` over the same stage modules (the same pruned copies, cut at the
          same unit; on_ranks.TorchPrunedPipeline), on the default process group, k steps back to back.
torch.distributed.pipelining's own `pipeline()` does not trace these models; manual stages are its way for them.
Both compute the loss from the logits with the same function (workloads.shifted_cross_entropy), no optimizer,
gradients cleared before every step. Throughput: samples per second, barrier to the last rank's end; sides
interleaved, who goes first rotating; medians over repetitions. Target: nbdist / torch >= 1.0.

    python benchmarks/bench_user_model_pipeline.py [--model 4,128,64] [--batch 32] [--microbatches 4] [--steps 5]
"""
from __future__ import annotations

import argparse
import sys

import cloudpickle
import on_ranks
from common import Measure, Run, rotated
from workloads import Llama, shifted_cross_entropy

import nbdist

TARGET = 1.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="4,128,64", help="layers,hidden,seq of the Hugging Face Llama")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llama = Llama.parse(args.model)
    batch = llama.batch(args.batch)
    inputs, labels = {"input_ids": batch["input_ids"]}, batch["labels"]
    split = f"model.layers.{llama.layers // 2}"
    with Run() as run:
        cluster = run.start(2)
        run.log(f"2 engines, {llama}, batch {args.batch}, 1F1B over {args.microbatches} micro-batches, cut at {split}")
        plan = nbdist.shard(llama.builder(), pp=2, microbatches=args.microbatches, split_points=[split],
                            example_input={k: v[:2] for k, v in inputs.items()}, cluster=cluster)
        pipe = plan.apply()
        step_args = pipe.step_args(inputs, labels, shifted_cross_entropy)
        key = "user-model-pipeline"
        cluster.run(on_ranks.pruned_pipeline_setup, key, cloudpickle.dumps(llama.builder()), pipe.cut.units,
                    pipe.ranges, args.microbatches, cloudpickle.dumps(shifted_cross_entropy))

        def nbdist_rate() -> float:
            ends = cluster.run_each(on_ranks.nbdist_steps, {r: (step_args[r], args.steps) for r in pipe.ranks})
            return args.steps * args.batch / (max(e["end"] for e in ends) - min(e["start"] for e in ends))

        def torch_rate() -> float:
            ends = cluster.run(on_ranks.pruned_pipeline_steps, key, inputs, labels, args.steps)
            return args.steps * args.batch / (max(e["end"] for e in ends) - min(e["start"] for e in ends))

        nbdist_rate(), torch_rate()  # warm-up
        ours, theirs = [], []
        for rep in range(args.repeats):
            for side in rotated(["nbdist", "torch"], rep):
                (ours if side == "nbdist" else theirs).append(nbdist_rate() if side == "nbdist" else torch_rate())
            run.log(f"  repetition {rep + 1}/{args.repeats}: nbdist {ours[-1]:.0f}, torch {theirs[-1]:.0f} samples/s")
        cluster.run(on_ranks.drop, key)
        pipe.close()
    measures = [Measure(f"pipeline of {llama}, 1F1B, m={args.microbatches}: nbdist vs torch Schedule1F1B",
                        "samples/s", ours, theirs, "ratio>=", TARGET, anchor_name="torch PipelineStage + Schedule1F1B")]
    return run.finish(measures, details=f"stages (units): {pipe.ranges} of {pipe.cut.units}", json_path=args.json,
                      settings=vars(args))


if __name__ == "__main__":
    sys.exit(main())

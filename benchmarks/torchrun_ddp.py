#!/usr/bin/env python
"""The anchor of bench_shard_ddp.py: the same DDP training as a plain script under torchrun (gloo, no nbdist).

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/torchrun_ddp.py --model L,H,S --batch B --steps K
        --repeats R

What a user without nbdist would write: torch.distributed on gloo, DistributedDataParallel with its defaults, Adam,
each rank its half of the global batch, the model and the data from nbdist.models / nbdist.data (so both sides
train the same thing). Prints one JSON line from rank 0: samples/s per repetition (K steps from a barrier to the
end, after a warm-up), and a digest of the parameters after training (the sanity check: both sides agree).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nbdist import data, models


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="layers,hidden,seq")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--dataset", action="store_true",
                   help="read batches as nbdist.Trainer does (data.text_dataset, batch_indices, collate)")
    args = p.parse_args()
    layers, hidden, seq = (int(v) for v in args.model.split(","))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(models.gpt(seq=seq, layers=layers, hidden=hidden, heads=4, seed=0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    corpus = data.byte_corpus()
    dataset = data.text_dataset(seq=seq) if args.dataset else None
    step = 0

    def batch(k: int):
        if dataset is None:
            return data.token_batch(corpus, k, args.batch, seq)
        return data.collate(dataset, data.batch_indices(len(dataset), k, args.batch, 0))

    def run(k: int) -> float:
        nonlocal step
        dist.barrier()
        started = time.perf_counter()
        for _ in range(k):
            x, y = batch(step)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            optimizer.zero_grad()
            models.lm_loss(model(x), y).backward()
            optimizer.step()
            step += 1
        dist.barrier()
        return k * args.batch / (time.perf_counter() - started)

    run(3)  # warm-up: DDP regroups its buckets after the first step
    rates = [run(args.steps) for _ in range(args.repeats)]
    if rank == 0:
        print(json.dumps({"samples_per_s": rates, "steps": step}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

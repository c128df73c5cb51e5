#!/usr/bin/env python
"""How long does a checkpoint of the small transformer take, and how long does an asynchronous one stall training?

The question (issue 12: save <= 1 s; with async_save, training stalls <= 0.1 s): the package's transformer (default
4 layers, hidden 128) with Adam state, data parallel on 2 engines, saved with nbdist's checkpoints (DCP under the
hood, .partial folder renamed when complete): `Trainer.save()` seen from here (a complete checkpoint on disk), and
the time the ranks' loop stops for a periodic save with async_checkpoint=True (DCP async_save: the copy to memory;
the writing goes on beside training). The anchor column shows plain `torch.save` of the same state on one process.

    python benchmarks/bench_checkpoint.py [--model 4,128,64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

from common import Measure, Run
from workloads import Gpt, adam

import nbdist
from nbdist import models


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="4,128,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    gpt = Gpt.parse(args.model)
    model_fn, data_fn = gpt.builder(), gpt.text()

    folder = tempfile.mkdtemp(prefix="nbdist-bench-ckpt-")
    saves, stalls, plain = [], [], []
    try:
        with Run() as run:
            cluster = run.start(2)
            trainer = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, batch_size=8, live=False,
                                     cluster=cluster, checkpoint_dir=folder, checkpoint_every=2,
                                     async_checkpoint=True)
            trainer.fit(steps=2)
            for rep in range(args.repeats):
                started = time.perf_counter()
                trainer.save()
                saves.append(time.perf_counter() - started)
                history = trainer.fit(steps=2)
                stalls.append(max(r["checkpoint_stall_s"] for r in history if "checkpoint_stall_s" in r))
                plain.append(_torch_save(model_fn, folder))
                run.log(f"  repetition {rep + 1}/{args.repeats}: save {saves[-1]:.3f} s, async stall "
                        f"{stalls[-1]:.3f} s, torch.save {plain[-1]:.3f} s")
            trainer.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    measures = [Measure("checkpoint save (complete on disk)", "s", saves, plain, "abs<=", 1.0,
                        anchor_name="torch.save, 1 process"),
                Measure("training stall for an async_save checkpoint", "s", stalls, [], "abs<=", 0.1)]
    return run.finish(measures, json_path=args.json, settings=vars(args))


def _torch_save(model_fn, folder: str) -> float:
    import torch

    model = model_fn()
    optimizer = adam(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    started = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{folder}/plain.pt")
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())

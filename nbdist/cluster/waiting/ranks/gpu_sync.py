"""Is this rank's GPU work finished? Asked after another rank failed (this code runs ON the engines).

With NCCL a collective only queues work on the GPU: when one rank raises before it reaches a collective the others
already queued, their cells return as if nothing happened, and the unmatched operation later pairs with the wrong
one (wrong data, then a hang). Synchronising the GPU tells the two cases apart: it completes when every queued
operation found its partners, and never when one waits for the failed rank. A thread does the waiting, so the rank
answers within the time limit either way.
"""
from __future__ import annotations

import threading


def synchronise(seconds: float) -> bool:
    """True when this rank's queued GPU work completed within `seconds` (always True on a CPU rank)."""
    import torch

    from nbdist.runtime.ranks.rank import this_rank

    device = device_to_synchronise(this_rank().device)
    if device is None:
        return True
    done = threading.Event()

    def wait() -> None:
        torch.cuda.synchronize(device)
        done.set()

    threading.Thread(target=wait, daemon=True, name="nbdist-gpu-sync").start()
    return done.wait(seconds)


def device_to_synchronise(device: str):
    """The torch.device the waiting thread synchronises: the rank's own (boot's "cuda:3"), named, because CUDA's
    current device is per thread and a new thread's is cuda:0: a bare torch.cuda.synchronize() there would wait for
    GPU 0's work instead of this rank's, and make a CUDA context on GPU 0 in every rank. None on a CPU rank."""
    import torch

    return torch.device(device) if device.startswith("cuda") else None

"""Clipping the global gradient norm, ON the ranks (the Trainer's `clip`): sharded gradients counted whole, a
pipeline's stages summed over MPI, everything else left on the device."""
from __future__ import annotations

import torch

from nbdist.backend.ranks import waiting

TIMEOUT_SECONDS = 600.0  # how long a pipeline's ranks may take to sum their norms


def clip_gradients(params: list, max_norm: float, stages=None) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most `max_norm`, as torch.nn.utils.clip_grad_norm_
    does on one process; returns the norm (a tensor on the gradients' device). Everything stays on the device: each
    gradient's sum of squares is taken where it lies (a DTensor's of its shard, summed over its mesh by
    `full_tensor`: tensor-parallel slices and FSDP2 shards count whole, a collective in parameter order, every rank
    alike), and the scale is applied without asking the host whether to (a coefficient clamped at 1). Only a
    pipeline moves one number to the host: `stages`, the pipeline's MPI communicator, sums each stage's squares."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    squares = torch.stack([_sum_of_squares(g) for g in grads]).sum()
    if stages is not None:
        squares = torch.tensor(_sum_over(stages, float(squares)), dtype=torch.float64, device=squares.device)
    norm = squares.sqrt()
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        local = getattr(g, "_local_tensor", g)  # a DTensor's own shard, scaled in place
        local.mul_(coefficient.to(local.dtype))
    return norm


def _sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """The sum of `g`'s squares in float64 on its device; a DTensor's summed over the ranks holding its shards."""
    squares = g.detach().double().pow(2).sum()
    return squares.full_tensor() if hasattr(squares, "full_tensor") else squares


def _sum_over(comm, value: float) -> float:
    """`value` summed over an MPI communicator, completed by polling (an interrupt can free it)."""
    import numpy as np
    from mpi4py import MPI

    mine, total = np.array([value]), np.zeros(1)
    waiting.complete_or_abandon([comm.Iallreduce(mine, total, op=MPI.SUM)], (mine, total), TIMEOUT_SECONDS,
                                 "the pipeline's ranks did not sum their gradient norms in time")
    return float(total[0])

"""Data parallelism for a sharded model (runs ON the engines): DDP, or a plain average where DDP cannot go.

Each replica computes on its share of the global batch; gradients are averaged over the dp group before the
optimizer steps, so the replicas stay equal and train as one process on the whole batch would. With dp only (and
ZeRO 0 or 1), that is torch's DistributedDataParallel (data_parallel/ranks/ddp.py: buckets, hooks, no_sync for gradient
accumulation). With tensor parallelism too, the parameters are DTensors, which DDP does not take: then the
gradients' local shards are averaged over the dp group in one flat all-reduce after the last micro-batch.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def wrap(model: nn.Module, me, dp: int, tp: int, zero: int, options: dict) -> nn.Module:
    """DDP over the mesh's dp group when dp > 1, tp = 1 and ZeRO is 0 or 1; otherwise the model itself."""
    if dp == 1 or tp > 1 or zero >= 2:
        return model
    from nbdist.data_parallel.ranks.ddp import ddp

    options = dict(options)
    return ddp(model, hook=options.pop("hook", "auto"), process_group=me.group("dp"), **options)


def averages_by_hand(dp: int, tp: int, zero: int) -> bool:
    """Whether `average` must run after backward: dp > 1 with tensor parallelism and no FSDP."""
    return dp > 1 and tp > 1 and zero < 2


def average(model: nn.Module, dp_group, dp: int) -> None:
    """Average every gradient's local tensor over `dp_group`, in one flat all-reduce."""
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    average_grads(grads, dp, lambda flat: dist.all_reduce(flat, group=dp_group))


def average_grads(grads: list[torch.Tensor], replicas: int, all_reduce) -> None:
    """Average `grads` in place over the replicas: flattened into one buffer, summed by `all_reduce(flat)` (torch
    or MPI), divided, copied back. A tensor-parallel gradient (a DTensor) takes part with its own local shard."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [_local(g) for g in grads]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    all_reduce(flat)
    flat.div_(replicas)
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


def sync_on(model: nn.Module, last: bool, zero3_sync: str = "every"):
    """The context of one micro-batch's forward and backward: DDP all-reduces only on the last micro-batch
    (no_sync before). FSDP2 (ZeRO-2 and 3) reduce-scatters every micro-batch's gradients into its shards, unless
    `zero3_sync` is "last": then the micro-batches before the last skip the reduce-scatter (FSDP2's
    set_requires_gradient_sync(False): each rank accumulates the unsharded gradients) and keep the parameters
    gathered after backward (set_reshard_after_backward(False): the next forward gathers nothing), and the last
    restores both, so its backward reduce-scatters the whole accumulated gradient once and reshards. Set at each
    micro-batch, so a step that failed midway leaves nothing behind for the next."""
    if zero3_sync == "last" and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own local tensor (written in place), or the tensor itself."""
    return getattr(t, "_local_tensor", t)

"""What a rank really holds: bytes of its parameters, gradients and optimizer state, and the activations autograd
saves for backward, measured by storage. The plan's predictions (nbdist/sharding/memory.py) are checked
against these.

Counting storages, not tensors: views (a transposed weight, a DTensor's local shard, FSDP2's unsharded parameter
over its all-gather buffer) share memory, and a tensor's nbytes would count it again. Each storage is counted
once (by its data pointer), with its whole size: padding FSDP2 adds to a shard is memory the rank holds.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nbdist.runtime.ranks.compat import FSDPModule  # torch < 2.6 keeps it elsewhere


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); any other tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage under `t`: (0, 0) for a freed or meta one."""
    storage = _local(t).untyped_storage()
    return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() and storage.data_ptr() else (0, 0)


def _bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        ptr, size = _storage(t)
        if size and ptr not in seen:
            seen.add(ptr)
            total += size
    return total


def _fsdp_params(module: nn.Module) -> Iterator:
    """FSDP2's per-parameter records (FSDPParam) under `module`: they keep the sharded parameter, the all-gather
    buffer the unsharded parameter lives in while gathered, and an accumulated unsharded gradient."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for group in sub._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


def _parameter_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()  # FSDP2 registers the sharded ones, or the unsharded ones while gathered
    for fp in _fsdp_params(module):
        yield fp.sharded_param
        yield from fp.all_gather_outputs  # the unsharded parameter's storage; resized to 0 when resharded
        yield getattr(fp, "_unsharded_param", None)


def _grad_tensors(module: nn.Module) -> Iterator[torch.Tensor | None]:
    for p in module.parameters():
        yield p.grad
    for fp in _fsdp_params(module):
        yield fp.sharded_param.grad
        unsharded = getattr(fp, "_unsharded_param", None)
        yield unsharded.grad if unsharded is not None else None
        yield fp.unsharded_accumulated_grad


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """State tensors of `optimizer` (ZeroRedundancyOptimizer: its local optimizer's, this rank's partition).

    Scalars are left out: Adam's per-parameter `step` is a 0-d tensor, bookkeeping rather than state of the
    parameter's size, so Adam counts exactly 2 x 4 bytes per fp32 parameter element."""
    for opt in (optimizer, getattr(optimizer, "optim", None)):
        if isinstance(opt, torch.optim.Optimizer):
            for state in opt.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds now: {"params", "grads", "optimizer"}, each storage counted once, in that order.

    Parameters include DTensors' local shards and, under FSDP2, both the sharded parameters and any unsharded ones
    currently gathered (module.parameters() shows only one of the two at a time). Buffers a wrapper keeps for
    communication (DDP's gradient buckets) belong to no parameter and are not counted."""
    seen: set[int] = set()
    return {
        "params": _bytes(_parameter_tensors(module), seen),
        "grads": _bytes(_grad_tensors(module), seen),
        "optimizer": _bytes(_optimizer_tensors(optimizer), seen) if optimizer is not None else 0,
    }


class _Saved:
    """What autograd keeps in place of a saved tensor while the meter watches: when the graph lets go of it (backward
    used it, or the graph was freed), its finalizer tells the meter."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Peak bytes of the tensors autograd saved for backward and still holds, counted by storage.

        with ActivationMeter() as meter:
            loss_fn(model(x), y).backward()
        meter.peak_bytes   # the most held at once; meter.live_bytes: held now

    Parameters saved for backward (a Linear keeps its weight to compute the input's gradient) are not activations
    and are left out: nn.Parameters and views of them. Everything packed inside the block is tracked until the graph
    releases it, even after the block ends.
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, list[int]] = {}  # storage pointer -> [saved tensors holding it, its bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        ptr, size = _storage(t)
        if not size:
            return t
        entry = self._live.setdefault(ptr, [0, size])
        if entry[0] == 0:
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        saved = _Saved(t.detach())  # not t: a saved output would hold its own grad_fn, a cycle nothing frees
        weakref.finalize(saved, self._release, ptr)
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._live[ptr]


class GatheredParams:
    """The most parameter bytes the rank holds at once during forward: sampled as each top-level layer of `model`
    starts its forward, after FSDP2 gathered that layer's parameters (its own pre-forward hook runs first) and
    before it frees them; ZeRO-2 keeps every layer gathered until backward, ZeRO-3 one layer at a time. (Measured
    after a step, a sharded model holds its shards only.)"""

    def __init__(self, model: nn.Module, layers: list[nn.Module] | None = None):
        self.peak = 0
        inner = getattr(model, "module", model)  # DDP's wrapped model
        layers = list(inner.children()) if layers is None else layers  # a pipeline's: each stage's layers
        self.handles = [layer.register_forward_pre_hook(self._sample) for layer in layers]
        self._model = model

    def _sample(self, *_) -> None:
        self.peak = max(self.peak, state_bytes(self._model)["params"])

    def close(self) -> int:
        for handle in self.handles:
            handle.remove()
        return self.peak

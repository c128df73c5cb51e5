"""BatchNorm whose batch statistics span every replica of a data-parallel group, on any device (runs ON the engines).

With dp > 1, each replica of a plain BatchNorm normalises with the mean and variance of its own share of the batch,
so the replicas together train differently from one process on the whole batch. torch's `nn.SyncBatchNorm` fixes
that on GPUs only (it refuses CPU input), and nbdist's CPU engines need it too. `SyncBatchNorm` here all-reduces
per-channel sums over the group (forward: Σx, Σx², count; backward: Σdy, Σdy·x̂) with plain
`torch.distributed.all_reduce`, which the project's MPI backend, gloo and NCCL all provide. `convert` swaps it in
for every BatchNorm of a model, keeping the same parameters and buffers (state_dicts load either way).

The gradient convention (what makes DDP equal one process). Rank r holds its share x_r of the global batch
(M values per channel in all) and a loss L_r of its own outputs. The forward is the one process's:
x̂ = (x - μ)/σ with μ, σ² the (biased) moments over all M values, y = γ·x̂ + β. The backward gives each rank the
gradient of the SUM of the ranks' losses, L = Σ_s L_s, restricted to what it holds:

    ∂L/∂x_r = γ/σ · (dy_r - Σ_all dy / M - x̂_r · Σ_all dy·x̂ / M)      (dy_s = ∂L_s/∂y_s, Σ_all over every rank)
    ∂L/∂γ, ∂L/∂β: this rank's terms only, Σ_r dy_r·x̂_r and Σ_r dy_r   (not reduced here)

so every gradient a rank's backward produces (this layer's weight and bias, and every parameter before it, through
∂L/∂x_r) is its own part of ∇(Σ_s L_s): summing them over the ranks gives ∇(Σ_s L_s) exactly, and DDP, which
averages, gives ∇((1/R)·Σ_s L_s). With DDP's usual loss, L_s = the mean over rank s's share of B/R samples,
(1/R)·Σ_s L_s is the mean over the whole batch of B: the one process's loss, so the averaged gradients, the step
and the next weights are the one process's. (Had each rank's loss been Σ over its share / B, the gradients to SUM
over the ranks, not average, would be the one process's.) Weight and bias gradients are left local on purpose:
reducing them here too would count them twice under DDP. This is torch's own SyncBatchNorm convention.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    """BatchNorm1d/2d/3d in one class, with batch statistics over `process_group` (None: the default world group).

    Same parameters, buffers and state_dict keys as the BatchNorm it replaces. Training mode (or eval mode with no
    running stats): the mean and biased variance over the union of the group's batches, the running stats updated
    as torch's BatchNorm would on that whole batch (running_var from the unbiased variance over the global count;
    momentum None: a cumulative average over num_batches_tracked). Every rank of the group must call forward (and
    backward) alike. Eval mode with running stats: plain F.batch_norm, no communication. Without torch.distributed
    initialised, or on a group of one, it is a plain BatchNorm (the batch is the whole batch)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None, device=None,
                 dtype=None, *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels (dimension 1), got input of shape "
                             f"{tuple(input.shape)}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        updates = self.training and self.track_running_stats
        if not batch_stats or not self._synchronised():
            return F.batch_norm(input, self.running_mean if not self.training or self.track_running_stats else None,
                                self.running_var if not self.training or self.track_running_stats else None,
                                self.weight, self.bias, batch_stats, factor, self.eps)
        mean, var, count = global_moments(input, self.process_group)
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {count} over the group")
        if updates and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean.double())
                self.running_var.copy_(factor * unbiased + (1 - factor) * self.running_var.double())
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd, count, self.process_group)

    def _synchronised(self) -> bool:
        """Whether the statistics must be gathered: torch.distributed is up and the group has several ranks."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1


def global_moments(x: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(mean, biased variance, count) per channel over every rank's `x` of `group`, in float64: one all-reduce of
    [Σx, Σx², count]. Summed in float64, Σx²/M - μ² keeps float32's precision unless |μ|/σ passes ~10⁴."""
    channels = x.shape[1]
    wide = x.detach().to(torch.float64)
    dims = _reduced_dims(x)
    local = x.numel() // channels if channels else 0  # an empty share still takes part, with zeros
    sums = torch.cat([wide.sum(dims), (wide * wide).sum(dims), wide.new_full((1,), float(local))])
    dist.all_reduce(sums, group=group)
    count = float(sums[-1].item())
    mean = sums[:channels] / max(count, 1.0)
    var = (sums[channels:2 * channels] / max(count, 1.0) - mean * mean).clamp_(min=0)
    return mean, var, count


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; float32, float16 and bfloat16 are normalised in float32 (as torch's CPU kernel does)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_channel(t: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).reshape(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = γ·(x - μ)·invstd + β with μ, invstd already global; the backward all-reduces Σdy and Σdy·x̂ (see the
    module's docstring for the convention). μ and invstd come in detached: their dependence on x is in the backward
    formula."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, group):
        dtype = _compute_dtype(x)
        xhat = (x.to(dtype) - _per_channel(mean, x, dtype)) * _per_channel(invstd, x, dtype)
        y = xhat if weight is None else xhat * _per_channel(weight, x, dtype)
        if bias is not None:
            y = y + _per_channel(bias, x, dtype)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.has_bias, ctx.count, ctx.group = bias is not None, count, group
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        dtype, dims, channels = _compute_dtype(x), _reduced_dims(x), x.shape[1]
        dy = grad_out.to(dtype)
        xhat = (x.to(dtype) - _per_channel(mean, x, dtype)) * _per_channel(invstd, x, dtype)
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)  # this rank's share only
        grad_x = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else x.dtype)
        if ctx.needs_input_grad[0]:  # the same on every rank of a replicated model: all or none reduce
            both = torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64)
            dist.all_reduce(both, group=ctx.group)
            mean_dy = _per_channel(both[:channels] / ctx.count, x, dtype)
            mean_dy_xhat = _per_channel(both[channels:] / ctx.count, x, dtype)
            scale = invstd if weight is None else invstd * weight.detach().to(invstd.dtype)
            grad_x = ((dy - mean_dy - xhat * mean_dy_xhat) * _per_channel(scale, x, dtype)).to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def convert(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """`module` with every BatchNorm (1d/2d/3d, torch's SyncBatchNorm too) replaced by a `SyncBatchNorm` over
    `process_group`, recursively, as torch's `convert_sync_batchnorm` does: the same Parameter and buffer objects
    (so their values, device, requires_grad and an optimizer already holding them carry over), momentum, eps,
    affine, track_running_stats and training flag. A BatchNorm given itself comes back converted."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module.weight, nn.parameter.UninitializedParameter) or isinstance(
                module.running_mean, nn.parameter.UninitializedBuffer):
            raise ValueError(f"{type(module).__name__} is lazy and not initialised yet: run one forward before "
                             "converting it")
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group, device="meta",
                                  bias=module.bias is not None)  # meta: every tensor is replaced just below
        converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert(child, process_group))
    return converted

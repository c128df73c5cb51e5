"""fp16's loss scaling, agreed by every rank (runs ON the engines).

torch's GradScaler skips a step when a gradient it unscaled is not finite, and halves its scale. Each rank's
scaler sees only the gradients its rank holds: a pipeline stage its own layers, a tensor-parallel rank its own
slices, a ZeRO-1 replica (TensorParallelZero) every gradient but only after they were averaged. Left alone, one
stage would skip a step its neighbours take, and the ranks would hold different models from then on. So after
unscaling, the "found a non-finite gradient" flags are combined over all ranks (a max all-reduce of one number
per device): every rank skips the same steps and keeps the same scale, as one process would (Megatron-LM does
the same over its model-parallel group).

Tensor-parallel gradients are DTensors, which torch's fused unscale does not take beside plain tensors: each is
unscaled through its local slice (in place: the same numbers).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist


class AgreeingGradScaler(torch.amp.GradScaler):
    """A GradScaler whose skip decision is every rank's (see the module's docstring)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's, on each gradient's local slice: {device: its found-inf flag}."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not any(hasattr(g, "_local_tensor") for g in grads):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        by_place: dict = defaultdict(lambda: defaultdict(list))
        for grad in (getattr(g, "_local_tensor", g) for g in grads):
            if grad.dtype == torch.float16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            by_place[grad.device][grad.dtype].append(grad)
        flags = {}
        for device, by_dtype in by_place.items():
            flags[device] = found_inf.to(device, copy=True)
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, flags[device], inv_scale.to(device))
        return flags

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._enabled and self._scale is None:  # a pipeline stage without the loss never called scale(loss):
            # its gradients came scaled from the next stage, by the scale every rank's scaler holds
            grads = (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            self._lazy_init_scale_growth_tracker(next(grads, torch.zeros(())).device)
        super().unscale_(optimizer)
        if not dist.is_initialized():
            return
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)  # one number on every rank
        for flag in per_device.values():
            found = torch.maximum(found, flag.to(found.device).reshape(1))
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        for flag in per_device.values():
            flag.copy_(found.reshape(flag.shape))


def scaler(device_type: str, precision: str, split: bool) -> torch.amp.GradScaler | None:
    """The Trainer's loss scaler for `precision` (fp16 only): agreeing over the ranks when they train one `split`
    model (a plan); torch's own for whole replicas (sync modes: each replica steps, and skips, on its own clock)."""
    if precision != "fp16":
        return None
    return AgreeingGradScaler(device_type) if split else torch.amp.GradScaler(device_type)

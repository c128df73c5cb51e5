"""Tensor parallelism (runs ON the engines): Megatron's column- and row-parallel Linear pairs through DTensor.

A column-parallel Linear keeps out_features / tp rows of its weight, so each rank computes a slice of the features;
the row-parallel Linear after it keeps in_features / tp columns, takes that slice as its input and all-reduces its
partial output. Between the two nothing needs the whole features (attention heads, an element-wise activation), so
a pair costs one all-reduce forward and one backward. Which Linear layers pair up is decided once, in the plan
(nbdist/tensor_parallel/pairs.py, tp_pairs / tp_plan), and applied here with torch's own `parallelize_module`.
"""
from __future__ import annotations

from torch import nn

STYLES = ("colwise", "rowwise")


def apply(module: nn.Module, tp_mesh, plan: dict) -> nn.Module:
    """Split `module`'s layers named in `plan` ("colwise" / "rowwise", or a torch ParallelStyle the user gave, which
    is applied as it is) over `tp_mesh` (a 1-D DeviceMesh), in
    place. Inputs and outputs of the pairs stay plain, whole tensors (use_local_output), so the layers around them,
    and pipeline stages, see what they would see without tensor parallelism."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not plan:
        return module
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(module, tp_mesh, {name: styles[style]() if isinstance(style, str) else style
                                                for name, style in plan.items()})

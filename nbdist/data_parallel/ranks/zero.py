"""ZeRO (runs ON the engines): optimizer state, gradients and parameters sharded over the data-parallel replicas.

Stage 1 is torch's ZeroRedundancyOptimizer (zero_optimizer.py). Stages 2 and 3 are FSDP2 (`fully_shard`) on the dp
dimension of the mesh, for a sharded model (sharding/ranks/sharded.py) or each pipeline stage on its own
(pipeline_parallel/ranks/pipeline.py), one FSDP unit per top-level layer of the model plus the root: gradients are
reduce-scattered into shards and the optimizer steps the shards. Stage 3 frees each layer's gathered parameters
after its forward (reshard_after_forward=True) and gathers them again for its backward; stage 2 keeps them gathered
from forward to backward (reshard_after_forward=False), which costs memory and saves that second all-gather. On CPU
engines the mesh is a CPU DeviceMesh, so FSDP2 shards CPU tensors over the mesh's backend.
"""
from __future__ import annotations

from torch import nn


def shard(model: nn.Module, dp_mesh, stage: int, blocks: tuple[str, ...] | None = None) -> nn.Module:
    """FSDP2 over `dp_mesh` (a 1-D DeviceMesh, or the dp part of a dp x tp mesh), in place: each of `blocks`
    (qualified names: a model's repeated blocks, models/structure.py repeated_blocks, where a tied weight never
    splits two units) is one unit, by default every top-level layer that has parameters; then the root, which
    takes what is left (embeddings, the head and what they tie)."""
    from nbdist.runtime.ranks.compat import fully_shard  # public from torch 2.6, private before

    reshard = stage == 3
    if blocks is None:
        units = [layer for layer in model.children() if any(True for _ in layer.parameters())]
    else:
        units = [model.get_submodule(name) for name in blocks]
    for layer in units:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    return model

"""What one rank needs to build its share of a sharded model (pp = 1: data, tensor and ZeRO parallelism): one frozen
specification, made in the notebook by Plan.apply and sent once. Plain data, like the pipeline's StageSpec.

Pipelines (pp > 1) use nbdist's pipeline instead (pipeline_parallel/spec.py), with the tensor-parallel plan added.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.layout import Layout


@dataclass(frozen=True)
class ShardSpec:
    """One rank's share of a dp x tp plan (with ZeRO stage `zero` over dp)."""

    name: str  # the sharded model's name on the ranks (registry key)
    mesh: str  # the mesh's name on the ranks (dims dp and tp)
    layout: Layout  # dp x tp (pp = 1); zero 0: DDP (or, with tp > 1, gradients averaged over dp), 1:
    # ZeroRedundancyOptimizer, 2 and 3: FSDP2; microbatches: gradient accumulation per replica and step
    model: bytes  # the cloudpickled function that builds the whole model
    optimizer: bytes | None  # cloudpickled `params -> torch.optim.Optimizer`, or None (gradients only)
    tp_plan: dict = field(default_factory=dict)  # qualified module name -> "colwise" | "rowwise" | a ParallelStyle
    ddp: dict = field(default_factory=dict)  # DDP options: bucket_cap_mb, hook (a name in data_parallel/ranks/hooks.py)
    blocks: tuple[str, ...] | None = None  # FSDP2's units of a model not nbdist's own (its repeated blocks); None:
    # a Sequential's items
    sync_batchnorm: bool = False  # BatchNorm layers made nbdist's SyncBatchNorm over the dp group

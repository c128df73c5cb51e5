"""What every rank needs to run the Trainer's loop: one frozen specification made in the notebook by Trainer and
sent once (plain data, like ShardSpec and StageSpec; the user's functions travel cloudpickled)."""
from __future__ import annotations

from dataclasses import dataclass, field

SYNC_KINDS = ("allreduce", "local-sgd", "easgd", "ssp")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainSpec:
    name: str  # the trainer's name on the ranks (registry key)
    mesh: str  # the mesh's name on the ranks (dims dp, and pp and tp where the plan has them)
    model: str | None  # the sharded model's or pipeline's name on the ranks (None: the sync mode builds its own)
    kind: str  # "sharded" (pp = 1), "pipeline" (pp > 1) or "replica" (asynchronous modes: a plain model per rank)
    data: bytes  # cloudpickled data_fn: () -> map-style data set of (input, target)
    loss: bytes  # cloudpickled loss_fn(output, target) -> scalar
    batch_size: int  # the global batch (every replica's share together)
    seed: int
    replicas: int  # dp
    precision: str = "fp32"
    clip: float | None = None  # max gradient norm
    lr_schedule: bytes | None = None  # cloudpickled step -> factor of the optimizer's initial learning rate
    eval_data: bytes | None = None  # cloudpickled () -> data set, evaluated every eval_every steps
    eval_every: int | None = None
    eval_batches: int = 4
    straggler: dict = field(default_factory=dict)  # rank -> extra seconds per step (a slowed rank, for teaching)
    sync: str = "allreduce"
    sync_options: dict = field(default_factory=dict)
    optimizer: bytes | None = None  # "replica" kind: cloudpickled params -> optimizer
    model_fn: bytes | None = None  # "replica" kind: cloudpickled () -> model
    microbatches: int = 1  # "replica" kind: gradient accumulation
    pipeline: dict = field(default_factory=dict)  # "pipeline" kind: shapes, first/last stage ranks, layer ranges
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    async_checkpoint: bool = False  # DCP async_save: training goes on while the checkpoint is written

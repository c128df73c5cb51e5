"""The Trainer's options, grouped by concern, and what every rank needs to run its loop.

A user gives the options as keywords (`Trainer(..., batch_size=32, precision="bf16", checkpoint_dir="ckpt")`) or
as one object per concern (`Trainer(..., data=Data(batch_size=32), optimization=Optimization(precision="bf16"))`):
the layout (nbdist.Layout, or a plan), the data (`Data`), the optimisation (`Optimization`), checkpoints
(`Checkpointing`) and what is shown and written about the run (`Telemetry`). The rank side gets the same groups in
a `TrainSpec`, the user's functions made portable (nbdist/wire.py). Plain data, read on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SYNC_KINDS = ("allreduce", "local-sgd", "easgd", "ssp")
PRECISIONS = ("fp32", "bf16", "fp16")
NONFINITE = ("stop", "warn", "ignore")  # what a NaN or infinite training loss does to the fit


@dataclass(frozen=True)
class Data:
    """What each step reads (the global batch, in an order fixed by seed and step) and what is evaluated."""

    batch_size: int = 64  # the global batch (every replica's share together)
    seed: int = 0
    eval_data_fn: Any = None  # () -> data set, evaluated every eval_every steps (in a TrainSpec: cloudpickled)
    eval_every: int | None = None
    eval_batches: int = 4


@dataclass(frozen=True)
class Optimization:
    """How the gradients become a step: precision, accumulation, clipping, schedule, and how replicas agree."""

    precision: str = "fp32"  # "bf16": autocast; "fp16": autocast with loss scaling
    grad_accum: int = 1
    clip: float | None = None  # max gradient norm
    lr_schedule: Any = None  # step -> factor of the initial learning rate (in a TrainSpec: cloudpickled)
    sync: str = "allreduce"  # or "local-sgd", "easgd", "ssp": whole replicas, synchronised by their rule
    sync_options: dict = field(default_factory=dict)
    on_nonfinite: str = "stop"  # a NaN / inf loss: stop the fit at that step (one line), or "warn" / "ignore" and go on
    zero3_sync: str = "every"  # ZeRO-3 with grad_accum: reduce-scatter after "every" micro-batch or the "last" only


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often DCP checkpoints are written."""

    dir: str | None = None
    every: int | None = None
    asynchronous: bool = False  # DCP async_save: training goes on while the checkpoint is written


@dataclass(frozen=True)
class Telemetry:
    """What is shown and written about the run (kernel side), and a slowed rank for teaching (rank side)."""

    live: bool | str = True  # the dashboard in a notebook; "always": drawn even outside one
    tensorboard: str | None = None  # a TensorBoard log folder
    trace: str | None = None  # a Chrome / Perfetto trace file
    straggler: dict = field(default_factory=dict)  # rank -> extra seconds per step


@dataclass(frozen=True)
class WholeReplicas:
    """The asynchronous and periodic modes: each rank builds a whole model and its optimizer (cloudpickled)."""

    model_fn: bytes
    optimizer: bytes


@dataclass(frozen=True)
class TrainSpec:
    name: str  # the trainer's name on the ranks (registry key)
    mesh: str  # the mesh's name on the ranks (dims dp, and pp and tp where the plan has them)
    model: str | None  # the sharded model's or pipeline's name on the ranks (None: whole replicas)
    replicas: int  # dp
    data_fn: bytes  # cloudpickled () -> map-style data set of (input, target)
    loss: bytes  # cloudpickled loss_fn(output, target) -> scalar
    data: Data
    optimization: Optimization
    checkpointing: Checkpointing
    straggler: dict = field(default_factory=dict)  # rank -> extra seconds per step (Telemetry.straggler)
    whole_replicas: WholeReplicas | None = None  # set for the asynchronous modes
    pipeline: dict = field(default_factory=dict)  # pp > 1: the stages' message shapes

    @property
    def kind(self) -> str:
        """"replica" (whole replicas), "pipeline" (pp > 1) or "sharded" (a pp = 1 plan): the runner it takes."""
        return "replica" if self.whole_replicas is not None else ("pipeline" if self.pipeline else "sharded")

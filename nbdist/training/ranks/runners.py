"""What the Trainer's loop on a rank steps (training/ranks/training.py): a sharded model of a plan, a pipeline's stages,
or a whole replica with its synchroniser. Each runner has `model` and `optimizer` (what checkpoints save), `run` (one
training step: the loss and the seconds of communication and idle in it), `evaluate` (one batch's loss without
gradients, or None on a rank that computes none) and `finish`."""
from __future__ import annotations

import contextlib
import time

import torch

from nbdist.models import batches
from nbdist.models.gathered import pruned_view, unsplit_view
from nbdist.runtime.ranks import placement, registry
from nbdist.wire import restore

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # a TrainSpec's precision -> autocast's dtype


class ShardedRunner:
    """pp = 1 plans (dp, tp, ZeRO): nbdist's ShardedModel (sharding/ranks/sharded.py), built by the plan's apply()."""

    last_step = None  # only a pipeline's steps carry spans for the notebook's bubble breakdown (PipelineRunner)

    def __init__(self, name: str):
        from nbdist.sharding.ranks import sharded

        self.sharded = registry.get(sharded.KIND, name)
        self.model, self.optimizer = self.sharded.model, self.sharded.optimizer

    def run(self, step: int, x, y, loss_fn, autocast, scale, apply) -> dict:
        report = self.sharded.step(x, y, loss_fn, autocast=autocast, scale=scale, apply=apply)
        return {"loss": report["loss"], "comm_s": report["exposed_comm_s"]}

    def evaluate(self, x, y, loss_fn, autocast) -> float:
        return whole_model_loss(self.model, x, y, loss_fn, autocast)

    def finish(self) -> None:
        pass


class PipelineRunner:
    """pp > 1 plans: nbdist's pipeline executor on this rank (its stages, split over tp, averaged over dp), one
    full-speed step per call. `model` names its layers as the unsplit model does, for checkpoints."""

    def __init__(self, spec):
        from nbdist.pipeline_parallel.ranks import pipeline

        self.name, self.shapes = spec.model, spec.pipeline["shapes"]
        self.executor = registry.get(pipeline.KIND, spec.model)
        self.first, self.last = self.executor.spec.first_stage, self.executor.spec.last_stage
        self.model = (pruned_view(self.executor.modules, self.executor.spec.tied) if self.executor.spec.pruned
                      else unsplit_view(self.executor.modules, self.executor.spec.layers))
        self.optimizer = self.executor.optimizer
        # each stage's forward runs under the executor's autocast
        self.executor.autocast_dtype = AUTOCAST_DTYPES.get(spec.optimization.precision)
        self.last_step: dict | None = None  # the newest step's spans, for the notebook's bubble breakdown

    def run(self, step: int, x, y, loss_fn, autocast, scale, apply) -> dict:
        from nbdist.pipeline_parallel.ranks import pipeline
        from nbdist.schedules.actions import Action

        self.executor.apply_optimizer, self.executor.scale_loss = apply, scale
        started = time.perf_counter()
        pruned = self.executor.spec.pruned  # a pruned stage runs the model's forward from the top: it takes the inputs
        report = pipeline.step(self.name, self.shapes, x if self.first or pruned else None,
                               y if self.last else None, loss_fn)
        wall = time.perf_counter() - started
        self.last_step = {"step": step, "spans": report["spans"], "calls": report["calls"], "host": report["host"]}
        compute = comm = 0.0
        for action, start, end, *_ in report["spans"]:
            if Action.parse(action).is_compute:
                compute += end - start
            else:
                comm += end - start
        return {"loss": report["loss"], "comm_s": comm, "idle_s": max(0.0, wall - compute - comm)}

    def evaluate(self, x, y, loss_fn, autocast) -> float | None:
        """Forward only through the stages (executor.evaluate, under the autocast the executor was given); the loss
        on the last stage, None elsewhere."""
        pruned = self.executor.spec.pruned
        return self.executor.evaluate(x if self.first or pruned else None, y if self.last else None, loss_fn)

    def finish(self) -> None:
        pass


def whole_model_loss(model, x, y, loss_fn, autocast) -> float:
    """The loss of a model that takes the whole input on this rank (a replica, a tensor-parallel or ZeRO model),
    without gradients."""
    with torch.no_grad(), (autocast or contextlib.nullcontext()):
        return float(batches.loss_of(batches.call(model, x), y, loss_fn))


class ReplicaRunner:
    """The asynchronous and periodic modes (local SGD, EASGD, SSP): each rank a whole model and its own
    optimizer; the synchroniser (training/ranks/sync_modes.py) decides what crosses the network and when."""

    last_step = None  # as ShardedRunner's

    def __init__(self, spec, me):
        from nbdist.training.ranks import sync_modes
        from nbdist.training.ranks.inputs import InputError

        model = restore(spec.whole_replicas.model_fn)()
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"model_fn must return an nn.Module, got {type(model).__name__}")
        self.model = placement.place(model)  # moved once, before its optimizer
        self.optimizer = restore(spec.whole_replicas.optimizer)(self.model.parameters())
        if not hasattr(self.optimizer, "param_groups"):
            raise InputError(f"optimizer_fn must return a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        options = spec.optimization
        self.sync = sync_modes.make(options.sync, self.model, self.optimizer, me.comm("dp"), dict(options.sync_options))
        self.microbatches = options.grad_accum

    def run(self, step: int, x, y, loss_fn, autocast, scale, apply) -> dict:
        self.sync.scale, self.sync.apply = scale, apply  # loss scaling and clipping, per replica
        with autocast if autocast is not None else contextlib.nullcontext():
            return self.sync.step(step, x, y, loss_fn, self.microbatches)

    def evaluate(self, x, y, loss_fn, autocast) -> float:
        return whole_model_loss(self.model, x, y, loss_fn, autocast)

    def finish(self) -> None:
        self.sync.finish()


def make(spec, me):
    """The runner of a TrainSpec's kind, on this rank."""
    if spec.kind == "sharded":
        return ShardedRunner(spec.model)
    if spec.kind == "replica":
        return ReplicaRunner(spec, me)
    if spec.kind == "pipeline":
        return PipelineRunner(spec)
    raise ValueError(f"no runner for {spec.kind!r}")

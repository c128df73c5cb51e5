"""Sharded: a dp x tp plan (ZeRO over dp) built on the cluster, driven from the notebook (kernel side).

The same face as Pipeline: `step(inputs, targets, loss_fn) -> loss` trains one step on the global batch (each
replica gets its share; the tp ranks of a replica get the same share), `state_dict()` and `grads()` gather the
whole model under the unsplit keys, `timeline` is the last step's measured forward and backward per rank. The
ranks' side is nbdist/sharding/ranks/sharded.py.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from nbdist.errors import DistUsageError
from nbdist.models.gathered import GatheredModel
from nbdist.pipeline_parallel.inputs import check_batch, check_step_inputs
from nbdist.schedules.simulate import Timeline
from nbdist.sharding.ranks import sharded as on_ranks
from nbdist.sharding.spec import ShardSpec
from nbdist.models import batches
from nbdist.models.structure import repeated_blocks
from nbdist.wire import portable

_numbers = itertools.count()


class Sharded(GatheredModel):
    def __init__(self, plan, optimizer_fn: Callable | None):
        self.plan, self.cluster = plan, plan.cluster
        self.mesh = self.cluster.mesh(dp=plan.dp, tp=plan.tp)
        self.id = f"shard{next(_numbers)}"
        ddp = {"hook": plan.hook} | ({"bucket_cap_mb": plan.bucket_cap_mb} if plan.bucket_cap_mb else {})
        spec = ShardSpec(self.id, self.mesh.name, plan.layout,
                         portable(plan.model_fn), portable(optimizer_fn),
                         dict(plan.tp_styles) if plan.tp > 1 else {}, ddp,
                         blocks=None if plan.flat else tuple(repeated_blocks(plan.model)),
                         sync_batchnorm=plan.choices.sync_batchnorm)
        problems = [line for line in self.cluster.run(on_ranks.setup, spec) if line]
        if problems:
            raise DistUsageError(problems[0])
        self.timeline: Timeline | None = None
        self.last_results: list[dict] = []
        self.memory_results: list[dict] = []  # the last step run with memory=True
        self.loss: float | None = None

    def step(self, inputs, targets: torch.Tensor | None = None, loss_fn: Callable | None = None,
             memory: bool = False, timeout: float | None = None) -> float:
        """One training step on the global batch; returns its loss (the mean over the replicas' micro-batches).
        `inputs`: what the model takes (a tensor, a tuple, or a dict for model(**inputs)); `loss_fn(output,
        targets)`, or None for the loss the model's output carries (labels in `inputs`). `memory=True` also
        measures the bytes each rank holds (see measured_memory)."""
        self.cluster.check_fresh(self.mesh.generation, f"sharded model {self.id}")
        check_batch(inputs, targets, self.plan.dp, self.plan.microbatches)
        check_step_inputs(self.plan.model, inputs, loss_fn)
        xs = batches.split(inputs, self.plan.dp)
        ys = targets.chunk(self.plan.dp) if targets is not None else [None] * self.plan.dp
        loss_fn = portable(loss_fn)
        args = {}
        for rank in range(self.cluster.world_size):
            replica = self.mesh.coords(rank)["dp"]
            args[rank] = (self.id, xs[replica], ys[replica], loss_fn, memory)
        results = self.cluster.run_each(on_ranks.step, args, timeout=timeout)
        self.last_results = results
        if memory:
            self.memory_results = results
        self.timeline = Timeline.from_spans({r["rank"]: r["spans"] for r in results}, name="measured step")
        firsts = [r["loss"] for r in results if r["coords"]["tp"] == 0]
        self.loss = sum(firsts) / len(firsts)
        return self.loss

    def step_seconds(self) -> float:
        """The last step's time: first rank's start to last rank's end (the ranks share one host clock)."""
        return max(r["ended"] for r in self.last_results) - min(r["started"] for r in self.last_results)

    def measured_memory(self) -> list[dict]:
        """Per rank, the bytes it held in the last step run with memory=True: params, grads, optimizer,
        activations."""
        if not self.memory_results:
            raise DistUsageError("no step measured memory yet: run step(..., memory=True)")
        return [{"rank": r["rank"], **r["memory"]} for r in self.memory_results]

    def side_by_side(self) -> list[dict]:
        """Per rank, the plan's prediction beside the measurement (see Plan.side_by_side)."""
        return self.plan.side_by_side(self)

    def _gather(self, grads: bool) -> dict:
        self.cluster.check_fresh(self.mesh.generation, f"sharded model {self.id}")
        per_rank = self.cluster.run(on_ranks.parameters, self.id, grads)
        return next(tensors for tensors in per_rank if tensors is not None)

    def close(self) -> None:
        if self.cluster.running and self.cluster.generation == self.mesh.generation:
            self.cluster.run(on_ranks.close, self.id)

    def __repr__(self) -> str:
        return f"<nbdist Sharded {self.id}: {self.plan.describe()}>"

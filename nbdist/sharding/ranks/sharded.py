"""A sharded model on the ranks (runs ON the engines): what the notebook's Sharded (nbdist/sharding/plan.py) calls.

`setup(spec)` builds this rank's share of a dp x tp plan from its ShardSpec: the whole model from the user's
function, tensor parallel pairs split over the mesh's tp group, then the data-parallel wrapping its ZeRO stage asks
for, and the optimizer. `step` trains one step on this replica's share of the global batch, micro-batch by
micro-batch (gradient accumulation), and reports the loss, the times of each micro-batch's forward and backward,
and, when asked, the bytes the rank holds (and, as `held_between`, the parameter and gradient bytes it keeps from
one micro-batch to the next: ZeRO-3's shards, or with zero3_sync="last" the unsharded parameters and gradients).
`parameters` gathers the whole, unsplit weights or gradients (a collective over every rank: DTensor shards are
gathered), `close` frees it all.
"""
from __future__ import annotations

import contextlib

import torch

from nbdist.cluster.meshes.ranks import rank_mesh
from nbdist.data_parallel.ranks import data_parallel, zero, zero_optimizer
from nbdist.models import batches
from nbdist.models.gathered import whole
from nbdist.runtime.ranks import placement, registry
from nbdist.tensor_parallel.ranks import tensor_parallel
from nbdist.wire import restore

KIND = "sharded"


class ShardedModel:
    """This rank's model, optimizer and place in the mesh."""

    def __init__(self, spec):
        self.spec = spec
        self.me = rank_mesh.here(spec.mesh)
        model = placement.place(restore(spec.model)())  # built on CPU by the user's function: moved once, here
        layout = spec.layout
        if spec.sync_batchnorm and layout.dp > 1:  # statistics over every replica's share, as one process has them
            from nbdist.data_parallel.ranks import sync_batchnorm

            model = sync_batchnorm.convert(model, self.me.group("dp"))
        if layout.tp > 1:
            tensor_parallel.apply(model, self.me.device_mesh["tp"], spec.tp_plan)
        if layout.zero >= 2:
            zero.shard(model, self.me.device_mesh["dp"], layout.zero, spec.blocks)
        self.model = data_parallel.wrap(model, self.me, layout.dp, layout.tp, layout.zero, spec.ddp)
        make = restore(spec.optimizer)
        self.optimizer = None if make is None else zero_optimizer.optimizer(
            self.model.parameters(), make, layout.zero, self.me.group("dp"))
        self.by_hand = data_parallel.averages_by_hand(layout.dp, layout.tp, layout.zero)
        self.watch: placement.HostClock | placement.CudaClock | None = None  # the running step's clock
        self.last_gradient = None  # a mark of when backward last accumulated a parameter's gradient
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(self._gradient_done)

    def _gradient_done(self, _param) -> None:
        if self.watch is not None:
            self.last_gradient = self.watch.mark()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, memory: bool = False, autocast=None,
             scale=None, apply=None) -> dict:
        """One training step on this replica's share; the optimizer (if any) steps at the end. Gradients stay
        until the next step begins, so `parameters(grads=True)` reads this step's.

        The Trainer's seams: `autocast` (a context) around each forward, `scale(loss)` before backward (fp16 loss
        scaling), `apply(optimizer)` instead of `optimizer.step()` (clipping, the scaler's step)."""
        m = self.spec.layout.microbatches
        inputs = batches.to(inputs, placement.here())  # from the notebook, on CPU; the Trainer's are here
        targets = None if targets is None else targets.to(placement.here())
        self.model.zero_grad(set_to_none=True)
        meter = _memory().ActivationMeter() if memory else None
        marks, losses, held_between = [], [], 0
        gathered = _memory().GatheredParams(self.model) if memory else None
        watch = self.watch = placement.stopwatch()
        self.last_gradient = None
        started = watch.mark()
        for i, (x, y) in enumerate(zip(batches.split(inputs, m), [None] * m if targets is None else targets.chunk(m))):
            with data_parallel.sync_on(self.model, last=i == m - 1, zero3_sync=self.spec.layout.zero3_sync):
                t0 = watch.mark()
                with meter if meter is not None else contextlib.nullcontext():
                    with self._phase(f"the forward of micro-batch {i}"):
                        with autocast if autocast is not None else contextlib.nullcontext():
                            loss = batches.loss_of(batches.call(self.model, x), y, loss_fn)
                    t1 = watch.mark()
                    with self._phase(f"the backward of micro-batch {i}"):
                        (loss / m if scale is None else scale(loss / m)).backward()
                t2 = watch.mark()
            marks += [(f"0F{i}", t0, t1), (f"0B{i}", t1, t2)]
            losses.append(loss.detach())
            if memory and i < m - 1:  # what stays between micro-batches (ZeRO-3 with zero3_sync="last": unsharded)
                now = _memory().state_bytes(self.model)
                held_between = max(held_between, now["params"] + now["grads"])
        backward_ended, last_gradient = t2, self.last_gradient
        by_hand = None
        if self.by_hand:
            by_hand = watch.mark()
            data_parallel.average(self.model, self.me.group("dp"), self.spec.layout.dp)
        averaged = watch.mark()
        if self.optimizer is not None:
            with self._phase("the optimizer step"):
                self.optimizer.step() if apply is None else apply(self.optimizer)
        ended = watch.mark()
        watch.settle()
        self.watch = None
        at = watch.seconds
        exposed = max(0.0, at(backward_ended) - at(last_gradient)) if last_gradient is not None else 0.0
        if by_hand is not None:
            exposed += at(averaged) - at(by_hand)
        report = {"loss": torch.stack(losses).float().mean().item(),
                  "spans": [(name, at(a), at(b)) for name, a, b in marks], "started": at(started),
                  "ended": at(ended), "coords": self.me.coords, "exposed_comm_s": exposed}
        if memory:
            held = _memory().state_bytes(self.model, self.optimizer)
            held["params"] = max(held["params"], gathered.close())
            report["memory"] = {**held, "activations": meter.peak_bytes, "held_between": held_between}
        return report

    def _phase(self, phase: str):
        """A part of the step in which a failed allocation is named (rank, phase, bytes) and the step's gradients
        are dropped, so the engine keeps its memory and the next step can run."""
        return placement.named_out_of_memory(phase, release=lambda: self.model.zero_grad(set_to_none=True))

    def tensors(self, grads: bool) -> dict[str, torch.Tensor]:
        """The whole model's state_dict (or its parameters' gradients) under the user's model's own keys, gathered
        from their shards (collective over the ranks holding them): it loads with strict=True into the model the
        user's function builds (tied keys present, non-persistent buffers absent)."""
        model = getattr(self.model, "module", self.model)  # DDP's wrapper
        if grads:
            return {key: whole(p.grad) for key, p in model.named_parameters()}
        return {key: whole(value) for key, value in model.state_dict().items()}

    def memory_bytes(self) -> int:
        return sum(_memory().state_bytes(self.model, self.optimizer).values())

    def describe(self) -> str:
        s = self.spec.layout
        return f"dp={s.dp} tp={s.tp} zero={s.zero}; {self.me.describe()}"


def setup(spec) -> str | None:
    """Build this rank's part of the model; an optimizer_fn torch refuses (or that makes no optimizer) is
    returned as one line instead, before any collective of the build."""
    from nbdist.models.inputs import optimizer_problem

    make = restore(spec.optimizer)
    problem = None if make is None else optimizer_problem(make)
    if problem is None:
        registry.put(KIND, spec.name, ShardedModel(spec))
    return problem


def step(name: str, inputs, targets, loss_fn, memory: bool = False) -> dict:
    from nbdist.cluster.launching.ranks.boot import boot

    return {**registry.get(KIND, name).step(inputs, targets, restore(loss_fn), memory), "rank": boot().rank}


def parameters(name: str, grads: bool) -> dict | None:
    """The gathered tensors on the mesh's first rank (None elsewhere: every rank must take part in gathering)."""
    sharded = registry.get(KIND, name)
    tensors = sharded.tensors(grads)
    return tensors if not any(sharded.me.coords.values()) else None


def close(name: str) -> None:
    registry.drop(KIND, name)


def _memory():
    """nbdist.runtime.ranks.memory, imported when a step first measures memory. It imports DTensor and FSDP2 (slow),
    which the notebook's kernel, importing this module only to send its functions, never needs."""
    from nbdist.runtime.ranks import memory

    return memory

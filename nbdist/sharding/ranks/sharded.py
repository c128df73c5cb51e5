"""A sharded model on the ranks (runs ON the engines): what the notebook's Sharded (nbdist/sharding/plan.py) calls.

`setup(spec)` builds this rank's share of a dp x tp plan from its ShardSpec: the whole model from the user's
function, tensor parallel pairs split over the mesh's tp group, then the data-parallel wrapping its ZeRO stage
asks for, and the optimizer. `step` trains one step on this replica's share of the global batch, micro-batch by
micro-batch (gradient accumulation), and reports the loss, the times of each micro-batch's forward and backward,
and, when asked, the bytes the rank holds. `parameters` gathers the whole, unsplit weights or gradients (a
collective over every rank: DTensor shards are gathered), `close` frees it all.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from nbdist.cluster.ranks import rank_mesh, registry
from nbdist.cluster.ranks.memory import ActivationMeter, state_bytes
from nbdist.data_parallel.ranks import data_parallel
from nbdist.models.gathered import whole
from nbdist.sharding.ranks import zero
from nbdist.tensor_parallel.ranks import tensor_parallel
from nbdist.wire import restore

KIND = "sharded"


class ShardedModel:
    """This rank's model, optimizer and place in the mesh."""

    def __init__(self, spec):
        self.spec = spec
        self.me = rank_mesh.here(spec.mesh)
        model = restore(spec.model)()
        layout = spec.layout
        if layout.tp > 1:
            tensor_parallel.apply(model, self.me.device_mesh["tp"], spec.tp_plan)
        if layout.zero >= 2:
            zero.shard(model, self.me.device_mesh["dp"], layout.zero)
        self.model = data_parallel.wrap(model, self.me, layout.dp, layout.tp, layout.zero, spec.ddp)
        make = restore(spec.optimizer)
        self.optimizer = None if make is None else zero.optimizer(
            self.model.parameters(), make, layout.zero, self.me.group("dp"))
        self.by_hand = data_parallel.averages_by_hand(layout.dp, layout.tp, layout.zero)
        self.last_gradient_at = 0.0  # when backward last accumulated a parameter's gradient (see exposed_comm_s)
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(self._gradient_done)

    def _gradient_done(self, _param) -> None:
        self.last_gradient_at = time.perf_counter()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, memory: bool = False, autocast=None,
             scale=None, apply=None) -> dict:
        """One training step on this replica's share; the optimizer (if any) steps at the end. Gradients stay
        until the next step begins, so `parameters(grads=True)` reads this step's.

        The Trainer's seams: `autocast` (a context) around each forward, `scale(loss)` before backward (fp16 loss
        scaling), `apply(optimizer)` instead of `optimizer.step()` (clipping, the scaler's step)."""
        m = self.spec.layout.microbatches
        self.model.zero_grad(set_to_none=True)
        meter = ActivationMeter() if memory else None
        spans, losses = [], []
        gathered = _GatheredParams(self.model) if memory else None
        started = time.perf_counter()
        for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m))):
            with data_parallel.sync_on(self.model, last=i == m - 1):
                t0 = time.perf_counter()
                with meter if meter is not None else contextlib.nullcontext():
                    with autocast if autocast is not None else contextlib.nullcontext():
                        loss = loss_fn(self.model(x), y)
                    t1 = time.perf_counter()
                    (loss / m if scale is None else scale(loss / m)).backward()
                t2 = time.perf_counter()
            spans += [(f"0F{i}", t0, t1), (f"0B{i}", t1, t2)]
            losses.append(loss.detach())
        exposed = max(0.0, t2 - self.last_gradient_at) if self.last_gradient_at >= t1 else 0.0
        if self.by_hand:
            t3 = time.perf_counter()
            data_parallel.average(self.model, self.me.group("dp"), self.spec.layout.dp)
            exposed += time.perf_counter() - t3
        if self.optimizer is not None:
            self.optimizer.step() if apply is None else apply(self.optimizer)
        ended = time.perf_counter()
        report = {"loss": torch.stack(losses).float().mean().item(), "spans": spans, "started": started,
                  "ended": ended, "coords": self.me.coords, "exposed_comm_s": exposed}
        if memory:
            held = state_bytes(self.model, self.optimizer)
            held["params"] = max(held["params"], gathered.close())
            report["memory"] = {**held, "activations": meter.peak_bytes}
        return report

    def tensors(self, grads: bool) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers (or gradients) under the unsplit model's keys, gathered from
        their shards (collective over the ranks holding them)."""
        out = {}
        named = self.model.named_parameters() if grads else [*self.model.named_parameters(),
                                                             *self.model.named_buffers()]
        for key, value in named:
            out[_unwrapped(key)] = whole(value.grad if grads else value)
        return out

    def memory_bytes(self) -> int:
        return sum(state_bytes(self.model, self.optimizer).values())

    def describe(self) -> str:
        s = self.spec.layout
        return f"dp={s.dp} tp={s.tp} zero={s.zero}; {self.me.describe()}"


def time_layers(model_fn: bytes, size: int, repeats: int) -> list[tuple[float, float]]:
    """The model built from the user's function on this rank, each layer timed alone at `size` samples (what the
    plan's step-time prediction starts from: the engines' own cores and threads, not the kernel's)."""
    from nbdist.sharding.profile import sample_input, time_layers

    model = restore(model_fn)()
    return time_layers(model, sample_input(model, size), repeats)


def setup(spec) -> str:
    registry.put(KIND, spec.name, ShardedModel(spec))
    return spec.name


def step(name: str, inputs, targets, loss_fn, memory: bool = False) -> dict:
    from nbdist.cluster.ranks.boot import boot

    return {**registry.get(KIND, name).step(inputs, targets, restore(loss_fn), memory), "rank": boot().rank}


def parameters(name: str, grads: bool) -> dict | None:
    """The gathered tensors on the mesh's first rank (None elsewhere: every rank must take part in gathering)."""
    sharded = registry.get(KIND, name)
    tensors = sharded.tensors(grads)
    return tensors if not any(sharded.me.coords.values()) else None


def close(name: str) -> None:
    registry.drop(KIND, name)


def _unwrapped(key: str) -> str:
    """DDP names its model's parameters 'module.<key>': the unsplit model's key is <key>."""
    return key.removeprefix("module.")


class _GatheredParams:
    """The most parameter bytes the rank holds at once during forward: sampled as each top-level layer starts its
    forward, after FSDP2 gathered that layer's parameters (its own pre-forward hook runs first) and before it frees
    them; ZeRO-2 keeps every layer gathered until backward, ZeRO-3 one layer at a time."""

    def __init__(self, model: nn.Module):
        self.peak = 0
        inner = getattr(model, "module", model)  # DDP's wrapped model
        self.handles = [layer.register_forward_pre_hook(self._sample) for layer in inner.children()]
        self._model = model

    def _sample(self, *_):
        self.peak = max(self.peak, state_bytes(self._model)["params"])

    def close(self) -> int:
        for handle in self.handles:
            handle.remove()
        return self.peak


def mechanism_costs(mesh: str, tp: int, zero_stage: int, optimizer: str, repeats: int = 9) -> dict:
    """What the libraries cost beyond compute and bytes, on this rank while every rank of `mesh` (dims dp, tp)
    runs the same (so the cores are as shared as in a real step): a small column-then-row Linear pair with and
    without DTensor (tp > 1), with and without FSDP2 units (zero_stage >= 2), and the optimizer's step per parameter.
    Returns seconds per micro-batch: {"tp_linear": (f, b), "fsdp_unit": (f, b), "optimizer_per_param": s}."""
    import copy
    import statistics

    import torch.distributed as dist

    me = rank_mesh.here(mesh)
    width, rows = 64, 16
    x = torch.randn(rows, width)
    plain = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward_backward(model) -> tuple[float, float]:
        forward, backward = [], []
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            y = model(x)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            if i >= 2:
                forward.append(t1 - t0)
                backward.append(t2 - t1)
        return statistics.median(forward), statistics.median(backward)

    base = forward_backward(plain)
    costs = {"tp_linear": (0.0, 0.0), "fsdp_unit": (0.0, 0.0), "optimizer_per_dtensor": 0.0}
    distributed = None  # the probe whose parameters are DTensors
    if tp > 1:
        distributed = tensor_parallel.apply(copy.deepcopy(plain), me.device_mesh["tp"],
                                            {"0": "colwise", "2": "rowwise"})
        f, b = forward_backward(distributed)
        costs["tp_linear"] = (max(0.0, f - base[0]) / 2, max(0.0, b - base[1]) / 2)
    if zero_stage >= 2:
        distributed = zero.shard(copy.deepcopy(plain), me.device_mesh["dp"], zero_stage)
        f, b = forward_backward(distributed)
        costs["fsdp_unit"] = (max(0.0, f - base[0]) / 2, max(0.0, b - base[1]) / 2)
    if distributed is not None:
        extra = (_optimizer_step_seconds(list(distributed.parameters()), optimizer, repeats)
                 - _optimizer_step_seconds(list(plain.parameters()), optimizer, repeats))
        costs["optimizer_per_dtensor"] = max(0.0, extra) / len(list(plain.parameters()))
    costs["optimizer_per_param"] = _optimizer_seconds_per_param(optimizer)
    return costs


def _optimizer_step_seconds(params: list, kind: str, repeats: int) -> float:
    """The median seconds of one optimizer step over `params` (gradients of ones). On DTensor parameters (FSDP2,
    tensor parallel) every tensor's update goes through DTensor's dispatch: on CPU engines that costs about 0.1 ms
    per tensor, more than the arithmetic of a small model (measured on a 4-block GPT: Adam 5 ms on plain tensors,
    10-20 ms on FSDP2 shards of half the elements)."""
    import statistics

    make = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
            "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)}[kind]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = make(params, lr=0.1)
    optimizer.step()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - t0)
    for p in params:
        p.grad = None
    return statistics.median(seconds)


def _optimizer_seconds_per_param(kind: str, elements: int = 1 << 20, repeats: int = 5) -> float:
    return _optimizer_step_seconds([nn.Parameter(torch.zeros(elements))], kind, repeats) / elements

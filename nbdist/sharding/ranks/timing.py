"""Layer timing on an engine's own device (runs ON the engines): what the plan's step-time prediction and the
local hardware profile start from.

Why here and not in the kernel: the kernel never touches CUDA, and a layer timed on the kernel's CPU says nothing of
an engine's GPU. The layer and its input arrive built on CPU (from the user's function, or pickled from the
kernel) and are moved to the rank's device first; each forward and backward is timed with the device's own clock
(CUDA events on a GPU, where the host only queues kernels). On CPU the clock is the process's CPU time: the
seconds of a core the layer took, whatever else shares the core while it is timed (a loaded classroom machine
preempts a rank timed alone as much as it likes); the kernel scales core seconds to the step's wall time by the
share of a core each rank gets with every rank busy (`core_share`, measured at profile time).
"""
from __future__ import annotations

import copy
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from nbdist.checks import whole_number
from nbdist.cluster.meshes.ranks import rank_mesh
from nbdist.data_parallel.ranks import zero
from nbdist.runtime.ranks import placement
from nbdist.tensor_parallel.ranks import tensor_parallel


class CoreClock(placement.HostClock):
    """CPU: a mark is this process's CPU time (the engines run torch on one thread), so a timing is the core
    seconds the work took, not the wall seconds it waited for a core."""

    def mark(self):
        return time.process_time()


def stopwatch(device: torch.device | None = None):
    """The clock the layer timings use: CUDA events on a GPU, CPU time on CPU (CoreClock)."""
    device = placement.here() if device is None else device
    return CoreClock() if device.type == "cpu" else placement.stopwatch(device)


def time_layers(model: nn.Sequential, sample_batch: torch.Tensor, repeats: int = 5,
                device: torch.device | None = None) -> list[tuple[float, float]]:
    """(forward, backward) seconds per sample of each top-level layer, run alone on `device` (default: this rank's):
    the median of `repeats` runs after one warm-up, divided by the batch. A copy is timed (a meta model gets real,
    uninitialised storage), so the model's gradients are left as they were."""
    from nbdist.sharding.profile import runnable

    whole_number(repeats, "repeats")
    device = placement.here() if device is None else device
    model, x = runnable(copy.deepcopy(model), sample_batch)
    model, x = model.train().to(device), x.to(device)
    inputs = []
    with torch.no_grad():
        for layer in model:
            inputs.append(x)
            x = layer(x)
    return [_time_layer(layer, inp, repeats, sample_batch.shape[0]) for layer, inp in zip(model, inputs)]


def time_probe(layer: nn.Module, rows: int, features: int, dtype: torch.dtype, repeats: int = 5
               ) -> tuple[float, float]:
    """(forward, backward) seconds per row of `layer` in `dtype` on a (rows × features) random input made here, on
    this rank's device (the local hardware profile's probes: planner/local.py)."""
    device = placement.here()
    layer = layer.to(device=device, dtype=dtype).train()
    x = torch.randn(rows, features, dtype=dtype, device=device)
    return _time_layer(layer, x, repeats, rows)


def _time_layer(layer: nn.Module, x: torch.Tensor, repeats: int, batch: int) -> tuple[float, float]:
    forward, backward = [], []
    for _ in range(repeats + 1):  # the first run warms up the allocator and autograd
        x_in = x.detach().requires_grad_(x.is_floating_point())
        watch = stopwatch(x.device)
        start = watch.mark()
        y = layer(x_in)
        middle = watch.mark()
        if y.requires_grad:
            y.backward(torch.ones_like(y))
        end = watch.mark()
        watch.settle()
        forward.append(watch.seconds(middle) - watch.seconds(start))
        backward.append(watch.seconds(end) - watch.seconds(middle))
    return statistics.median(forward[1:]) / batch, statistics.median(backward[1:]) / batch


def model_layer_times(model_fn: bytes, size: int, repeats: int, example=None,
                      units: list[str] | None = None) -> list[tuple[float, float]]:
    """The model built from the user's function on this rank, each layer timed alone at `size` samples (of the
    user's example input, where given); `units`: the units of a model that is not a Sequential."""
    from nbdist.sharding.profile import sample_input
    from nbdist.wire import restore

    model = restore(model_fn)()
    x = sample_input(model, size, example)
    if units is None:
        return time_layers(model, x, repeats)
    return time_units(model, x, units, repeats)


def core_share(seconds: float = 0.25) -> float:
    """The share of a core this rank gets while every rank computes at once, as in a step: from a barrier, small
    matmuls for `seconds` of wall time, this process's CPU seconds over them. Other work on the host (another
    user's job, a class's kernels) takes its part: 4 ranks on 2 quiet cores get about 0.5 each, beside two busy
    processes about 0.33."""
    dist.barrier()
    x = torch.randn(48, 48)
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        x = torch.tanh(x @ x)
    return _share(time.process_time() - cpu, time.perf_counter() - wall)


def _share(cpu: float, wall: float) -> float:
    """CPU seconds over wall seconds, at most 1 (an engine runs torch on one thread; a helper thread's CPU time
    is not more core for the rank's compute)."""
    return min(1.0, cpu / wall) if wall > 0 else 1.0


def time_units(model: nn.Module, inputs, units: list[str], repeats: int = 5) -> list[tuple[float, float]]:
    """(forward, backward) seconds per sample of each unit of any model, run alone on this rank's device with
    the arguments the model's forward gave it (caught on one forward of `inputs`): the median of `repeats` runs
    after one warm-up. A unit the forward never called takes no time."""
    from nbdist.models import batches

    model = model.train().to(placement.here())
    inputs = batches.to(inputs, placement.here())
    calls: dict[str, tuple] = {}

    def catch(name):
        def hook(module, args, kwargs):  # a Hugging Face key-value cache is left out: run again, it would grow
            args = tuple(None if type(v).__name__.endswith("Cache") else v for v in args)
            kept = {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}
            calls.setdefault(name, (batches.apply(args, lambda t: t.detach()),
                                    batches.apply(kept, lambda t: t.detach())))
        return hook

    hooks = [model.get_submodule(u).register_forward_pre_hook(catch(u), with_kwargs=True) for u in units if u]
    try:
        with torch.no_grad():
            batches.call(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    size = batches.check(inputs)
    times = [_time_call(model.get_submodule(u), *calls[u], repeats, size) if u in calls else (0.0, 0.0)
             for u in units]
    return _scaled_to_whole(model, inputs, times, repeats, size)


def _scaled_to_whole(model: nn.Module, inputs, times: list[tuple[float, float]], repeats: int,
                     batch: int) -> list[tuple[float, float]]:
    """The units' times scaled so that they add up to the whole model's forward and backward, timed here as one
    call: a model's own code between its units (a Hugging Face model's causal mask, its cache, its loss, its
    Python wrappers: several milliseconds a step on a small model) is spread over the units in proportion."""
    from nbdist.models import batches

    forward, backward = [], []
    for _ in range(repeats + 1):
        watch = stopwatch()
        start = watch.mark()
        output = batches.call(model, inputs)
        middle = watch.mark()
        loss = getattr(output, "loss", None)
        if loss is None:
            first = batches.first_tensor(output)
            loss = first.float().sum() if first is not None and first.requires_grad else None
        if loss is not None:
            loss.backward()
        end = watch.mark()
        watch.settle()
        forward.append(watch.seconds(middle) - watch.seconds(start))
        backward.append(watch.seconds(end) - watch.seconds(middle))
    model.zero_grad(set_to_none=True)
    whole = (statistics.median(forward[1:]) / batch, statistics.median(backward[1:]) / batch)
    sums = [sum(t[i] for t in times) for i in (0, 1)]
    scale = [whole[i] / sums[i] if sums[i] > 0 else 1.0 for i in (0, 1)]
    return [(f * scale[0], b * scale[1]) for f, b in times]


def _time_call(module: nn.Module, args: tuple, kwargs: dict, repeats: int, batch: int) -> tuple[float, float]:
    from nbdist.models import batches

    forward, backward = [], []
    for _ in range(repeats + 1):
        a = batches.apply(args, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        k = batches.apply(kwargs, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        watch = stopwatch()
        start = watch.mark()
        out = module(*a, **k)
        middle = watch.mark()
        grads = [t for t in batches.tensors(out if isinstance(out, (tuple, list, dict)) else [out])
                 if t.requires_grad]
        if grads:
            torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
        end = watch.mark()
        watch.settle()
        forward.append(watch.seconds(middle) - watch.seconds(start))
        backward.append(watch.seconds(end) - watch.seconds(middle))
    return statistics.median(forward[1:]) / batch, statistics.median(backward[1:]) / batch


def mechanism_costs(mesh: str, tp: int, zero_stage: int, optimizer: str, repeats: int = 9,
                    shapes: list[tuple[int, ...]] | None = None, model_fn: bytes | None = None,
                    size: int = 1, split: dict[str, str] | None = None) -> dict:
    """What the libraries cost beyond compute and bytes, on this rank while every rank of `mesh` (dims dp, tp)
    runs the same (so the cores are as shared as in a real step): a small column-then-row Linear pair with and
    without DTensor (tp > 1), with and without FSDP2 units (zero_stage >= 2), and the optimizer's step per parameter.
    Returns seconds per micro-batch: {"tp_linear": (f, b), "fsdp_unit": (f, b), "optimizer_per_param": s,
    "optimizer_per_tensor": s}, and the device measured on. The optimizer's step is priced per tensor (its loop
    over parameters) and per element, the latter from `shapes` (the model's parameters: their sizes decide how
    well the update's arrays sit in the caches) when given (_optimizer_costs). With `model_fn` (and tp > 1,
    `split` its tensor-parallel plan, name -> "colwise"/"rowwise"), its most divided layer is timed instead of the
    probe, at `size` samples, sliced in plain tensors and as DTensor on the tp group: {"tp_layer": {"index",
    "split": (f, b), "dtensor": (f, b)}}, what DTensor costs at the model's own shapes (the kernel takes the
    all-reduces out: Plan._tp_linear); with zero_stage >= 2 likewise its largest layer plain and as an FSDP2 unit
    ("fsdp_layer"). The probe's DTensor or FSDP2 copy still prices the optimizer per DTensor parameter."""
    me = rank_mesh.here(mesh)
    width, rows = 64, 16
    (x,) = placement.to_here(torch.randn(rows, width))
    plain = placement.place(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)))

    def forward_backward(model, x=x) -> tuple[float, float]:
        forward, backward = [], []
        for i in range(repeats + 2):
            dist.barrier()
            x_in = x.detach().requires_grad_(x.is_floating_point())
            watch = stopwatch()  # on CPU in core seconds: a difference of two timings, not of two waits for a core
            t0 = watch.mark()
            y = model(x_in)
            t1 = watch.mark()
            y.sum().backward()
            t2 = watch.mark()
            watch.settle()
            if i >= 2:
                forward.append(watch.seconds(t1) - watch.seconds(t0))
                backward.append(watch.seconds(t2) - watch.seconds(t1))
        return statistics.median(forward), statistics.median(backward)

    def per_probe_layer(distributed) -> tuple[float, float]:  # what the probe's two Linears add, each
        f, b = forward_backward(distributed)
        return max(0.0, f - base[0]) / 2, max(0.0, b - base[1]) / 2

    base = forward_backward(plain) if model_fn is None else None  # the probe is timed only without the model
    costs = {"tp_linear": (0.0, 0.0), "fsdp_unit": (0.0, 0.0), "optimizer_per_dtensor": 0.0}
    distributed = None  # the probe whose parameters are DTensors (its optimizer step is timed below)
    if tp > 1:
        distributed = tensor_parallel.apply(copy.deepcopy(plain), me.device_mesh["tp"],
                                            {"0": "colwise", "2": "rowwise"})
        if model_fn is None:
            costs["tp_linear"] = per_probe_layer(distributed)
        else:
            costs["tp_layer"] = _tp_layer_times(model_fn, size, tp, split or {}, me.device_mesh["tp"],
                                                forward_backward)
    if zero_stage >= 2:
        distributed = zero.shard(copy.deepcopy(plain), me.device_mesh["dp"], zero_stage)
        if model_fn is None:
            costs["fsdp_unit"] = per_probe_layer(distributed)
        else:
            costs["fsdp_layer"] = _fsdp_layer_times(model_fn, size, me.device_mesh["dp"], zero_stage,
                                                    forward_backward)
    if distributed is not None:
        extra = (_optimizer_step_seconds(list(distributed.parameters()), optimizer, repeats)
                 - _optimizer_step_seconds(list(plain.parameters()), optimizer, repeats))
        costs["optimizer_per_dtensor"] = max(0.0, extra) / len(list(plain.parameters()))
    costs["optimizer_per_tensor"], costs["optimizer_per_param"] = _optimizer_costs(optimizer, shapes, repeats)
    costs["device"] = str(x.device)  # where it was measured: the rank's device, or the figures mean nothing
    return costs


def _tp_layer_times(model_fn: bytes, size: int, tp: int, split: dict[str, str], tp_mesh,
                    forward_backward) -> dict:
    """The model's layer with the most split Linears, at `size` samples on this rank: (forward, backward) seconds
    as one tensor-parallel rank holds it in plain tensors (sliced), and as DTensor on `tp_mesh`, its all-reduces
    included; every rank runs the same at once, so the cores are shared as in a step."""
    from nbdist.sharding.profile import _tp_sliced

    model, index, x = _layer_and_input(model_fn, size, lambda i, layer: sum(
        name.split(".")[0] == str(i) for name in split))
    sliced = placement.place(_tp_sliced(model, tp)[index])
    distributed = tensor_parallel.apply(placement.place(model), tp_mesh, split)[index]
    return {"index": index, "split": forward_backward(sliced, x), "dtensor": forward_backward(distributed, x)}


def _fsdp_layer_times(model_fn: bytes, size: int, dp_mesh, stage: int, forward_backward) -> dict:
    """The model's largest layer at `size` samples on this rank: (forward, backward) seconds plain and as one
    FSDP2 unit on `dp_mesh` (its gathers and reduce-scatters included), every rank at once."""
    model, index, x = _layer_and_input(model_fn, size, lambda i, layer: sum(p.numel() for p in layer.parameters()))
    plain = placement.place(model[index])
    sharded = zero.shard(nn.Sequential(copy.deepcopy(plain)), dp_mesh, stage)
    return {"index": index, "plain": forward_backward(plain, x), "sharded": forward_backward(sharded, x)}


def _layer_and_input(model_fn: bytes, size: int, weight) -> tuple[nn.Sequential, int, torch.Tensor]:
    """The model built from the user's function, the index of its top-level layer with the largest
    `weight(index, layer)` (the first of equals), and that layer's input for `size` samples, on this rank's
    device."""
    from nbdist.sharding.profile import sample_input
    from nbdist.wire import restore

    model = restore(model_fn)()
    index = max(range(len(model)), key=lambda i: weight(i, model[i]))
    with torch.no_grad():
        x = sample_input(model, size)
        for layer in list(model)[:index]:
            x = layer(x)
    (x,) = placement.to_here(x)
    return model, index, x


def _optimizer_step_seconds(params: list, kind: str, repeats: int) -> float:
    """The median seconds of one optimizer step over `params` (gradients of ones). On DTensor parameters (FSDP2,
    tensor parallel) every tensor's update goes through DTensor's dispatch: on CPU engines that costs more per
    tensor than the arithmetic of a small model (figures: benchmarks/README.md)."""
    make = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
            "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)}[kind]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = make(params, lr=0.1)
    optimizer.step()
    device = params[0].device
    seconds = [placement.timed(optimizer.step, device) for _ in range(repeats)]
    for p in params:
        p.grad = None
    return statistics.median(seconds)


def _optimizer_costs(kind: str, shapes: list[tuple[int, ...]] | None, repeats: int = 5,
                     tensors: int = 64) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per element) of the optimizer's step. Per tensor from `tensors`
    tiny tensors (torch's optimizers loop over parameters on CPU: for a small model the loop costs as much as the
    arithmetic); per element from a step over tensors of `shapes` (a model's, zeros here), less its
    tensors' share. Without shapes, one tensor of 1 Mi elements (larger than the caches: an upper figure)."""
    here = placement.here()
    tiny = _optimizer_step_seconds([nn.Parameter(torch.zeros(16, device=here)) for _ in range(tensors)], kind,
                                   repeats)
    per_tensor = tiny / tensors
    params = [nn.Parameter(torch.zeros(shape, device=here)) for shape in _sampled(shapes or [(1 << 20,)])]
    elements = sum(p.numel() for p in params)
    whole = _optimizer_step_seconds(params, kind, repeats)
    return per_tensor, max(whole - per_tensor * len(params), 0.1 * whole) / elements


def _sampled(shapes: list[tuple[int, ...]], limit: int = 1 << 22) -> list[tuple[int, ...]]:
    """Each distinct shape once, while the elements stay within `limit` (the optimizer's state of a large model is
    not allocated four times over to be timed); a shape above it as `limit` elements (as far out of the caches)."""
    kept, total = [], 0
    for shape in dict.fromkeys(tuple(s) for s in shapes):
        size = math.prod(shape)
        if size > limit:
            shape, size = (limit,), limit
        if kept and total + size > limit:
            continue
        kept.append(shape)
        total += size
    return kept


def group_all_reduce_seconds(mesh: str, dim: str, sizes: list[int], repeats: int = 7) -> list[float]:
    """Seconds of one float32 all-reduce of each size (bytes) on this rank's group along `dim`, every group of the
    mesh at once (as in a step: with 4 ranks on 2 cores, the two tp pairs share the cores): per size, the median of
    `repeats` timed calls after one warm-up, each from a barrier of the whole mesh (the slowest rank's figure is the
    group's; the kernel takes the maximum)."""
    me = rank_mesh.here(mesh)
    group = me.group(dim)
    out = []
    for size in sizes:
        (tensor,) = placement.to_here(torch.ones(max(1, size // 4)))
        seconds = []
        for _ in range(repeats + 1):
            me.everyone.Barrier()
            seconds.append(placement.timed(lambda: dist.all_reduce(tensor, group=group)))
        out.append(statistics.median(seconds[1:]))
    return out

"""A model's profile, made in the notebook kernel before any rank builds anything: per top-level layer of the
nn.Sequential, its parameters (and which of them tensor parallelism divides), the bytes autograd saves for backward
per sample, and the tensor-parallel all-reduces it would make (`profile_layers`: one small real forward on CPU).
`time_layers` (sharding/ranks/timing.py, run on an engine by the plan) adds forward and backward seconds per sample
(`with_times`).

The memory and step-time predictions (sharding/memory.py, sharding/step_time.py) read only this profile.
Plain data: imports torch and torch.nn, never torch.distributed, so both the kernel and the engines can read it.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import reduce

import torch
from torch import nn

from nbdist.errors import DistUsageError
from nbdist.models import batches
from nbdist.models.batches import first_tensor
from nbdist.models.structure import failed_on_example, is_flat, owned_parameters, quietly, unit_names, unit_of
from nbdist.tensor_parallel.pairs import check_tp, tp_plan
from nbdist.tensor_parallel.plans import HEAD_FIELDS


@dataclass(frozen=True)
class ParamShape:
    """One parameter: its full shape, and the dimension tensor parallel splits (0 column, 1 row weight, None: kept
    whole on every rank)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None

    def local_shape(self, tp: int = 1) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.shape
        return tuple(s // tp if d == self.tp_dim else s for d, s in enumerate(self.shape))

    def numel(self, tp: int = 1) -> int:
        return math.prod(self.local_shape(tp))

    def shard_numel(self, tp: int, dp: int) -> int:
        """Elements of FSDP2's shard on one of dp ranks: dim 0 cut in ceil(rows / dp) rows (the last shards padded,
        as FSDP2 pads them)."""
        shape = self.local_shape(tp) or (1,)
        return -(-shape[0] // dp) * math.prod(shape[1:])


@dataclass(frozen=True)
class LayerProfile:
    """One top-level layer of the Sequential, for one sample (bytes are fp32 as profiled).

    Saved bytes count each storage autograd keeps for backward once, in the first layer that saves it.
    `input_bytes_per_sample` is what a layer saves that an earlier layer already saved (its input, e.g. a ReLU's
    output that the next Linear saves again): a pipeline stage that starts at this layer holds it once more, as its
    received input. The `*_split_*` parts are what tensor parallel divides by tp (measured on the tp-sliced layer).
    `tp_allreduce_bytes_per_sample`: the layer's tensor-parallel all-reduces, (forward bytes, backward bytes) each:
    a row-parallel Linear's output in forward, a column-parallel Linear's input gradient in backward.
    """

    name: str
    kind: str
    params: int
    tp_params: int
    tensors: tuple[ParamShape, ...]
    activation_bytes_per_sample: float
    activation_split_bytes_per_sample: float
    input_bytes_per_sample: float
    input_split_bytes_per_sample: float
    output_bytes_per_sample: float
    tp_allreduce_bytes_per_sample: tuple[tuple[float, float], ...] = ()
    forward_s: float | None = None  # per sample, None until timed (ranks/timing.time_layers, with_times)
    backward_s: float | None = None
    shared: tuple[ParamShape, ...] = ()  # tied tensors this layer uses that an earlier layer owns (GPT-2's head):
    # a pipeline stage holding this layer without their owner holds a copy (held_tensors)

    def saved_bytes(self, tp: int = 1) -> float:
        """Bytes per sample this layer saves for backward on one of tp ranks."""
        return _divided(self.activation_bytes_per_sample, self.activation_split_bytes_per_sample, tp)

    def input_saved_bytes(self, tp: int = 1) -> float:
        return _divided(self.input_bytes_per_sample, self.input_split_bytes_per_sample, tp)


def held_tensors(layers: Sequence[LayerProfile]) -> list[ParamShape]:
    """The parameters a rank holding `layers` holds: each layer's own, and a copy of each tied tensor one of them
    uses whose owner is elsewhere; every tensor once (by name)."""
    out: dict[str, ParamShape] = {}
    for layer in layers:
        for t in (*layer.tensors, *layer.shared):
            out.setdefault(t.name, t)
    return list(out.values())


def _divided(whole: float, split: float, tp: int) -> float:
    return whole - split + split / tp


def profile_layers(model: nn.Module, sample_input, tp: int = 1, plan: dict[str, str] | None = None,
                   units: Sequence[str] | None = None, strict: bool = False) -> list[LayerProfile]:
    """Profile each unit (a Sequential's items; any other model's units, nbdist/models/structure.py) with one forward
    of `sample_input` (a small batch: a tensor, a tuple or a dict of tensors) in this process.

    `plan`: the tensor-parallel plan (name -> "colwise" / "rowwise"); a Sequential's own pairs when None. The
    tensor-parallel part of the saved bytes is measured, not assumed: the model is rebuilt with its split Linears
    sliced (column layers keep out_features / t, row layers in_features / t) and counted again; whole = R + S,
    sliced = R + S / t gives S. t is `tp`, or with tp=1 the smallest split the model allows, so a profile serves
    every tp (the sliced sizes are linear in 1/t). A model on the meta device is materialised on CPU first.
    `strict`: the plan is nbdist's own styles, so the sliced copy is exactly one tensor-parallel rank's model: where
    it does not run, neither would the plan (one line).
    """
    flat = is_flat(model)
    if plan is None:
        plan = tp_plan(model) if flat else {}
    if tp > 1 and flat:
        check_tp(model, tp)
    units = list(units) if units is not None else unit_names(model)
    model, x = runnable(model, sample_input)
    batch = batches.check(x, "the example input")
    whole = _profiled_forward(model, x, units, plan)
    t = tp if tp > 1 else _smallest_split(model, plan)
    sliced = _sliced_bytes(model, x, units, plan, t, strict and tp > 1) if t > 1 else whole
    split = (lambda a, b: (a - b) * t / (t - 1)) if sliced is not whole else (lambda a, b: 0.0)
    allreduces = _allreduces_per_layer(units, plan, whole["io"])
    shapes, shared = _param_shapes(model, units, plan)
    profiles = []
    for i, name in enumerate(units):
        tensors = shapes[i]
        profiles.append(LayerProfile(
            name=name, kind=type(model.get_submodule(name)).__name__, params=sum(p.numel() for p in tensors),
            tp_params=sum(p.numel() for p in tensors if p.tp_dim is not None), tensors=tensors,
            activation_bytes_per_sample=whole["own"][i] / batch,
            activation_split_bytes_per_sample=split(whole["own"][i], sliced["own"][i]) / batch,
            input_bytes_per_sample=whole["again"][i] / batch,
            input_split_bytes_per_sample=split(whole["again"][i], sliced["again"][i]) / batch,
            output_bytes_per_sample=whole["output"][i] / batch,
            tp_allreduce_bytes_per_sample=tuple((f / batch, b / batch) for f, b in allreduces[i]),
            shared=shared[i],
        ))
    return profiles


def runnable(model: nn.Module, x) -> tuple[nn.Module, object]:
    """The model and input in real memory: a meta model is copied to real (uninitialised) storage; sizes are all
    the profile reads from it."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model = copy.deepcopy(model).to_empty(device="cpu")
    # its own storage: a view of a larger batch (x[:2]) would count the whole batch as the layer's saved input
    x = batches.apply(x, lambda t: torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t.clone())
    return model, x


def _param_shapes(model: nn.Module, units: list[str], plan: dict[str, str]) -> tuple[list, list]:
    """Per unit, the parameters it owns (a tied weight once, in the first unit that uses it) and the dimension
    tensor parallelism splits; and per unit the tied ones it uses that an earlier unit owns."""
    split = {}
    for name, kind in plan.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Embedding):  # torch's colwise splits the embedding dimension, rowwise the rows
            split[f"{name}.weight"] = 1 if kind == "colwise" else 0
        else:
            split[f"{name}.weight"] = 0 if kind == "colwise" else 1
            if kind == "colwise":
                split[f"{name}.bias"] = 0
    owned = owned_parameters(model, units)
    owner = {id(p): name for unit in units for name, p in owned[unit]}
    shapes = [tuple(ParamShape(name, tuple(p.shape), split.get(name)) for name, p in owned[unit]) for unit in units]
    shared = []
    for unit in units:
        own = {id(p) for _, p in owned[unit]}
        used = {id(p): p for _, p in model.get_submodule(unit).named_parameters(remove_duplicate=False)}
        shared.append(tuple(ParamShape(owner[i], tuple(p.shape), split.get(owner[i]))
                            for i, p in used.items() if i not in own and i in owner))
    return shapes, shared


def _is_parameter(t: torch.Tensor) -> bool:
    """Autograd also saves weights (or views of them) for backward; they are parameters, not activations."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _saved_bytes(model: nn.Module, x, units: list[str], plan: dict[str, str]) -> dict:
    """One forward of `model` (kept alive until counted): per unit the bytes of storages it saves for backward
    that no earlier unit saved ("own") and that one did ("again"), its output's bytes, and per split Linear its
    input and output bytes ("io"). What the model's own forward computes between units (a mask, the loss after
    the head) counts in the unit that ran last."""
    n = len(units)
    out = {"own": [0] * n, "again": [0] * n, "output": [0] * n, "io": {}}
    owner: dict[int, int] = {}
    counted: set[tuple[int, int]] = set()
    current = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage, i = t.untyped_storage(), current[0]
        if not _is_parameter(t) and storage.nbytes() and (i, storage.data_ptr()) not in counted:
            counted.add((i, storage.data_ptr()))
            first = owner.setdefault(storage.data_ptr(), i)
            out["own" if first == i else "again"][i] += storage.nbytes()
        return t.detach()  # a saved output kept with its grad_fn would be a cycle that keeps the graph alive

    hooks = []
    for i, name in enumerate(units):
        layer = model.get_submodule(name)
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(
            lambda m, a, y, i=i: out["output"].__setitem__(i, out["output"][i] or _nbytes(first_tensor(y)))))
    for name in plan:
        hooks.append(model.get_submodule(name).register_forward_hook(
            lambda m, a, y, name=name: out["io"].__setitem__(name, (_nbytes(a[0]), _nbytes(y)))))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = batches.call(model, x)
        del result
    finally:
        for h in hooks:
            h.remove()
    return out


def _profiled_forward(model: nn.Module, x, units: list[str], plan: dict[str, str]) -> dict:
    """_saved_bytes, or one line naming the unit the example input failed in and the way out."""
    running: list[str] = []
    hooks = [model.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: running.append(name))
             for name in units if name]
    try:
        with quietly():
            return _saved_bytes(model, x, units, plan)
    except Exception as e:  # noqa: BLE001 - the user's model on the user's input: say where, in one line
        raise failed_on_example(model, x, running, e) from None
    finally:
        for h in hooks:
            h.remove()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _allreduces_per_layer(units: list[str], plan: dict[str, str], io: dict) -> list[list[tuple[int, int]]]:
    """Per unit, its tensor-parallel all-reduces as (forward bytes, backward bytes), one entry each: every
    row-parallel Linear all-reduces its output in forward (Megatron's g); every column-parallel Linear all-reduces
    its input's gradient in backward (Megatron's f). Megatron fuses q, k and v into one column layer (one f per
    attention); DTensor on separate q, k, v layers does three (counted on the ranks with CommDebugMode: 2
    all-reduces per GPT block forward, 4 backward). A split layer the forward never called makes none."""
    out: list[list[tuple[int, int]]] = [[] for _ in units]
    for name, kind in plan.items():
        if name not in io:
            continue
        index = unit_of(units, name)
        out[index].append((io[name][1], 0) if kind == "rowwise" else (0, io[name][0]))
    # the order the flat models always had: row layers' forward all-reduces first, then the columns'
    return [sorted(entries, key=lambda e: e[0] == 0) for entries in out]


def _smallest_split(model: nn.Module, plan: dict[str, str]) -> int:
    """The smallest tp > 1 every split layer's divided size (and the heads) divides; 1 if there is none."""
    sizes = []
    for name, kind in plan.items():
        layer = model.get_submodule(name)
        if isinstance(layer, nn.Linear):
            sizes.append(layer.out_features if kind == "colwise" else layer.in_features)
    if not sizes:
        return 1
    config = getattr(model, "config", None)
    sizes += [v for f in HEAD_FIELDS if isinstance(v := getattr(config, f, None), int)]
    common = reduce(math.gcd, sizes, 0)
    return next((t for t in range(2, common + 1) if common % t == 0), 1)


def _sliced_bytes(model: nn.Module, x, units: list[str], plan: dict[str, str], tp: int, strict: bool) -> dict:
    """_saved_bytes of the model as one tensor-parallel rank of `tp` holds it. Where the sliced copy does not run:
    with `strict` one line (a column layer whose output reaches no row layer: the plan cannot run either); else
    the whole model's (torch styles of other layouts are not sliced here: tensor parallelism is then taken to
    divide no saved bytes, an overestimate)."""
    try:
        with quietly():
            return _saved_bytes(_tp_sliced(model, tp, plan), x, units, plan)
    except (RuntimeError, ValueError, IndexError) as e:
        if strict:
            said = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            raise DistUsageError(f"the tensor-parallel plan does not run on one rank's 1/{tp} slice of "
                                 f"{type(model).__name__} ({type(e).__name__}: {said}): each colwise layer's "
                                 f"output must reach a rowwise layer through layers that act on each feature alone "
                                 f"(attention heads, an activation); name the pairs in tp_plan") from None
        return _saved_bytes(model, x, units, plan)


def _tp_sliced(model: nn.Module, tp: int, plan: dict[str, str] | None = None) -> nn.Module:
    """A copy of `model` as one tensor-parallel rank holds it: column layers with out_features / tp, row layers with
    in_features / tp (the first slice of the weights)."""
    plan = tp_plan(model) if plan is None else plan
    pairs = {name: model.get_submodule(name) for name in plan if isinstance(model.get_submodule(name), nn.Linear)}
    # the pairs' layers are replaced below: copied as placeholders, not with their weights (a model's worth of them)
    sliced = copy.deepcopy(model, memo={id(layer): nn.Identity() for layer in pairs.values()})
    for name, old in pairs.items():
        rows, cols = (old.out_features // tp, old.in_features) if plan[name] == "colwise" else (
            old.out_features, old.in_features // tp)
        new = nn.Linear(cols, rows, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight[:rows, :cols])
            if old.bias is not None:
                new.bias.copy_(old.bias[:rows])
        parent, _, child = name.rpartition(".")
        setattr(sliced.get_submodule(parent) if parent else sliced, child, new)
    return sliced


def sample_input(model: nn.Module, size: int = 1, example=None):
    """`size` samples of the model's input: the user's example (its samples taken in turn), else, filled
    deterministically, tokens below the vocabulary for the package's transformer (it has a `config`) or normal
    features for the first Linear of a Sequential."""
    if example is not None:
        return batches.resized(example, size)
    config = getattr(model, "config", None)
    generator = torch.Generator().manual_seed(0)
    if config is not None and hasattr(config, "seq") and hasattr(config, "vocab"):
        return torch.randint(0, config.vocab, (size, config.seq), generator=generator)
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    if not is_flat(model) or not isinstance(first, nn.Linear):
        raise DistUsageError(f"cannot tell what {type(model).__name__} takes as input: give example_input= (a batch "
                             f"of a few samples, e.g. example_input=x[:2] or a dict of tensors for model(**batch))")
    return torch.randn(size, first.in_features, generator=generator)


def with_times(layers: Sequence[LayerProfile], times: Sequence[tuple[float, float]]) -> list[LayerProfile]:
    """The profiles with `time_layers`' seconds filled in."""
    if len(times) != len(layers):
        raise DistUsageError(f"got times for {len(times)} layers, but the profile has {len(layers)}")
    return [replace(layer, forward_s=f, backward_s=b) for layer, (f, b) in zip(layers, times)]

"""Pipeline stages cut from any nn.Module: each stage is a pruned copy of the user's model (as torchtitan's pipeline
split prunes its own), run by the model's own forward.

A stage keeps the units (nbdist/models/structure.py) between its split point and the next one. Every stage runs the
model's forward from the top, so whatever the forward computes besides the units (a causal mask, rotary positions,
the loss after the head) is computed where it is needed:
- the units of earlier stages that hold parameters are replaced by stubs that hold none: a stub runs its module's
  copy on torch's meta device (shapes only, no memory, no compute) and returns zeros of that shape;
- parameter-free units (rotary embeddings, activations, dropout) run for real on every stage;
- at the stage's first unit the tensor received from the previous stage replaces the unit's first argument (the
  message: what the model's forward hands that unit, e.g. a decoder layer's hidden states);
- at the next stage's first unit the forward stops, and that unit's first argument is the stage's output.
So the stage owns only its parameters (a pruned copy: DDP, FSDP2, the optimizer and state_dict() see those, under
the user's own names), and the user writes no wrapper.

A split is only right if the message is all the later stage needs from the earlier one (a cut inside a residual
block is not). `check_cuts` proves it in the kernel: the stages run one after another on the example input give the
whole model's output. Plain torch.nn: the kernel and the ranks both use it.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from nbdist.errors import DistUsageError
from nbdist.models import batches
from nbdist.models.structure import quietly


class _StageEnd(Exception):
    """Raised at the next stage's first unit: carries this stage's output (that unit's first argument)."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__("stage end")
        self.tensor = tensor


def stages_of(units: Sequence[str], split_points: Sequence[str]) -> list[tuple[int, int]]:
    """(first unit, end unit) of each stage for split points given as module names (torch's pipelining vocabulary:
    each split point begins a stage). One line for a name that is no unit's start, out of order or repeated."""
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise DistUsageError(f"split_points must be a list of module names (e.g. ['model.layers.2']), got "
                             f"{split_points!r}")
    starts = []
    for point in split_points:
        if not isinstance(point, str):
            raise DistUsageError(f"split_points must be module names, got {point!r}")
        index = next((i for i, u in enumerate(units) if u == point or u.startswith(f"{point}.")), None)
        if index is None:
            inside = next((u for u in units if point.startswith(f"{u}.")), None)
            if inside is not None:
                raise DistUsageError(f"split point {point!r} lies inside {inside}, which runs whole on one stage: cut "
                                     f"between units ({_some(units)})")
            raise DistUsageError(f"split point {point!r} is not a module of the model: split points name units "
                                 f"such as {_some(units)}")
        if index == 0:
            raise DistUsageError(f"split point {point!r} is the model's first unit: each split point begins a later "
                                 f"stage, so the first stage would be empty")
        starts.append(index)
    if len(set(starts)) != len(starts) or starts != sorted(starts):
        raise DistUsageError(f"split_points {list(split_points)} must be in the order the forward reaches them, each "
                             f"once (the units, in order: {_some(units, 12)})")
    edges = [0, *starts, len(units)]
    return [(a, b) for a, b in zip(edges, edges[1:])]


def _some(units: Sequence[str], n: int = 6) -> str:
    shown = ", ".join(units[:n])
    return shown + (", ..." if len(units) > n else "")


class Stub(nn.Module):
    """What stands in a stage for a unit of an earlier stage: no parameters; runs a meta copy of the unit (kept off
    the module tree) and returns zeros shaped as its output. The output's shapes are remembered per input shape, so
    after the first micro-batch a stub costs a few zero tensors."""

    def __init__(self, unit: nn.Module, name: str):
        super().__init__()
        object.__setattr__(self, "meta", _meta_copy(unit))  # not a submodule: invisible to state_dict, FSDP, DDP
        self.name = name
        self._shapes: dict = {}

    def forward(self, *args, **kwargs):
        key = _signature(args, kwargs)
        spec = self._shapes.get(key)
        if spec is None:
            try:
                with torch.no_grad():
                    out = self.meta(*_to_meta(args), **_to_meta(kwargs))
            except Exception as e:  # noqa: BLE001 - a module that cannot run on meta: say which, and the way out
                said = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
                raise DistUsageError(f"pipeline stage: {self.name} ({type(self.meta).__name__}), a unit of an earlier "
                                     f"stage, cannot run on torch's meta device to give its output's shape "
                                     f"({type(e).__name__}: {said}): cut the model elsewhere, or give a function "
                                     f"per stage") from None
            spec = self._shapes[key] = _spec(out)
        device = _device_of(args, kwargs)
        return _zeros(spec, device)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device, made without copying its real tensors."""
    memo = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, Mapping):
        return {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_to_meta(v) for v in value)
    if isinstance(value, list):
        return [_to_meta(v) for v in value]
    return value


def _signature(args, kwargs) -> tuple:
    def sig(v):
        if isinstance(v, torch.Tensor):
            return ("t", tuple(v.shape), v.dtype)
        if isinstance(v, Mapping):
            return tuple((k, sig(x)) for k, x in v.items())
        if isinstance(v, (tuple, list)):
            return tuple(sig(x) for x in v)
        return type(v).__name__ if not isinstance(v, (bool, int, float, str, type(None))) else v
    return sig(args), sig(kwargs)


def _spec(out):
    """The output's structure with (shape, dtype) in place of each tensor."""
    if isinstance(out, torch.Tensor):
        return ("tensor", tuple(out.shape), out.dtype)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return ("tuple", tuple(_spec(v) for v in out))
    if isinstance(out, list):
        return ("list", [_spec(v) for v in out])
    if isinstance(out, Mapping):
        return ("mapping", type(out), {k: _spec(v) for k, v in out.items()})
    return ("value", out)


def _zeros(spec, device):
    kind = spec[0]
    if kind == "tensor":
        return torch.zeros(spec[1], dtype=spec[2], device=device)
    if kind == "tuple":
        return tuple(_zeros(s, device) for s in spec[1])
    if kind == "list":
        return [_zeros(s, device) for s in spec[1]]
    if kind == "mapping":
        return spec[1]({k: _zeros(s, device) for k, s in spec[2].items()})
    return spec[1]


def _device_of(args, kwargs) -> torch.device:
    found = batches.tensors([list(args), dict(kwargs)])
    return found[0].device if found else torch.device("cpu")


def message_of(args: tuple, kwargs: dict) -> tuple[torch.Tensor, object]:
    """The message a unit's call carries (its first positional argument, else its first tensor keyword) and where
    it sits: an index into args or a keyword."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], 0
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return value, key
    raise DistUsageError("pipeline stage: the unit that begins a stage takes no tensor: it cannot receive the "
                         "previous stage's output")


def _with_message(args: tuple, kwargs: dict, where, tensor: torch.Tensor) -> tuple[tuple, dict]:
    if where == 0:
        return (tensor, *args[1:]), kwargs
    return args, {**kwargs, where: tensor}


class PrunedStage(nn.Module):
    """One stage of a pipeline cut from any model: `forward(received, inputs)` runs the pruned model on the
    micro-batch `inputs` (what model(...) takes), with `received` (the previous stage's output; None on the first
    stage) put in at this stage's first unit; returns the message for the next stage, or on the last stage the
    model's own output. `model` is pruned in place (the rank's own copy)."""

    def __init__(self, model: nn.Module, units: Sequence[str], first: int, end: int):
        super().__init__()
        self.model = model
        self.begins = units[first] if first > 0 else None
        self.ends = units[end] if end < len(units) else None
        kept = set(units[first:end])
        for name in units[:first]:  # earlier stages' units: stubs, unless they hold nothing to save
            unit = model.get_submodule(name)
            if any(True for _ in unit.parameters()):
                _replace(model, name, Stub(unit, name))
        for name in units[end:]:  # later stages' units never run here (the forward stops first): dropped
            unit = model.get_submodule(name)
            if any(True for _ in unit.parameters()) and name not in kept:
                _replace(model, name, _Never(name))
        self._received: torch.Tensor | None = None
        self._hooks = []
        if self.begins is not None:
            self._hooks.append(model.get_submodule(self.begins).register_forward_pre_hook(
                self._receive, with_kwargs=True))
        if self.ends is not None:
            self._hooks.append(model.get_submodule(self.ends).register_forward_pre_hook(
                _end_here, with_kwargs=True))

    def _receive(self, module, args, kwargs):
        received, self._received = self._received, None
        if received is None:  # the unit is called again in the same forward (a module used twice): leave it
            return None
        _, where = message_of(args, kwargs)
        return _with_message(args, kwargs, where, received)

    def forward(self, received: torch.Tensor | None, inputs):
        self._received = received
        try:
            return batches.call(self.model, inputs)
        except _StageEnd as end:
            return end.tensor
        finally:
            self._received = None


def _end_here(module, args, kwargs):
    tensor, _ = message_of(args, kwargs)
    raise _StageEnd(tensor)


class _Never(nn.Module):
    """A later stage's unit in this stage's copy: the forward stops before it; reaching it is a bug."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"pipeline stage: {self.name} belongs to a later stage and ran here")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def stage_outputs(model: nn.Module, units: Sequence[str], ranges: Sequence[tuple[int, int]], inputs) -> list:
    """The whole model run once on `inputs`, cut where the stages begin: each stage's output (the next stage's
    first unit's message; the model's output last)."""
    cuts = {units[b]: s for s, (_, b) in enumerate(ranges[:-1])}
    out: list = [None] * len(ranges)

    def record(name):
        def hook(module, args, kwargs):
            if out[cuts[name]] is None:
                out[cuts[name]] = message_of(args, kwargs)[0]
        return hook

    hooks = [model.get_submodule(name).register_forward_pre_hook(record(name), with_kwargs=True) for name in cuts]
    try:
        with torch.no_grad(), quietly():
            out[-1] = batches.call(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    return out


def check_cuts(model: nn.Module, units: Sequence[str], ranges: Sequence[tuple[int, int]], inputs) -> list:
    """Prove the cut in the kernel: each stage, pruned from a copy of `model` and given the previous stage's
    output, gives what the whole model gives there (its next message; the model's output at the end). Returns the
    messages' (shape, dtype) for these inputs. One line naming the cut where it does not."""
    whole = stage_outputs(model, units, ranges, inputs)
    for s, (a, b) in enumerate(ranges):
        if s == 0:
            continue
        stage = PrunedStage(copy.deepcopy(model), units, a, b)
        with torch.no_grad(), quietly():
            got = stage(whole[s - 1], inputs)
        want = whole[s]
        if not _same(got, want):
            raise DistUsageError(f"the pipeline cut before {units[a]} is not on the model's main path: the stage "
                                 f"from {units[a]} needs more from the earlier stage than the tensor {units[a]} "
                                 f"takes (a residual or a value computed before it): cut before another unit "
                                 f"(split_points=[...]) or give a function per stage")
    return [(tuple(t.shape), t.dtype) for t in whole[:-1]]


def _same(got, want) -> bool:
    a, b = batches.tensors(got), batches.tensors(want)
    if not b or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return False
    return all(torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def balanced_stages(model: nn.Module, units: Sequence[str], sizes: Sequence[int], pieces: int,
                    inputs=None) -> list[tuple[int, int]]:
    """Stages balanced by parameters (`sizes` per unit), each cut proven on `inputs` (check_cuts): a cut that is not
    on the model's main path (before Llama's rotary embedding, whose output every layer reads) is left out and the
    rest balanced again. Without inputs, the balanced cut as it is."""
    from nbdist.pipeline_parallel.stages import boundaries, layer_counts

    allowed = set(range(1, len(units)))
    while True:
        ranges = boundaries(layer_counts(sizes, pieces, starts=allowed))
        if inputs is None:
            return ranges
        bad = next((a for a, _ in ranges[1:] if not _cut_holds(model, units, a, inputs)), None)
        if bad is None:
            return ranges
        allowed.discard(bad)


def _cut_holds(model: nn.Module, units: Sequence[str], at: int, inputs) -> bool:
    try:
        check_cuts(model, units, [(0, at), (at, len(units))], inputs)
    except DistUsageError:
        return False
    return True

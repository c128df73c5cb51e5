"""The structure of any nn.Module a user brings: its units (the pieces a plan profiles, balances and cuts), its
repeated blocks (the FSDP2 units), the parameters it ties, and the keys of its own state dict.

Why units, not layers: nbdist's own models are one flat nn.Sequential whose items are the layers. A Hugging Face
Llama is a tree (`model.embed_tokens`, `model.layers.0..n`, `model.norm`, `lm_head`) whose forward passes more than
one tensor around (rotary positions, masks). The units are found by one rule: the children of a container
(ModuleList, Sequential, ModuleDict) are units (a container among them is opened in turn); outside containers a
module holding a container somewhere below is opened, any other is a unit. A Sequential model's units are its
items, as before. Units are ordered by when the forward first calls them (one forward of an example input);
parameters shared by several modules (GPT-2's `lm_head.weight` is `transformer.wte.weight`) belong to the first
unit that uses them, so nothing is counted twice.

Plain torch.nn: the kernel and the ranks both read it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nbdist.errors import DistUsageError

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def is_flat(model: nn.Module) -> bool:
    """A model whose items are its layers (nbdist's gpt and mlp, any nn.Sequential): the path that slices it."""
    return isinstance(model, nn.Sequential)


def unit_names(model: nn.Module) -> list[str]:
    """The units' qualified names, in definition order (see the module docstring)."""
    if is_flat(model):
        return [name for name, _ in model.named_children()]
    out: list[str] = []

    def open_container(prefix: str, container: nn.Module) -> None:
        for name, child in container.named_children():
            if isinstance(child, CONTAINERS):
                open_container(f"{prefix}{name}.", child)
            else:
                out.append(f"{prefix}{name}")

    def open_module(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, CONTAINERS):
                open_container(f"{prefix}{name}.", child)
            elif any(isinstance(m, CONTAINERS) for m in child.modules()):
                open_module(f"{prefix}{name}.", child)
            else:
                out.append(f"{prefix}{name}")

    open_module("", model)
    if not out:  # a single module with no children: the model is its own unit
        out.append("")
    return out


def unit_of(units: Sequence[str], name: str) -> int:
    """The index of the unit holding module `name`."""
    for i, unit in enumerate(units):
        if not unit or name == unit or name.startswith(f"{unit}."):
            return i
    raise DistUsageError(f"{name!r} belongs to none of the model's units")


def call_order(model: nn.Module, names: list[str], inputs) -> list[str]:
    """`names` ordered by when one forward of `inputs` first calls them; those never called go last, in order."""
    from nbdist.models.batches import call

    first: dict[str, int] = {}
    running: list[str] = []

    def seen(name: str) -> None:
        first.setdefault(name, len(first))
        running.append(name)

    hooks = [model.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: seen(name))
             for name in names if name]
    try:
        with torch.no_grad(), quietly():
            call(model, inputs)
    except Exception as e:  # noqa: BLE001 - the user's model on the user's input: say where, in one line
        raise failed_on_example(model, inputs, running, e) from None
    finally:
        for h in hooks:
            h.remove()
    called = sorted((n for n in names if n in first), key=first.__getitem__)
    return called + [n for n in names if n not in first and n]


def failed_on_example(model: nn.Module, inputs, running: list[str], error: Exception) -> DistUsageError:
    """One line for a forward of the example input that failed: the unit it failed in, torch's words and the way
    out."""
    from nbdist.models.batches import describe

    if isinstance(error, DistUsageError):
        return error
    said = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    where = (f"in {running[-1]} ({type(model.get_submodule(running[-1])).__name__})" if running
             else "before its first layer")
    return DistUsageError(f"profiling {type(model).__name__} on the example input ({describe(inputs)}) failed "
                          f"{where}: {type(error).__name__}: {said}; give example_input= a batch the model takes "
                          f"(model(x), model(*x) or model(**x))")


@contextlib.contextmanager
def quietly():
    """nbdist's own forwards of a user's model in the kernel (profiling, proving a cut) say nothing: a library's
    warnings (Hugging Face's "loss_type=None ...") come when the user's training runs, not from shard()."""
    import logging
    import warnings

    loggers = [logging.getLogger(name) for name in ("transformers", "torch")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The parameter names that share one tensor, each group in definition order (GPT-2: [transformer.wte.weight,
    lm_head.weight])."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def owned_parameters(model: nn.Module, units: list[str]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """unit -> its parameters (qualified names), each parameter under the first unit (in `units`' order) that
    holds it: a tied weight is counted once."""
    seen: set[int] = set()
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for unit in units:
        module = model.get_submodule(unit)
        own = []
        for local, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                own.append((f"{unit}.{local}" if unit else local, p))
        out[unit] = own
    return out


def repeated_blocks(model: nn.Module) -> list[str]:
    """The repeated blocks (torchtitan's FSDP2 units): the items of the outermost ModuleLists and ModuleDicts. A
    Sequential model's items. Blocks that share a parameter with anything outside them are left out (their
    parameters stay in the root unit, with what they share)."""
    if is_flat(model):
        blocks = [name for name, layer in model.named_children() if any(True for _ in layer.parameters())]
    else:
        blocks = []

        def visit(prefix: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                    blocks.extend(f"{prefix}{name}.{item}" for item, _ in child.named_children())
                else:
                    visit(f"{prefix}{name}.", child)

        visit("", model)
    shared = {n for group in tied_groups(model) for n in group}
    return [b for b in blocks if not any(n == b or n.startswith(f"{b}.") for n in shared)
            and any(True for _ in model.get_submodule(b).parameters())]


@dataclass(frozen=True)
class Structure:
    """What the kernel read of a user's model, sent to the ranks with the plan: its units in call order and the
    parameters it ties."""

    units: tuple[str, ...]
    tied: tuple[tuple[str, ...], ...]
    flat: bool

    @classmethod
    def of(cls, model: nn.Module, example=None) -> "Structure":
        names = unit_names(model)
        if example is not None and not is_flat(model):
            names = call_order(model, names, example)
        return cls(tuple(names), tuple(tuple(g) for g in tied_groups(model)), is_flat(model))


def persistent_keys(model: nn.Module) -> list[str]:
    """The keys of the model's own state_dict(): what `load_state_dict(..., strict=True)` wants (tied keys each,
    non-persistent buffers none)."""
    return list(model.state_dict().keys())


def user_state_dict(model: nn.Module, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`values` (gathered by parameter and buffer name) put under the model's state_dict keys, in its order; a
    tied key takes its tensor's value. One line if a key has no value."""
    aliases = {}
    for group in tied_groups(model):
        for name in group:
            aliases[name] = group
    out = {}
    for key in persistent_keys(model):
        if key in values:
            out[key] = values[key]
            continue
        found = next((values[n] for n in aliases.get(key, ()) if n in values), None)
        if found is None:
            raise DistUsageError(f"the gathered model has no value for {key!r}")
        out[key] = found
    return out

"""A user's tensor-parallel plan, read and checked in the kernel before anything is built: torch's
`parallelize_module` plans ({name: ColwiseParallel(), ...}), plain style names ({name: "colwise"}) and Hugging Face's
`base_model_tp_plan` (wildcard names such as "layers.*.self_attn.q_proj", relative to the base model), or "auto":
the plan the model's Hugging Face config carries.

Every name must reach a module of the model, every style must fit its module (torch's colwise and rowwise styles
split nn.Linear and nn.Embedding; GPT-2's Conv1D keeps its weight transposed and fuses q, k and v in one layer), and
tp must divide what it splits (a colwise layer's outputs, a rowwise layer's inputs, the attention heads and the
key-value heads of the model's config). Each problem is one line, naming the entry and the way out.

Plain data: imports torch.nn, never torch.distributed (a ParallelStyle is recognised by its class name).
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from nbdist.errors import DistUsageError

STYLES = ("colwise", "rowwise")  # the style names nbdist applies (ColwiseParallel, RowwiseParallel)
TORCH_STYLES = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise"}  # torch's, as the profile reads them
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_head", "heads")  # configs' head counts


def style_kind(style: Any) -> str | None:
    """"colwise" / "rowwise" for a style nbdist or torch names so; None for another torch ParallelStyle."""
    if isinstance(style, str):
        return style if style in STYLES else None
    return TORCH_STYLES.get(type(style).__name__)


def model_plan(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan a Hugging Face model carries (its `_tp_plan`, else its config's
    `base_model_tp_plan` under the base model's prefix); one line if it has none."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
    plan.update(getattr(model, "_tp_plan", None) or {})
    if not plan:
        raise DistUsageError(f"tp_plan='auto' reads the plan a Hugging Face model's config carries "
                             f"(base_model_tp_plan), but {type(model).__name__} has none: give tp_plan={{name: "
                             f"'colwise' | 'rowwise'}}")
    # the entries nbdist applies (the blocks' colwise and rowwise Linears); the embedding and the head, which
    # Hugging Face gathers ("embedding_rowwise", "colwise_gather_output"), stay whole on every rank
    return {k: v for k, v in plan.items() if v in STYLES}


def resolve(model: nn.Module, plan, tp: int) -> dict[str, Any]:
    """Qualified module name -> style, every wildcard expanded against the model, every entry checked (see the
    module docstring). `plan` None gives {}."""
    if plan is None:
        return {}
    if isinstance(plan, str):
        if plan != "auto":
            raise DistUsageError(f"tp_plan must be a dict {{module name: style}} or 'auto' (the Hugging Face config's "
                                 f"plan), got {plan!r}")
        plan = model_plan(model)
    if not isinstance(plan, dict) or not plan:
        raise DistUsageError(f"tp_plan must be a non-empty dict {{module name: 'colwise' | 'rowwise' or a torch "
                             f"ParallelStyle}}, got {plan!r}")
    names = [name for name, _ in model.named_modules() if name]
    prefix = getattr(model, "base_model_prefix", "")
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise DistUsageError(f"tp_plan's keys must be module names, got {pattern!r}")
        _check_style(pattern, style)
        found = _matches(pattern, names)
        if not found and prefix and not pattern.startswith(f"{prefix}."):  # HF's base-model names
            found = _matches(f"{prefix}.{pattern}", names)
        if not found:
            example = next((n for n in names if n.count(".") >= pattern.count(".")), names[0] if names else "")
            raise DistUsageError(f"tp_plan names {pattern!r}, which matches no module of {type(model).__name__} "
                                 f"(its modules are named like {example!r}): use the names model.named_modules() "
                                 f"gives, '*' for a block's number")
        for name in found:
            out[name] = style
    for name, style in out.items():
        _check_module(model, name, style, tp)
    _check_heads(model, tp)
    return out


def kinds(plan: dict[str, Any]) -> dict[str, str]:
    """The plan as the profile reads it: name -> "colwise" / "rowwise", other styles left out."""
    return {name: kind for name, style in plan.items() if (kind := style_kind(style)) is not None}


def _matches(pattern: str, names: list[str]) -> list[str]:
    regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
    return [n for n in names if regex.match(n)]


def _check_style(name: str, style) -> None:
    if isinstance(style, str):
        if style not in STYLES:
            raise DistUsageError(f"tp_plan[{name!r}] = {style!r}: nbdist applies 'colwise' and 'rowwise' (and torch "
                                 f"ParallelStyle objects, e.g. ColwiseParallel(output_layouts=...)); "
                                 f"{style!r} is not one of them")
        return
    if not (hasattr(style, "_apply") and type(style).__module__.startswith("torch.distributed")):
        raise DistUsageError(f"tp_plan[{name!r}] must be 'colwise', 'rowwise' or a torch ParallelStyle, got "
                             f"{type(style).__name__}")


def _check_module(model: nn.Module, name: str, style, tp: int) -> None:
    module = model.get_submodule(name)
    kind = style_kind(style)
    if kind is None:
        return
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        why = (" (GPT-2's Conv1D keeps its weight transposed and fuses q, k and v in one layer: a column split "
               "would give one rank all of q)" if type(module).__name__ == "Conv1D" else "")
        raise DistUsageError(f"tp_plan[{name!r}] = {kind!r}, but {name} is a {type(module).__name__}: torch's "
                             f"{kind} style splits nn.Linear and nn.Embedding layers only{why}; keep tp=1 for it")
    if isinstance(module, nn.Linear):
        size, what = (module.out_features, "output features") if kind == "colwise" else (
            module.in_features, "input features")
        if size % tp:
            raise DistUsageError(f"tp={tp} does not divide the {size} {what} of {name} ({kind}): each "
                                 f"tensor-parallel rank takes 1/{tp} of them")


def _check_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for field in HEAD_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp:
            raise DistUsageError(f"tp={tp} does not divide the model's {value} {field.replace('_', ' ')} (config."
                                 f"{field}): each tensor-parallel rank takes whole heads")

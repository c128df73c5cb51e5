"""Batches as users give them: a tensor (`model(x)`), a tuple of tensors (`model(*x)`) or a dict (`model(**x)`, as
Hugging Face models take `input_ids`, `attention_mask` and `labels`), with targets and a loss function beside it or
the loss the model's own output carries (`loss_fn=None`: `output.loss`, labels passed to forward).

Every tensor of a batch is cut along its first dimension (samples), so a replica's share, a micro-batch and an
example of one sample are the same structure, smaller. Plain torch: the kernel and the ranks both use it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nbdist.errors import DistUsageError


def call(model, inputs):
    """The model applied to `inputs` as the user's own code would: model(x), model(*x) or model(**x)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def tensors(batch) -> list[torch.Tensor]:
    """The batch's tensors, in order (a dict's in its key order)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in tensors(v)]
    return []


def check(batch, label: str = "the batch") -> int:
    """The number of samples in `batch`: a tensor, a tuple/list or a dict of tensors (anything else rides along,
    whole, in every share), every tensor with the same first dimension. One line otherwise."""
    found = tensors(batch)
    if not found:
        kind = type(batch).__name__
        raise DistUsageError(f"{label} must be a tensor, a tuple of tensors or a dict of tensors (model(**batch)), "
                             f"got {kind}" + (" with no tensor in it" if isinstance(batch, (Mapping, tuple, list))
                                              else ""))
    sizes = {tuple(t.shape[:1]) for t in found}
    if any(t.dim() == 0 for t in found):
        raise DistUsageError(f"{label} holds a tensor with no sample dimension (a 0-d tensor): every tensor's first "
                             f"dimension must be the samples")
    if len(sizes) > 1:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in _named(batch))
        raise DistUsageError(f"{label}'s tensors disagree on the number of samples (their first dimension): {shapes}")
    return found[0].shape[0]


def _named(batch, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [(prefix or "inputs", batch)]
    if isinstance(batch, Mapping):
        return [p for k, v in batch.items() for p in _named(v, f"{prefix}{k}")]
    if isinstance(batch, (tuple, list)):
        return [p for i, v in enumerate(batch) for p in _named(v, f"{prefix}[{i}]")]
    return []


def split(batch, parts: int) -> list:
    """`batch` cut into `parts` shares along the samples (torch.tensor_split: equal where they divide, as the
    callers check they do for micro-batches and replicas)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(parts))
    if isinstance(batch, Mapping):
        cut = {k: split(v, parts) for k, v in batch.items()}
        return [type(batch)({k: cut[k][i] for k in batch}) if type(batch) is not dict else {k: cut[k][i] for k in batch}
                for i in range(parts)]
    if isinstance(batch, (tuple, list)):
        cut = [split(v, parts) for v in batch]
        return [type(batch)(c[i] for c in cut) if isinstance(batch, tuple) else [c[i] for c in cut]
                for i in range(parts)]
    return [batch] * parts


def take(batch, rows: torch.Tensor):
    """The samples `rows` (indices) of `batch`, every tensor alike."""
    return apply(batch, lambda t: t[rows])


def resized(batch, size: int):
    """`size` samples made from `batch` by taking its samples in turn (an example of 2 samples as 8, or 1)."""
    n = check(batch, "the example input")
    return take(batch, torch.arange(size) % n)


def apply(batch, fn):
    """`fn` applied to every tensor of the batch, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: apply(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(apply(v, fn) for v in batch)
    if isinstance(batch, list):
        return [apply(v, fn) for v in batch]
    return batch


def to(batch, device):
    return apply(batch, lambda t: t.to(device))


def on_meta(batch):
    """The same batch on torch's meta device (shapes only)."""
    return apply(batch, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))


def describe(batch) -> str:
    """'input_ids torch.int64 (8, 16), labels torch.int64 (8, 16)'."""
    return ", ".join(f"{name} {t.dtype} {tuple(t.shape)}" for name, t in _named(batch))


def output_loss(output: Any) -> torch.Tensor:
    """The loss the model's output carries (a Hugging Face ModelOutput's `.loss`, a dict's "loss"): what
    `loss_fn=None` trains on. One line when there is none."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        kind = type(output).__name__
        raise DistUsageError(f"loss_fn=None trains on the loss the model's output carries, but its {kind} has none: "
                             f"put the labels in the batch (e.g. batch['labels']) or give a loss_fn(output, target)")
    return loss


def loss_of(output, targets, loss_fn) -> torch.Tensor:
    """loss_fn(output, targets), or the output's own loss when loss_fn is None."""
    return output_loss(output) if loss_fn is None else loss_fn(output, targets)


def first_tensor(output) -> torch.Tensor | None:
    """The first tensor of a module's output (a tensor, a tuple whose first item is one, a ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return next((v for v in output.values() if isinstance(v, torch.Tensor)), None)
    if isinstance(output, (tuple, list)) and output:
        return first_tensor(output[0])
    return None


def inputs_and_targets(batch, loss_given: bool, label: str = "the data"):
    """A data set's batch as (what the model takes, what loss_fn compares with): an (input, target) pair gives
    both; a dict (Hugging Face style) is the model's keywords, with its "labels" taken out as the targets when a
    loss_fn is given, and left in (the model computes its own loss) when loss_fn is None. One line otherwise."""
    if isinstance(batch, Mapping):
        batch = dict(batch)
        if loss_given:
            if "labels" not in batch:
                raise DistUsageError(f"{label} gives dicts ({', '.join(batch)}) and a loss_fn compares the output "
                                     f"with their 'labels', which they do not have")
            targets = batch.pop("labels")
            return batch, targets
        if "labels" not in batch:
            raise DistUsageError(f"{label} gives dicts without 'labels' ({', '.join(batch)}), and loss_fn=None trains "
                                 f"on the loss the model computes from them: add labels, or give a loss_fn")
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        if not loss_given:
            raise DistUsageError(f"{label} gives (input, target) pairs, and loss_fn=None trains on a loss the model's "
                                 f"output carries: give loss_fn(output, target), or dicts with 'labels'")
        return batch[0], batch[1]
    raise DistUsageError(f"{label}'s samples must be (input, target) pairs of tensors or dicts of tensors (model("
                         f"**sample)), got {type(batch).__name__}")

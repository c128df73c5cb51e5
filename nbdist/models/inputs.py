"""Inputs checked before a step is sent: what a model's first layer takes, read without running it (the Trainer's
data set, a sharded model's or a pipeline's batch), and whether an optimizer function makes an optimizer torch
accepts. Plain torch.nn, for the kernel and the ranks."""
from __future__ import annotations

import torch
from torch import nn


def first_layer(model: nn.Module) -> nn.Module | None:
    """The layer the model's input goes into, where that can be told without running it: the first of nested
    nn.Sequentials (under DDP's wrapper; a pipeline stage's view of layers "0", "1"... on the rank holding layer 0),
    if it is a Linear, an Embedding or a convolution, or a layer that begins with an Embedding (nbdist's gpt)."""
    layer, reached = getattr(model, "module", model), False
    while True:
        if isinstance(layer, nn.Sequential) and len(layer):
            layer, reached = layer[0], True
        elif type(layer) is nn.Module and hasattr(layer, "0"):  # training/ranks/runners.PipelineRunner's view
            layer, reached = getattr(layer, "0"), True
        else:
            break
    if isinstance(layer, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)):
        return layer
    first = next(layer.children(), None) if reached else None
    return first if isinstance(first, nn.Embedding) else None


def sample_mismatch(model: nn.Module, x: torch.Tensor, label: str, autocast: bool) -> str | None:
    """One line if one input sample `x` (unbatched) cannot go into the model's first layer: integer ids into a
    Linear, features into an Embedding, another floating dtype than the weights (unless autocast casts it), another
    width. None when it fits or the first layer cannot be told."""
    layer = first_layer(model)
    if layer is None:
        return None
    given = f"{label} gives inputs of {x.dtype} (one sample shaped {tuple(x.shape)})"
    if isinstance(layer, nn.Embedding):
        if x.is_floating_point() or x.is_complex():
            return (f"{given}, but the model's first layer is an Embedding({layer.num_embeddings}, "
                    f"{layer.embedding_dim}), which takes integer token ids")
        return None
    weight = layer.weight
    is_linear = isinstance(layer, nn.Linear)
    takes = (f"Linear({layer.in_features}, {layer.out_features})" if is_linear
             else f"{type(layer).__name__}({layer.in_channels}, {layer.out_channels})")
    if not x.is_floating_point():
        return f"{given}, but the model's first layer, {takes}, takes {weight.dtype} values"
    if x.dtype != weight.dtype and not autocast:
        return (f"{given}, but the model's first layer, {takes}, has {weight.dtype} weights: give {weight.dtype} "
                f"inputs (e.g. .to({weight.dtype}) in the data set) or build the model in {x.dtype}")
    if is_linear and (x.dim() == 0 or x.shape[-1] != layer.in_features):
        return f"{given}, but the model's first layer, {takes}, takes {layer.in_features} features (the last dimension)"
    if not is_linear:
        dims = len(layer.kernel_size)
        if x.dim() != dims + 1 or x.shape[0] != layer.in_channels:
            return (f"{given}, but the model's first layer, {takes}, takes samples of {layer.in_channels} channels "
                    f"and {dims} spatial dimension{'s' * (dims > 1)}: shaped ({layer.in_channels}, ...)")
    return None


def optimizer_problem(optimizer_fn) -> str | None:
    """optimizer_fn called on a stand-in parameter (as ZeRO-1 does): one line if it returns no optimizer, if torch
    refuses its settings ("Invalid learning rate: -0.1") or if its learning rate is not > 0. Whatever else it
    raises here (it may want the model's own parameters) is left to the real build. On the ranks, not in the
    kernel: building an optimizer imports torch._dynamo (about a second), which the kernel never needs otherwise."""
    try:
        made = optimizer_fn([nn.Parameter(torch.zeros(1))])
    except ValueError as e:
        return f"optimizer_fn: {e}" if str(e).startswith("Invalid") else None
    except Exception:  # noqa: BLE001 - the real build says it, with the model's parameters
        return None
    if not (hasattr(made, "param_groups") and hasattr(made, "step")):
        return (f"optimizer_fn must return a torch.optim.Optimizer (e.g. torch.optim.Adam(params, lr=1e-3)), got "
                f"{type(made).__name__}")
    for group in made.param_groups:
        lr = group.get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not lr > 0:
            return f"optimizer_fn's learning rate must be > 0, got lr={lr!r}"
    return None

"""The Trainer's inputs checked where they are used, ON the ranks: the data set a data function returns, its samples
against the model's first layer, what the loss function returns, and a first step that fails on them.

Each finding is one line naming the function, what it gave and what the model or the loop wanted. Every rank runs
the same functions on the same data and model, so every rank that finds something finds the same line: at set-up
each rank returns it (nothing is raised, so no rank traceback is shown), and a first step that fails is agreed on
at the step boundary (training.py), after which every rank returns its line instead of raising.
"""
from __future__ import annotations

import traceback

import torch
from torch import nn

from nbdist.errors import DistUsageError

ABOUT_INPUTS = (RuntimeError, TypeError, ValueError, IndexError)  # what torch raises on a dtype, shape or device that
# does not fit (a KeyError, AttributeError or NameError is more likely a bug in the user's code: its traceback stays)
DEBUG_HINT = "NBDIST_DEBUG=1 shows the ranks' tracebacks"


class InputError(DistUsageError):
    """One of the Trainer's inputs does not fit: the same line on every rank that finds it."""


def named(fn, label: str) -> str:
    """'data_fn my_data' for a named function, 'data_fn' for a lambda."""
    name = getattr(fn, "__name__", "") or ""
    return label if not name or name.startswith("<") else f"{label} {name}"


def describe(value) -> str:
    """'torch.float32 (4, 8)' for a tensor, the type's name for anything else."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"({', '.join(describe(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value)})"
    return type(value).__name__


def checked_dataset(dataset, label: str):
    """`dataset` if it is a map-style data set whose samples are (input, target) pairs of tensors (what the loop's
    batches are stacked from); else one line naming the data function and what it returned."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise InputError(f"{label} must return a map-style data set (len() and [i] giving (input, target) pairs), "
                         f"got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise InputError(f"{label} returned an empty data set")
    sample = dataset[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2
            and all(isinstance(t, torch.Tensor) for t in sample)):
        raise InputError(f"{label}'s samples must be (input, target) pairs of tensors, got {describe(sample)}")
    return dataset


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


class CheckedLoss:
    """The user's loss function, its result checked at every call (one number, with a gradient while training: what
    backward needs); what it failed on is remembered, to name it if the first step fails."""

    def __init__(self, fn, label: str = "loss_fn"):
        self.fn, self.label = fn, label
        self.calls = 0
        self.failed_on: str | None = None  # "outputs torch.float32 (4, 1), targets torch.int64 (4,)"

    def __call__(self, output, target):
        self.calls += 1
        given = None
        try:
            loss = self.fn(output, target)
        except Exception:
            self.failed_on = f"outputs {describe(output)}, targets {describe(target)}"
            raise
        if not isinstance(loss, torch.Tensor):
            given = f"got {type(loss).__name__}"
        elif loss.numel() != 1:
            given = f"got a tensor of shape {tuple(loss.shape)}"
        if given is not None:
            raise InputError(f"{self.label} must return one number per batch (a tensor, e.g. a mean), {given} for "
                             f"outputs {describe(output)} and targets {describe(target)}")
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise InputError(f"{self.label}'s result has no gradient: it must be computed from the model's output "
                             f"with torch operations (not .item() or a new tensor)")
        return loss


def first_step_line(error: Exception, loss: CheckedLoss, x, y, data_label: str, model: nn.Module | None) -> str:
    """One line for a first step that failed on the inputs: where (making the batch, the model's forward, the loss,
    after it), on what (the batch's dtype and shape, what the model's first layer takes) and torch's own words."""
    if isinstance(error, InputError):  # already one line: a check of ours
        return str(error)
    said = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    what = f"{type(error).__name__}: {said}" if said else type(error).__name__
    if x is None:
        return f"the first step could not make a batch of {data_label}'s samples ({what})"
    batch = f"inputs {describe(x)}, targets {describe(y)}"
    wanted = _wanted(model) if model is not None else ""
    if loss.calls == 0:
        where = f"the model's forward failed on {data_label}'s first batch ({batch}{wanted})"
    elif loss.failed_on is not None:
        where = f"{loss.label} failed on the model's {loss.failed_on}"
    else:
        where = (f"the first step failed after {loss.label} (in backward or the optimizer step) on {data_label}'s "
                 f"batch ({batch})")
    return f"{where}: {what} ({DEBUG_HINT})"


def _wanted(model: nn.Module) -> str:
    """'; the model's first layer is Linear(in_features=8, ...) in torch.float32', or its parameters' dtypes."""
    layer = first_layer(model)
    if layer is not None:
        params = list(layer.parameters())
        return f"; the model's first layer is {type(layer).__name__}({layer.extra_repr()})" + (
            f" in {params[0].dtype}" if params else "")
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return f"; the model's parameters are {', '.join(dtypes)}" if dtypes else ""


def about_inputs(error: BaseException) -> bool:
    """Whether a first step's failure is the kind that bad inputs cause (and so is said in one line). nbdist's own
    one-line errors other than these checks (a rank out of memory, names itself) are raised as they were."""
    return isinstance(error, InputError) or (isinstance(error, ABOUT_INPUTS) and not isinstance(error, DistUsageError))


def traceback_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def finite_weights(model: nn.Module) -> bool:
    """Whether every parameter this rank holds is finite (a DTensor's own shard)."""
    with torch.no_grad():
        return all(bool(torch.isfinite(getattr(p, "_local_tensor", p)).all()) for p in model.parameters())

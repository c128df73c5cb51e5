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
from nbdist.models.inputs import first_layer, optimizer_problem, sample_mismatch  # noqa: F401 - the loop's
from nbdist.training.replies import Prepared

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


class CheckedLoss:
    """The user's loss function, its result checked at every call (one number, with a gradient while training: what
    backward needs); what it failed on is remembered, to name it if the first step fails."""

    def __init__(self, fn, label: str = "loss_fn"):
        self.fn, self.label = fn, label
        self.calls = 0
        self.failed_on: str | None = None  # "outputs torch.float32 (4, 1), targets torch.int64 (4,)"

    def __call__(self, output, target):
        from nbdist.models.batches import output_loss

        self.calls += 1
        given = None
        try:
            loss = output_loss(output) if self.fn is None else self.fn(output, target)
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


def optimizer_coverage(model: nn.Module | None, optimizer) -> tuple[int, tuple[str, ...]]:
    """How many of the model's trainable parameters on this rank the optimizer steps, and the names of those it
    does not (the unsplit model's names, without DDP's `module.`). An optimizer_fn may ignore the parameters it is
    passed and build an optimizer over other tensors: the model then gets gradients and never changes, without a
    word from torch. ZeRO-1 over tensor-parallel parameters steps this replica's share through the optimizer the
    function made for it (TensorParallelZero.inner); torch's ZeroRedundancyOptimizer builds its own from the class."""
    if model is None or optimizer is None:
        return 0, ()
    from nbdist.data_parallel.ranks.zero_optimizer import TensorParallelZero

    expected = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    stepping = optimizer
    if isinstance(optimizer, TensorParallelZero):
        import torch.distributed as dist

        me = dist.get_rank(optimizer._group)
        share = {id(p) for p, owner in zip(optimizer._params, optimizer._owner) if owner == me}
        expected = {key: name for key, name in expected.items() if key in share}
        stepping = optimizer.inner
    held = {id(p) for group in (stepping.param_groups if stepping is not None else ()) for p in group["params"]}
    missing = tuple(_unwrapped(name) for key, name in expected.items() if key not in held)
    return len(expected) - len(missing), missing


def _unwrapped(name: str) -> str:
    """A parameter's name as the user's model has it (DDP and torch.compile wrap it in `module.`, `_orig_mod.`)."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


def prepare(seed: int, optimizer_fn: bytes) -> Prepared:
    """Before the model is built: every rank seeded alike, and the optimizer function tried on a stand-in parameter
    (inputs.optimizer_problem): the line that says what is wrong with it, or None, and the class it makes (what
    the replica modes' warnings name)."""
    from nbdist.wire import restore

    seed_everything(seed)
    make = restore(optimizer_fn)
    problem, kind = optimizer_problem(make), None
    if problem is None:
        try:
            kind = type(make([torch.nn.Parameter(torch.zeros(1))])).__name__
        except Exception:  # noqa: BLE001 - the real build says it, with the model's parameters
            kind = None
    return Prepared(problem, kind)


def seed_everything(seed: int) -> None:
    """The same torch, random and numpy seed on every rank before the model is built (a model_fn that does not
    seed itself still builds equal replicas)."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))

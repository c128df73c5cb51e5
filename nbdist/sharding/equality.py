"""Plan.check_equal: a plan against one process, in one call.

The plan is built fresh (its apply()), trains `steps` steps on one batch, and its losses and gathered weights are
compared with one process training the same model (built by the same function) on the same batch with the same
optimizer (sharding/ranks/reference.py, on rank 0). The result names the largest difference and where it is; it
is what the README shows and what a user runs on a model nbdist did not write.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nbdist.errors import DistUsageError
from nbdist.sharding.ranks import reference
from nbdist.wire import portable

ATOL = 1e-5  # float32, three steps: what "equal to one process" means in nbdist's tests


@dataclass
class Equality:
    """What check_equal found: both sides' losses, the largest differences and where they are."""

    plan: str
    losses: list[float]
    reference_losses: list[float]
    loss_diff: float
    weight_diff: float
    worst_key: str | None
    atol: float
    missing: list[str] = field(default_factory=list)  # keys one side has and the other has not

    @property
    def equal(self) -> bool:
        return not self.missing and self.loss_diff <= self.atol and self.weight_diff <= self.atol

    def __bool__(self) -> bool:
        return self.equal

    def __repr__(self) -> str:
        verdict = "equal to one process" if self.equal else "NOT equal to one process"
        where = f" ({self.worst_key})" if self.worst_key else ""
        text = (f"{self.plan}: {verdict} after {len(self.losses)} step(s) (atol {self.atol:g}): largest loss "
                f"difference {self.loss_diff:.2e}, largest weight difference {self.weight_diff:.2e}{where}")
        if self.missing:
            text += f"; keys on one side only: {', '.join(self.missing[:5])}"
        return text


def check_equal(plan, inputs, targets=None, loss_fn=None, steps: int = 3, optimizer_fn=None,
                atol: float = ATOL) -> Equality:
    """Build `plan`, train `steps` steps on (inputs, targets) with `optimizer_fn` (default: SGD lr 0.1; None
    steps nothing when given as False), and compare with one process (see the module docstring)."""
    from nbdist.checks import whole_number

    whole_number(steps, "steps")
    if optimizer_fn is None:
        optimizer_fn = _sgd
    built = plan.apply(optimizer_fn)
    try:
        losses = [built.step(inputs, targets, loss_fn) for _ in range(steps)]
        state = built.state_dict()
    finally:
        built.close()
    ref = plan.cluster.run(reference.serial_steps, portable(plan.model_fn), portable(optimizer_fn), inputs,
                           targets, portable(loss_fn), steps, ranks=[0])[0]
    missing = sorted(set(state) ^ set(ref["state"]))
    worst, worst_key = 0.0, None
    for key in sorted(set(state) & set(ref["state"])):
        a, b = state[key], ref["state"][key]
        if a.shape != b.shape:
            raise DistUsageError(f"check_equal: {key} is {tuple(a.shape)} in the plan but {tuple(b.shape)} in one "
                                 f"process")
        if not a.is_floating_point():
            diff = float((a != b).any())
        else:
            diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        if diff > worst:
            worst, worst_key = diff, key
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    return Equality(plan.describe(), losses, ref["losses"], loss_diff, worst, worst_key, atol, missing)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)

"""One process's training, on one rank (runs ON the engines): the reference a plan is checked against.

`serial_steps` builds the user's model from its function, as every rank of a plan does, and trains it on the
whole global batch in one process: the numbers a plan must give (Plan.check_equal, sharding/equality.py). On the
rank, not in the kernel: the same device and threads as the plan's ranks, and the kernel never imports an
optimizer (torch._dynamo, about a second).
"""
from __future__ import annotations

import torch

from nbdist.models import batches
from nbdist.runtime.ranks import placement
from nbdist.wire import restore


def serial_steps(model_fn: bytes, optimizer_fn: bytes | None, inputs, targets, loss_fn: bytes | None,
                 steps: int) -> dict:
    """`steps` steps of one process on the whole batch: each step's loss and, after the last, the model's
    state_dict and its parameters' gradients (on CPU)."""
    model = placement.place(restore(model_fn)()).train()
    make = restore(optimizer_fn)
    optimizer = make(model.parameters()) if make is not None else None
    inputs = batches.to(inputs, placement.here())
    targets = None if targets is None else targets.to(placement.here())
    loss_fn = restore(loss_fn)
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = batches.loss_of(batches.call(model, inputs), targets, loss_fn)
        loss.backward()
        losses.append(float(loss.detach()))
        if optimizer is not None:
            optimizer.step()
    with torch.no_grad():
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        grads = {k: None if p.grad is None else p.grad.detach().cpu().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "state": state, "grads": grads}

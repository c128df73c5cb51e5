"""PipeDream's semantics in one process: the reference the pipelined run is checked against.

PipeDream (arXiv 1806.03377) does not wait for a flush to update weights: each stage updates its weights right
after every micro-batch's backward (SGD, step `lr`). (nbdist runs one step's order to its end, so its steps still
fill and drain like 1F1B; only the update timing is PipeDream's.) So micro-batches that are in flight saw *older*
weights at their forward: that is the staleness. To keep each backward consistent with its forward, the stage stashes
the weight version the forward used and differentiates with it ("weight stashing"). A stage's weights therefore depend
only on the order of its own forwards and backwards, which the schedule fixes; this function replays that order, stage
by stage.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from nbdist.pipeline_parallel.stages import unsplit_key
from nbdist.pipeline_parallel.stepping import action_ticks
from nbdist.schedules.actions import BACKWARD, FORWARD


def pipedream_reference(model, schedule, ranges, inputs, targets, loss_fn, lr: float) -> dict:
    """Run `schedule`'s forwards and backwards in one process with PipeDream's weight versions.

    Returns {"loss": mean micro-batch loss, "state_dict": final weights, "grads": per-parameter sum of the
    micro-batch gradients, "versions": {(stage, mb): number of updates the stage had seen at that forward}}.
    """
    m, last = schedule.microbatches, schedule.stages - 1
    pieces = [torch.nn.Sequential(*list(model)[a:b]) for a, b in ranges]
    weights = [{k: p.detach().clone() for k, p in piece.named_parameters()} for piece in pieces]
    grads = [{k: torch.zeros_like(w) for k, w in ws.items()} for ws in weights]
    updates = [0] * len(pieces)
    xs, ys = inputs.chunk(m), targets.chunk(m)
    saved, grad_out, losses, versions = {}, {}, [], {}
    for action in _compute_order(schedule):
        s, j = action.stage, action.microbatch
        if action.kind == FORWARD:
            x = xs[j] if s == 0 else saved[(s - 1, j)][2].detach().requires_grad_()
            stash = {k: w.clone().requires_grad_() for k, w in weights[s].items()}
            y = functional_call(pieces[s], stash, (x,))
            if s == last:
                losses.append(loss_fn(y, ys[j]).detach())
                y = loss_fn(y, ys[j]) / m
            saved[(s, j)] = (x, stash, y)
            versions[(s, j)] = updates[s]
        elif action.kind == BACKWARD:
            x, stash, y = saved.pop((s, j))
            torch.autograd.backward(y, None if s == last else grad_out.pop((s, j)))
            if s > 0:
                grad_out[(s - 1, j)] = x.grad
            with torch.no_grad():
                for k, w in weights[s].items():
                    grads[s][k] += stash[k].grad
                    w -= lr * stash[k].grad
            updates[s] += 1
        else:
            raise ValueError(f"pipedream runs full backwards (B), not {action}")
    return {
        "loss": float(sum(losses) / m),
        "state_dict": _unsplit(weights, ranges),
        "grads": _unsplit(grads, ranges),
        "versions": versions,
    }


def _compute_order(schedule):
    """All ranks' compute actions in lockstep tick order (each stage's own order is the schedule's)."""
    ticks = action_ticks(schedule)
    timed = [(t, r, a) for r, acts in schedule.program.items() for a, t in zip(acts, ticks[r]) if a.is_compute]
    return [a for _, _, a in sorted(timed, key=lambda x: (x[0], x[1]))]


def _unsplit(per_stage: list[dict], ranges) -> dict:
    return {unsplit_key(first, key): value for (first, _), tensors in zip(ranges, per_stage) for key, value in
            tensors.items()}

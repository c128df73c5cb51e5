"""What every distributed model nbdist builds shows the notebook: its weights and gradients, gathered whole.

A Pipeline (stages on ranks) and a Sharded model (replicas, tensor slices, ZeRO shards) hold the model in pieces;
`state_dict()` and `grads()` give it back under the unsplit model's keys, so it compares with one process's model
key by key. Subclasses say how to collect the pieces (`_gather(grads)`).
"""
from __future__ import annotations


class GatheredModel:
    def _gather(self, grads: bool) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The whole model's parameters and buffers under the unsplit model's keys ('0.weight', ...)."""
        return self._gather(grads=False)

    def grads(self) -> dict:
        """Every parameter's gradient after the last step (averaged over the replicas), under the unsplit keys."""
        return self._gather(grads=True)

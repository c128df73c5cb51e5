"""A model in pieces, gathered whole: what every distributed model nbdist builds shows the notebook.

A Pipeline (stages on ranks) and a Sharded model (replicas, tensor slices, ZeRO shards) hold the model in pieces;
`state_dict()` and `grads()` give it back under the unsplit model's keys, so it compares with one process's model
key by key. Subclasses say how to collect the pieces (`_gather(grads)`); on the ranks, `whole` brings a tensor
(a DTensor's shards gathered) to the host and `unsplit_view` puts a pipeline rank's stages under the unsplit
model's layer names. Plain torch, no torch.distributed: both sides import it.
"""
from __future__ import annotations

import torch


class GatheredModel:
    def _gather(self, grads: bool) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The whole model's parameters and buffers under the unsplit model's keys ('0.weight', ...)."""
        return self._gather(grads=False)

    def grads(self) -> dict:
        """Every parameter's gradient after the last step (averaged over the replicas), under the unsplit keys."""
        return self._gather(grads=True)


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor whole, on the host: a DTensor's shards (tensor-parallel slices, FSDP2 shards) gathered first."""
    if t is None:
        return None
    if hasattr(t, "full_tensor"):  # a DTensor: tensor-parallel shards gathered
        t = t.full_tensor()
    return t.detach().cpu()


def unsplit_view(modules: dict, layers: dict) -> torch.nn.Module:
    """One module holding this rank's stage modules' layers under the unsplit model's names (layer a+i of a stage
    that starts at layer a): what get_state_dict keys a checkpoint by, so it loads into any other plan."""
    view = torch.nn.Module()
    for stage, module in modules.items():
        first = layers[stage][0]
        for i, layer in enumerate(module):
            view.add_module(str(first + i), layer)
    return view

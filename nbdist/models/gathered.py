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


def pruned_view(modules: dict, tied: tuple = ()) -> torch.nn.Module:
    """One module holding this rank's pruned stages' parameters and buffers under the user's model's own names
    (pipeline_parallel/split.py: a stage holds the model as `model`), in the model's order: the keys a checkpoint is
    written by, so it loads into any other plan. A tied tensor's copy is held under every name of its group (`tied`,
    in the model's order), as the whole model holds it: DCP keys its optimizer state by the group's first name on
    every plan."""
    entries: dict[str, tuple[int, int, torch.Tensor, bool | None]] = {}  # name -> (order, rank, tensor, persistent)
    for stage in modules.values():
        order = {name: i for i, (name, _) in enumerate(stage.model.named_modules())}
        for name, module in stage.model.named_modules():
            for key, value in module.named_parameters(recurse=False):
                entries.setdefault(_joined(name, key), (order[name], len(entries), value, None))
            for key, value in module.named_buffers(recurse=False):
                persistent = key not in module._non_persistent_buffers_set
                entries.setdefault(_joined(name, key), (order[name], len(entries), value, persistent))
        for group in tied:
            held = next((entries[n] for n in group if n in entries), None)
            for name in group if held is not None else ():
                where = order.get(name.rpartition(".")[0], held[0])
                entries.setdefault(name, (where, len(entries), held[2], None))
    view = _StagesView(list(modules.values()))
    for name, (_, _, value, persistent) in sorted(entries.items(), key=lambda kv: kv[1][:2]):
        holder = view
        path, _, key = name.rpartition(".")
        for part in path.split(".") if path else []:
            if not hasattr(holder, part):
                holder.add_module(part, torch.nn.Module())
            holder = getattr(holder, part)
        if persistent is None:
            holder.register_parameter(key, value)
        else:
            holder.register_buffer(key, value, persistent=persistent)
    return view


def _joined(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


class _StagesView(torch.nn.Module):
    """pruned_view's module: train() and eval() reach the stages it names the tensors of (evaluation turns their
    dropout and BatchNorm to eval)."""

    def __init__(self, stages: list):
        super().__init__()
        object.__setattr__(self, "stages", stages)  # not submodules: their tensors are registered by name

    def train(self, mode: bool = True):
        for stage in self.stages:
            stage.train(mode)
        return super().train(mode)

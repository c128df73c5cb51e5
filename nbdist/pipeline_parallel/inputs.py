"""What a pipeline checks in the kernel before anything reaches the ranks: a batch that splits into its
micro-batches, inputs its model's first layer takes, a model it can split (read on torch's meta device).
Shared with nbdist.shard's models, whose steps take the same batches."""
from __future__ import annotations

import copy

import torch
from torch import nn

from nbdist.errors import DistUsageError


def check_batch(inputs, targets, replicas: int, microbatches: int) -> None:
    """One line unless `inputs` (a tensor, a tuple or a dict of tensors: what the model takes) and `targets` (a
    tensor, or None when the model's output carries its loss) are one global batch that splits into `replicas`
    equal shares of `microbatches` equal micro-batches (a Pipeline's and a Sharded model's steps take such a
    batch)."""
    from nbdist.models import batches

    parts = replicas * microbatches
    split = f"{replicas} replicas × {microbatches}" if replicas > 1 else str(parts)
    given = {"inputs": batches.check(inputs, "inputs")}
    if targets is not None:
        if not isinstance(targets, torch.Tensor):
            raise DistUsageError(f"targets must be a torch.Tensor (or None with loss_fn=None), got "
                                 f"{type(targets).__name__}")
        given["targets"] = batches.check(targets, "targets")
    for name, n in given.items():
        if n % parts:
            raise DistUsageError(f"batch of {n} {name} does not split into {split} equal micro-batches")
    if len(set(given.values())) > 1:
        raise DistUsageError(f"{given['inputs']} inputs but {given['targets']} targets")


def check_step_inputs(model: nn.Module, inputs, loss_fn) -> None:
    """One line, before a step reaches the ranks, for inputs the model's first layer cannot take (dtype, width,
    ids against features: read from the kernel's copy of the model, meta or not, without running it) and a loss
    function that cannot be called as loss_fn(output, target) (None: the output's own loss)."""
    from nbdist.checks import check_functions
    from nbdist.models.inputs import sample_mismatch

    if loss_fn is not None:
        check_functions(loss_fn=loss_fn)
    if isinstance(inputs, torch.Tensor) and inputs.dim() and inputs.shape[0]:
        problem = sample_mismatch(model, inputs[0], "the batch", autocast=False)
        if problem:
            raise DistUsageError(problem)


def meta_model(model) -> nn.Sequential:
    """A copy of the model on torch's meta device: shapes and parameter counts, no memory, no compute."""
    if isinstance(model, nn.Sequential):
        return nn.Sequential(*[copy.deepcopy(layer).to("meta") for layer in model])
    if isinstance(model, nn.Module):
        kind = type(model).__name__
        raise DistUsageError(f"the model must be an nn.Sequential (or a function building one), got {kind}")
    if not callable(model):
        raise DistUsageError(f"the model must be an nn.Sequential or a function building one, got {model!r}")
    with torch.device("meta"):
        built = model()
    if not isinstance(built, nn.Sequential):
        raise DistUsageError(f"the model function must return an nn.Sequential, got {type(built).__name__}")
    return built


def check_pipeline_zero(zero, replicas: int, splits_backward: bool = False, split: bool = False) -> int:
    """ZeRO in a pipeline, over each stage's data-parallel replicas: 0; 1 (the optimizer state sharded, Megatron's
    distributed optimizer); 2 or 3 (FSDP2 on each stage: gradients, and for 3 the weights between uses, sharded;
    each micro-batch's gradients reduce-scattered into the shards as its backward ends). One line otherwise."""
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool):
        raise DistUsageError(f"a pipeline takes zero=0, 1, 2 or 3 (what is sharded over each stage's replicas), "
                             f"got {zero!r}")
    if zero >= 1 and replicas == 1:
        raise DistUsageError(f"zero={zero} shards over data-parallel replicas, but this pipeline has none (dp = 1)")
    if zero >= 2 and splits_backward:
        raise DistUsageError(f"zero={zero} with a schedule that splits the backward (I and W) is not supported: "
                             f"FSDP2 reduce-scatters a stage's gradients when its whole backward ends")
    if zero >= 2 and split:
        raise DistUsageError(f"zero={zero} with tp > 1 in a pipeline is not supported; zero=1 shards the optimizer "
                             f"state beside tensor parallelism")
    return zero

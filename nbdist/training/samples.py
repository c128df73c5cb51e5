"""What the Trainer reads of a user's data before anything is built (kernel side): two samples of the data set,
read on rank 0 as the loop batches them (a model that is not a Sequential is profiled on them; a pipeline's
evaluation samples are compared with them when the Trainer is made), and a pipeline's message shapes for the global
batch, once it is built; what SSP's replicas train with a given optimizer.
"""
from __future__ import annotations

from nbdist.errors import DistUsageError
from nbdist.training import inputs
from nbdist.training.ranks import data_source
from nbdist.training.ranks import inputs as rank_inputs
from nbdist.wire import portable


def read(cluster, data_fn, label: str, loss_fn, batch_size: int | None = None):
    """The data set's first two samples as the loop batches them, (inputs, targets or None), read on rank 0; one
    line where the data set is not one the loop can read (or, given `batch_size`, cannot make that batch of)."""
    said = cluster.run(data_source.sample, portable(data_fn), label, loss_fn is not None, batch_size=batch_size,
                       ranks=[0])[0]
    if said.problem is not None:
        raise DistUsageError(said.problem)
    return said.example


def check_evaluated_like_trained(trainer, eval_data_fn, loss_fn) -> None:
    """With pp > 1, evaluation runs through the same stages with the same messages: its samples must be shaped like
    the training ones. Said when the Trainer is made (a sample of each read on rank 0; the training one is kept
    for the build, which sizes the messages by it)."""
    from nbdist.models import batches

    example = trainer.example
    trained = _shape(example)[0] if trainer.plan.flat else None  # a Sequential's pipeline takes pairs: said first
    evaluated = read(trainer.cluster, eval_data_fn, "eval_data_fn", loss_fn, trainer.data.batch_size)
    if trained is None:  # a model cut by its units: any tensors the samples hold
        if _shapes_of(evaluated[0]) != _shapes_of(example[0]):
            raise DistUsageError(f"with pp > 1 the evaluation samples must be shaped like the training ones (the "
                                 f"pipeline's messages are sized for them): {batches.describe(evaluated[0])} vs "
                                 f"{batches.describe(example[0])}")
        return
    (shape, dtype), (eval_shape, eval_dtype) = trained, _shape(evaluated)[0]
    if (eval_shape, eval_dtype) != (shape, dtype):
        raise DistUsageError(f"with pp > 1 the evaluation samples must be shaped like the training ones (the "
                             f"pipeline's messages are sized for them): {tuple(eval_shape)} {eval_dtype} vs "
                             f"{tuple(shape)} {dtype}")


def pipeline_shapes(trainer, pipeline, data_fn, loss_fn, batch_size: int, precision: str) -> dict:
    """Each stage's message shape of the trainer's `pipeline` (just built) for this batch, from the data set's
    samples (read on rank 0). A Sequential's sample is checked against its first layer and the loss function on
    the stages' meta shapes here: a pipeline's ranks cannot agree on a failed first step (the others wait for its
    messages)."""
    import torch

    from nbdist.models import batches

    example = trainer.example
    if not trainer.plan.flat:  # a model cut by its units: the messages measured on the data's own samples
        return pipeline.message_shapes(batches.resized(example[0], batch_size))
    (shape, dtype), target = _shape(example)
    label = rank_inputs.named(data_fn, "data_fn")
    said = rank_inputs.sample_mismatch(trainer.plan.model, torch.empty(shape, dtype=dtype), label, precision != "fp32")
    if said:
        raise DistUsageError(said)
    try:
        shapes = pipeline.message_shapes(torch.empty((batch_size, *shape), dtype=dtype))
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        raise DistUsageError(f"the model's layers do not take {label}'s inputs of {dtype} (one sample shaped "
                             f"{tuple(shape)}): {type(e).__name__}: {str(e).strip().splitlines()[0]}") from None
    per_microbatch = batch_size // (trainer.replicas * trainer.plan.microbatches)
    inputs.check_loss_on_meta(loss_fn, shapes[max(shapes)], ((per_microbatch, *target[0]), target[1]))
    return shapes


def _shape(example):
    """((shape, dtype) of one sample's input, (shape, dtype) of its target) of (input, target) pairs."""
    x, y = example
    if not hasattr(x, "shape") or y is None:
        raise DistUsageError("a pipeline of an nn.Sequential takes (input, target) pairs of tensors")
    return (tuple(x.shape[1:]), x.dtype), (tuple(y.shape[1:]), y.dtype)


def _shapes_of(batch) -> list:
    from nbdist.models import batches

    return [(tuple(t.shape[1:]), t.dtype) for t in batches.tensors(batch)]


def say_what_ssp_trains(sync: str, optimizer: str | None) -> None:
    """SSP sends each replica's own optimizer step (training/ranks/sync_ssp.py): a sum of SGD steps is the step of
    the summed gradient, an Adam step is not. One warning line where a user might read "staleness 0" as one
    process's training."""
    if sync == "ssp" and optimizer not in (None, "SGD"):
        import warnings

        warnings.warn(f"sync='ssp' sends each replica's own optimizer step: with {optimizer} (each replica's state "
                      f"sees only its own gradients) even staleness 0 is not one process's training; with SGD (plain "
                      f"or momentum) it is", UserWarning, stacklevel=3)

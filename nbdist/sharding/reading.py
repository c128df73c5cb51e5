"""What a plan reads of the user's model, in the kernel, before anything is built: the model itself (built once on
CPU), its units and tied tensors (models/structure.py), the example input the profile runs, the tensor-parallel
plan resolved against it (tensor_parallel/plans.py), the pipeline's stage boundaries (layers of a Sequential, units
of any other model, from `balance`, `split_points` or balanced by parameters) with each cut proven on the example
(pipeline_parallel/split.py), and what the plan does to its BatchNorm layers. Every problem is one line.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn

from nbdist.errors import DistUsageError
from nbdist.layout import Layout
from nbdist.models import batches
from nbdist.models.structure import Structure, is_flat, owned_parameters, tied_groups
from nbdist.sharding.profile import sample_input
from nbdist.sharding.shape import check_any_shape, check_shape
from nbdist.tensor_parallel.pairs import tp_plan
from nbdist.tensor_parallel.plans import resolve as resolve_tp_plan


@dataclass(frozen=True)
class ModelChoices:
    """What a plan is told about a model it did not write: where to cut it, what it takes, how to split it."""

    split_points: list[str] | None = None
    example_input: object = None
    tp_plan: dict | str | None = None
    sync_batchnorm: bool = False


class FromData:
    """An example input read only if the plan needs one (a model that is not a Sequential): what the Trainer gives
    a plan, so that a Sequential's run does not read its data set in the kernel's path."""

    def __init__(self, read):
        self.read = read


class ModelReading:
    """The model a plan is made of, read and checked (see the module docstring)."""

    def __init__(self, model_fn, layout: Layout, batch: int, choices: ModelChoices):
        self.layout, self.choices = layout, choices
        self.tp, self.pp, self.chunks, self.balance = layout.tp, layout.pp, layout.chunks, layout.balance
        self.dp, self.microbatches = layout.dp, layout.microbatches
        self.model = build(model_fn)
        self.flat = is_flat(self.model)
        example = choices.example_input
        if isinstance(example, FromData):
            example = None if self.flat else example.read()
        self.example = checked_example(self.model, example)
        self.units = list(Structure.of(self.model, self.example).units)
        self.tied = tied_groups(self.model)
        self.tp_styles = self._tp_styles(choices.tp_plan)
        self.boundaries = self._boundaries()
        if self.flat and not choices.tp_plan:
            check_shape(self.model, dp=layout.dp, pp=layout.pp, tp=layout.tp, zero=layout.zero,
                        microbatches=layout.microbatches, batch=batch, boundaries=self.boundaries)
        else:
            check_any_shape(self.units, dp=layout.dp, pp=layout.pp, zero=layout.zero,
                            microbatches=layout.microbatches, batch=batch)
        self._check_cuts()
        self.batchnorm_note = self._batchnorm_note()

    def _boundaries(self) -> list[tuple[int, int]] | None:
        """Each pipeline piece's (first, end) layer (a Sequential's items; any other model's units)."""
        if self.pp == 1:
            if self.choices.split_points:
                raise DistUsageError("split_points cut pipeline stages, but pp=1 has none")
            return None
        from nbdist.pipeline_parallel.split import balanced_stages, stages_of
        from nbdist.pipeline_parallel.stages import boundaries, layer_counts

        pieces = self.pp * self.chunks
        what = "layers" if self.flat else "units"
        if pieces > len(self.units):
            raise DistUsageError(f"the model has {len(self.units)} {what}, fewer than pp × chunks = {pieces} stages"
                                 + ("" if self.flat else f" ({', '.join(self.units)})"))
        if self.choices.split_points is not None:
            if self.balance is not None:
                raise DistUsageError("give the stages in one place: balance (layers per stage) or split_points")
            ranges = stages_of(self.units, self.choices.split_points)
            if len(ranges) != pieces:
                raise DistUsageError(f"{len(self.choices.split_points)} split point(s) make {len(ranges)} stages, "
                                     f"but pp × chunks = {pieces}: give {pieces - 1} split point(s)")
            return ranges
        sizes = [sum(p.numel() for _, p in params) for params in owned_parameters(self.model, self.units).values()]
        if self.flat or self.balance is not None:
            return boundaries(layer_counts(sizes, pieces, self.balance))
        return balanced_stages(self.model, self.units, sizes, pieces, self.example)

    def _check_cuts(self) -> None:
        """A pipeline of a model that is not a Sequential: each cut proven on the example input (the stages run one
        after another give the whole model's output: pipeline_parallel/split.py), in one line where not."""
        if self.boundaries is None or self.flat:
            return
        from nbdist.pipeline_parallel.cut import check_tied_stages
        from nbdist.pipeline_parallel.split import check_cuts

        check_tied_stages(self.tied, self.units, self.boundaries, self.layout.zero)
        check_cuts(self.model, self.units, self.boundaries, self.example)

    def _tp_styles(self, given) -> dict:
        """The tensor-parallel plan, resolved and checked against the model (tensor_parallel/plans.py): the user's,
        or a Sequential's own Linear pairs. {} at tp=1."""
        if given is not None and self.tp == 1:
            raise DistUsageError("tp_plan splits layers over tensor-parallel ranks, but tp=1: give tp=2 or more")
        if self.tp == 1:
            return {}
        if given is None:
            if self.flat:
                return tp_plan(self.model)
            hint = " or tp_plan='auto' (its Hugging Face config carries one)" if getattr(
                getattr(self.model, "config", None), "base_model_tp_plan", None) else ""
            raise DistUsageError(f"tp={self.tp} needs to know which layers of {type(self.model).__name__} to split: "
                                 f"give tp_plan={{module name: 'colwise' | 'rowwise'}}{hint}")
        return resolve_tp_plan(self.model, given, self.tp)

    def _batchnorm_note(self) -> str | None:
        """One line when the plan changes what the model's BatchNorm layers compute (their statistics come from
        each replica's micro-batch, not the whole batch), said once as a warning; None when it does not."""
        from torch.nn.modules.batchnorm import _BatchNorm

        norms = [name for name, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
        replicas = self.dp if not self.choices.sync_batchnorm else 1
        if not norms or replicas * self.microbatches == 1:
            return None
        parts = [f"dp={self.dp}" if replicas > 1 else "", f"microbatches={self.microbatches}"
                 if self.microbatches > 1 else ""]
        share = self.dp * self.microbatches if replicas > 1 else self.microbatches
        named = ", ".join(norms[:3]) + (", ..." if len(norms) > 3 else "")
        note = (f"{type(self.model).__name__}'s BatchNorm layers ({named}) take their statistics from 1/{share} of the "
                f"batch under {' and '.join(p for p in parts if p)}: training differs from one process")
        way = ("; shard(..., sync_batchnorm=True) makes dp equal to one process" if replicas > 1 else "")
        if self.microbatches > 1:
            way += "; micro-batches cannot share statistics (use microbatches=1, or GroupNorm/LayerNorm)"
        warnings.warn(note + way, BatchNormWarning, stacklevel=5)
        return note + way


class BatchNormWarning(UserWarning):
    """A plan changes what a model's BatchNorm layers compute (statistics per replica or micro-batch)."""


def build(model_fn) -> nn.Module:
    """The model, built once in the kernel on CPU to profile it; one clear line when that fails."""
    try:
        model = model_fn()
    except Exception as e:  # noqa: BLE001 - the user's function: say what it raised, in one line
        raise DistUsageError(f"model_fn raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise DistUsageError(f"model_fn must return an nn.Module (e.g. nbdist.models.gpt(), an nn.Sequential or a "
                             f"Hugging Face model), got {type(model).__name__}")
    return model


def checked_example(model: nn.Module, example):
    """The user's example input (a tensor, a tuple or a dict of tensors), checked to be a batch; None where the
    model's own input can be made (nbdist's models, a Sequential that starts with a Linear). One line for any
    other model without one."""
    if example is None:
        sample_input(model)  # one line if the model's input cannot be told
        return None
    batches.check(example, "example_input")
    return example

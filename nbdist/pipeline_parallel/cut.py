"""How a pipeline's model is cut into stages (kernel side): an nn.Sequential between its items, read on torch's
meta device; any other nn.Module between its units (models/structure.py), each stage a pruned copy of the model
(split.py) whose cuts are proven on an example input before anything runs on the ranks.

The stages are given as layers (units) per stage (`balance`), as split points (module names that begin a stage,
torch's pipelining vocabulary) or balanced by parameters. A tensor the model ties across two stages (GPT-2's
embedding and head) is kept: each stage holds a copy whose gradients the ranks sum (ranks/pipeline.py); FSDP2,
which would shard each copy on its own, is refused for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nbdist.errors import DistUsageError
from nbdist.models import batches
from nbdist.models.structure import Structure, owned_parameters, tied_groups, unit_of, user_state_dict
from nbdist.pipeline_parallel.inputs import meta_model
from nbdist.pipeline_parallel.split import balanced_stages, check_cuts, stages_of
from nbdist.pipeline_parallel.stages import boundaries, layer_counts, parameter_sizes


@dataclass(frozen=True)
class Cutting:
    """What the user says of a model that is not a Sequential: the split points (None: balanced), an example
    input the cuts are proven on, BatchNorm synchronised over the replicas."""

    split_points: list[str] | None = None
    example_input: object = None
    sync_batchnorm: bool = False
    read: nn.Module | None = None  # the kernel's copy, built and its cuts proven by the caller (a plan's apply)


class Cut:
    """The stages of one pipeline's model: `ranges` [(first, end) layer or unit] per stage, `balance` the counts;
    `whole` the kernel's copy of a model cut by its units (None for a Sequential, read as `meta_model`)."""

    def __init__(self, model, schedule, balance, cutting: Cutting, zero: int):
        self.cutting = cutting
        self.model = stage_functions(model)  # what the ranks build from
        pieces = schedule.stages
        self.whole = general_model(self.model, cutting)
        if self.whole is None:
            if cutting.split_points is not None:
                raise DistUsageError("split_points cut a model that is not an nn.Sequential; a Sequential is cut "
                                     "by balance=[layers per stage]")
            self.meta_model = meta_model(self.model)
            self.units, self.tied = [str(i) for i in range(len(self.meta_model))], []
            sizes = parameter_sizes(self.meta_model)
        else:
            if schedule.name == "pipedream":
                raise DistUsageError("pipedream stashes each stage's weights as a Sequential's slice: give an "
                                     "nn.Sequential, or a synchronous schedule for this model")
            self.meta_model = self.whole
            self.units = list(Structure.of(self.whole, cutting.example_input).units)
            self.tied = tied_groups(self.whole)
            owned = owned_parameters(self.whole, self.units)
            sizes = [sum(p.numel() for _, p in owned[u]) for u in self.units]
        if pieces > len(self.units):
            what = "layers" if self.whole is None else f"units ({', '.join(self.units)})"
            raise DistUsageError(f"the model has {len(self.units)} {what}, fewer than stages × chunks = {pieces} "
                                 f"pieces")
        if self.whole is not None and cutting.split_points is not None:
            if balance is not None:
                raise DistUsageError("give the stages in one place: balance (units per stage) or split_points")
            self.ranges = stages_of(self.units, cutting.split_points)
            if len(self.ranges) != pieces:
                raise DistUsageError(f"{len(cutting.split_points)} split point(s) make {len(self.ranges)} stages, "
                                     f"but stages × chunks = {pieces}: give {pieces - 1} split point(s)")
            self.balance = [b - a for a, b in self.ranges]
        elif self.whole is not None and balance is None:
            self.ranges = balanced_stages(self.whole, self.units, sizes, pieces, cutting.example_input)
            self.balance = [b - a for a, b in self.ranges]
        else:
            self.balance = layer_counts(sizes, pieces, balance)
            self.ranges = boundaries(self.balance)
        self._shapes: dict = {}
        if self.whole is not None:
            self._check_tied(zero)
            if cutting.example_input is not None and cutting.read is None:  # proven now, before the ranks build
                check_cuts(self.whole, self.units, self.ranges, cutting.example_input)

    def _check_tied(self, zero: int) -> None:
        check_tied_stages(self.tied, self.units, self.ranges, zero)

    def check_tp_plan(self, tp_plan) -> None:
        """Every stage's tensor-parallel entries name modules of that stage (one line before anything is built:
        a name that reaches nothing would train unsplit without a word)."""
        if tp_plan is None:
            return
        for stage, plan in tp_plan.items():
            if not isinstance(stage, int) or not 0 <= stage < len(self.ranges):
                raise DistUsageError(f"tp_plan's keys are stage numbers 0..{len(self.ranges) - 1}, got {stage!r}")
            a, b = self.ranges[stage]
            if self.whole is None:
                names = {n for n, _ in nn.Sequential(*list(self.meta_model)[a:b]).named_modules()}
            else:
                names = {f"model.{n}" for n, _ in self.whole.named_modules()
                         if n and a <= _unit_index(self.units, n) < b}
            for name in plan:
                if name not in names:
                    where = "numbered from 0 within the stage" if self.whole is None else "'model.' and the name"
                    raise DistUsageError(f"tp_plan[{stage}] names {name!r}, which is no module of stage {stage} "
                                         f"(its modules are {where}): nothing would be split")

    def message_shapes(self, inputs, parts: int) -> dict:
        """stage -> (shape, dtype) of its output for one micro-batch of `inputs` (the global batch cut into
        `parts`), by running the kernel's copy once on it; which also proves the cuts (split.py)."""
        key = tuple((tuple(t.shape), t.dtype) for t in batches.tensors(inputs))
        if key not in self._shapes:
            one = batches.split(inputs, parts)[0]
            self._shapes[key] = dict(enumerate(check_cuts(self.whole, self.units, self.ranges, one)))
        return self._shapes[key]

    def gathered(self, per_rank: list[dict], grads: bool) -> dict:
        """Pruned stages' tensors ("model.<name>") under the model's own names, in its state_dict's order (its
        named_parameters' for gradients); a tied tensor's other names from the stage holding them."""
        found = {key.removeprefix("model."): value for stage_tensors in per_rank
                 for tensors in stage_tensors.values() for key, value in tensors.items()}
        if grads:
            return {name: found[name] for name, _ in self.whole.named_parameters() if name in found}
        return user_state_dict(self.whole, found)


def check_tied_stages(tied, units, ranges, zero: int) -> None:
    """A tensor tied across stages is kept equal by summing its copies' gradients; FSDP2 would shard each copy on
    its own: refused, in one line."""
    for group in tied:
        stages = sorted({s for s in (_stage_of_parameter(units, ranges, name) for name in group) if s is not None})
        if len(stages) > 1 and zero >= 2:
            raise DistUsageError(f"{' and '.join(group)} are one tied tensor held by stages {stages[0]} and "
                                 f"{stages[-1]}; zero={zero} shards each stage's copy on its own: use zero=0 or 1 "
                                 f"(the tied gradients are then summed between the stages), or untie them")


def _stage_of_parameter(units, ranges, name: str) -> int | None:
    index = _unit_index(units, name.rpartition(".")[0])
    return next((s for s, (a, b) in enumerate(ranges) if a <= index < b), None)


def _unit_index(units, name: str) -> int:
    try:
        return unit_of(units, name)
    except DistUsageError:
        return -1


def stage_functions(model):
    """A list of functions, one per stage, as one Sequential of the modules they build (one item per stage)."""
    if not isinstance(model, (list, tuple)):
        return model
    if not model or not all(callable(f) and not isinstance(f, nn.Module) for f in model):
        raise DistUsageError("a pipeline's model is an nn.Sequential, a function building a model, or a list of "
                             "functions each building one stage's module")
    functions = list(model)

    def built() -> nn.Sequential:
        return nn.Sequential(*[f() for f in functions])

    return built


def general_model(model, cutting: Cutting) -> nn.Module | None:
    """The model built in the kernel (real, on CPU: its cuts are proven by running it) when it is not a
    Sequential; None for a Sequential (cut between its items on the meta device)."""
    if isinstance(model, nn.Sequential):
        return None
    if isinstance(model, nn.Module):
        return model
    if cutting.read is not None:
        return None if isinstance(cutting.read, nn.Sequential) else cutting.read
    if not callable(model):
        raise DistUsageError(f"the model must be an nn.Module or a function building one, got {model!r}")
    if cutting.split_points is None and cutting.example_input is None:
        try:
            with torch.device("meta"):  # a Sequential is read there, no memory
                probe = model()
        except Exception:  # noqa: BLE001 - not buildable on meta: built for real below
            probe = None
        if isinstance(probe, nn.Sequential):
            return None
    try:
        built = model()
    except Exception as e:  # noqa: BLE001 - the user's function: what it raised, in one line
        raise DistUsageError(f"the model function raised {type(e).__name__}: {e}") from None
    if isinstance(built, nn.Sequential):
        return None
    if not isinstance(built, nn.Module):
        raise DistUsageError(f"the model function must return an nn.Module, got {type(built).__name__}")
    return built

"""What a sharding plan will cost before it runs: each rank's memory, and the step's time.

A plan is shown with its numbers before any rank builds anything, so the numbers come from a profile of the model
made in the notebook kernel: one small real forward on CPU (`profile_layers`) tells, per top-level layer of the
nn.Sequential, its parameters, the bytes autograd saves for backward per sample, and which of them tensor parallel
divides. `time_layers` (called on an engine by the plan) adds forward and backward seconds per sample. From the
profile, `predict_memory` gives each pipeline stage's bytes per rank and `predict_step_seconds` the step's time with
every term visible. Both refuse impossible shapes in one line (`check_shape`, which the plan calls first).

Tensor parallel follows Megatron-LM (arXiv 1909.08053): in a GPT block q, k, v and mlp.fc are column-parallel
(weight rows and bias split by tp), attn.out and mlp.proj row-parallel (weight columns split, bias replicated);
LayerNorms, embeddings and the head are replicated. In a plain Sequential consecutive Linear layers pair up, column
then row. `tp_pairs` is the one source of that rule: the plan builds DTensor's parallelize_module plan from it.

Plain data: imports torch and torch.nn, never torch.distributed, so both the kernel and the engines can read it.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from functools import reduce
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from nbdist.checks import is_whole, whole_number
from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel.stages import boundaries as ranges_of, layer_counts
from nbdist.schedules.generators import build
from nbdist.schedules.schedule import Schedule
from nbdist.units import format_bytes

if TYPE_CHECKING:
    from nbdist.collectives.costmodel import AlphaBeta
    from nbdist.schedules.simulate import Timeline

ZERO_STAGES = (0, 1, 2, 3)
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}  # state tensors of a parameter's size
# Layers a column-parallel output may pass on its way to the row-parallel Linear: they act on each feature alone,
# so each rank can apply them to its slice of the features.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Dropout)

# ---------------------------------------------------------------------------------------------------------------
# Which Linear layers tensor parallel splits
# ---------------------------------------------------------------------------------------------------------------


def _is_block(layer: nn.Module) -> bool:
    """A GPT block as nbdist.models builds it: attn.q/k/v/out and mlp.fc/proj are Linear layers."""
    attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    return (all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q", "k", "v", "out"))
            and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("fc", "proj")))


def tp_pairs(model: nn.Sequential, tp: int = 1) -> list[tuple[str, str]]:
    """(column-parallel, row-parallel) Linear layers by qualified name, in model order.

    A GPT block gives (q, out), (k, out), (v, out) and (fc, proj): attention's three column layers all feed `out`,
    so a row layer may appear in several pairs. A plain Sequential pairs its top-level Linear layers 1st with 2nd,
    3rd with 4th, ...; only element-wise layers may sit between two of a pair (anything else, a LayerNorm say,
    needs all the features), and an unpaired Linear stays replicated. With tp > 1 and no pair: refused.
    """
    if any(_is_block(layer) for layer in model):
        pairs = []
        for name, layer in model.named_children():
            if _is_block(layer):
                pairs += [(f"{name}.attn.{c}", f"{name}.attn.out") for c in ("q", "k", "v")]
                pairs.append((f"{name}.mlp.fc", f"{name}.mlp.proj"))
    else:
        pairs, column = [], None
        for name, layer in model.named_children():
            if isinstance(layer, nn.Linear) and column is None:
                column = name
            elif isinstance(layer, nn.Linear):
                pairs.append((column, name))
                column = None
            elif not isinstance(layer, ELEMENTWISE):
                column = None
    if not pairs and tp > 1:
        raise DistUsageError(f"the model has no pair of Linear layers to split: tensor parallel needs two Linear "
                             f"layers with only element-wise layers between them, or GPT blocks; got tp={tp}")
    return pairs


def tp_plan(model: nn.Sequential) -> dict[str, str]:
    """Qualified name -> "colwise" or "rowwise", every split Linear once: what parallelize_module's plan names."""
    plan = {}
    for column, row in tp_pairs(model):
        plan[column], plan[row] = "colwise", "rowwise"
    return plan


# ---------------------------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamShape:
    """One parameter: its full shape, and the dimension tensor parallel splits (0 column, 1 row weight, None: kept
    whole on every rank)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None

    def local_shape(self, tp: int = 1) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.shape
        return tuple(s // tp if d == self.tp_dim else s for d, s in enumerate(self.shape))

    def numel(self, tp: int = 1) -> int:
        return math.prod(self.local_shape(tp))

    def shard_numel(self, tp: int, dp: int) -> int:
        """Elements of FSDP2's shard on one of dp ranks: dim 0 cut in ceil(rows / dp) rows (the last shards padded,
        as FSDP2 pads them)."""
        shape = self.local_shape(tp) or (1,)
        return -(-shape[0] // dp) * math.prod(shape[1:])


@dataclass(frozen=True)
class LayerProfile:
    """One top-level layer of the Sequential, for one sample (bytes are fp32 as profiled).

    Saved bytes count each storage autograd keeps for backward once, in the first layer that saves it.
    `input_bytes_per_sample` is what a layer saves that an earlier layer already saved (its input, e.g. a ReLU's
    output that the next Linear saves again): a pipeline stage that starts at this layer holds it once more, as its
    received input. The `*_split_*` parts are what tensor parallel divides by tp (measured on the tp-sliced layer).
    `tp_allreduce_bytes_per_sample`: the layer's tensor-parallel all-reduces, (forward bytes, backward bytes) each:
    a row-parallel Linear's output in forward, a column-parallel Linear's input gradient in backward.
    """

    name: str
    kind: str
    params: int
    tp_params: int
    tensors: tuple[ParamShape, ...]
    activation_bytes_per_sample: float
    activation_split_bytes_per_sample: float
    input_bytes_per_sample: float
    input_split_bytes_per_sample: float
    output_bytes_per_sample: float
    tp_allreduce_bytes_per_sample: tuple[tuple[float, float], ...] = ()
    forward_s: float | None = None  # per sample, None until timed (time_layers, with_times)
    backward_s: float | None = None

    def saved_bytes(self, tp: int = 1) -> float:
        """Bytes per sample this layer saves for backward on one of tp ranks."""
        return _divided(self.activation_bytes_per_sample, self.activation_split_bytes_per_sample, tp)

    def input_saved_bytes(self, tp: int = 1) -> float:
        return _divided(self.input_bytes_per_sample, self.input_split_bytes_per_sample, tp)


def _divided(whole: float, split: float, tp: int) -> float:
    return whole - split + split / tp


def profile_layers(model: nn.Sequential, sample_input: torch.Tensor, tp: int = 1) -> list[LayerProfile]:
    """Profile each top-level layer with one forward of `sample_input` (a small batch) in this process.

    The tensor-parallel part of the saved bytes is measured, not assumed: the model is rebuilt with its pairs
    sliced (column layers keep out_features / t, row layers in_features / t) and counted again; whole = R + S,
    sliced = R + S / t gives S. t is `tp`, or with tp=1 the smallest split the model allows, so a profile serves
    every tp (the sliced sizes are linear in 1/t). A model on the meta device is materialised on CPU first.
    """
    if tp > 1:
        _check_tp(model, tp)
    model, x = _runnable(model, sample_input)
    batch = x.shape[0]
    whole = _saved_bytes(model, x)
    t = tp if tp > 1 else _smallest_split(model)
    sliced = _saved_bytes(_tp_sliced(model, t), x) if t > 1 else whole
    split = (lambda a, b: (a - b) * t / (t - 1)) if t > 1 else (lambda a, b: 0.0)
    allreduces = _allreduces_per_layer(model, whole["io"])
    shapes = _param_shapes(model)
    profiles = []
    for i, (name, layer) in enumerate(model.named_children()):
        tensors = shapes[i]
        profiles.append(LayerProfile(
            name=name, kind=type(layer).__name__, params=sum(p.numel() for p in tensors),
            tp_params=sum(p.numel() for p in tensors if p.tp_dim is not None), tensors=tensors,
            activation_bytes_per_sample=whole["own"][i] / batch,
            activation_split_bytes_per_sample=split(whole["own"][i], sliced["own"][i]) / batch,
            input_bytes_per_sample=whole["again"][i] / batch,
            input_split_bytes_per_sample=split(whole["again"][i], sliced["again"][i]) / batch,
            output_bytes_per_sample=whole["output"][i] / batch,
            tp_allreduce_bytes_per_sample=tuple((f / batch, b / batch) for f, b in allreduces[i]),
        ))
    return profiles


def _runnable(model: nn.Sequential, x: torch.Tensor) -> tuple[nn.Sequential, torch.Tensor]:
    """The model and input in real memory: a meta model is copied to real (uninitialised) storage; sizes are all
    the profile reads from it."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model = copy.deepcopy(model).to_empty(device="cpu")
    # its own storage: a view of a larger batch (x[:2]) would count the whole batch as the layer's saved input
    x = torch.zeros(x.shape, dtype=x.dtype) if x.is_meta else x.clone()
    return model, x


def _param_shapes(model: nn.Sequential) -> list[tuple[ParamShape, ...]]:
    split = {}
    for column, row in tp_pairs(model):
        split[f"{column}.weight"] = split[f"{column}.bias"] = 0
        split[f"{row}.weight"] = 1
    return [tuple(ParamShape(f"{name}.{p}", tuple(t.shape), split.get(f"{name}.{p}"))
                  for p, t in layer.named_parameters()) for name, layer in model.named_children()]


def _is_parameter(t: torch.Tensor) -> bool:
    """Autograd also saves weights (or views of them) for backward; they are parameters, not activations."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _saved_bytes(model: nn.Sequential, x: torch.Tensor) -> dict:
    """One forward of `model` (kept alive until counted): per top-level layer the bytes of storages it saves for
    backward that no earlier layer saved ("own") and that one did ("again"), its output's bytes, and per split
    Linear its input and output bytes ("io")."""
    n = len(model)
    out = {"own": [0] * n, "again": [0] * n, "output": [0] * n, "io": {}}
    owner: dict[int, int] = {}
    counted: set[tuple[int, int]] = set()
    current = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage, i = t.untyped_storage(), current[0]
        if not _is_parameter(t) and storage.nbytes() and (i, storage.data_ptr()) not in counted:
            counted.add((i, storage.data_ptr()))
            first = owner.setdefault(storage.data_ptr(), i)
            out["own" if first == i else "again"][i] += storage.nbytes()
        return t.detach()  # a saved output kept with its grad_fn would be a cycle that keeps the graph alive

    hooks = []
    for i, layer in enumerate(model):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, y, i=i: out["output"].__setitem__(i, _nbytes(y))))
    for name in tp_plan(model):
        hooks.append(model.get_submodule(name).register_forward_hook(
            lambda m, a, y, name=name: out["io"].__setitem__(name, (_nbytes(a[0]), _nbytes(y)))))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = model(x)
        del result
    finally:
        for h in hooks:
            h.remove()
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _allreduces_per_layer(model: nn.Sequential, io: dict) -> list[list[tuple[int, int]]]:
    """Per top-level layer, its tensor-parallel all-reduces as (forward bytes, backward bytes), one entry each:
    every row-parallel Linear all-reduces its output in forward (Megatron's g); every column-parallel Linear
    all-reduces its input's gradient in backward (Megatron's f). Megatron fuses q, k and v into one column layer
    (one f per attention); DTensor on separate q, k, v layers does three (counted on the ranks with CommDebugMode:
    2 all-reduces per GPT block forward, 4 backward)."""
    index = {name: i for i, (name, _) in enumerate(model.named_children())}
    out: list[list[tuple[int, int]]] = [[] for _ in model]
    rows = dict.fromkeys(row for _, row in tp_pairs(model))
    columns = dict.fromkeys(column for column, _ in tp_pairs(model))
    for row in rows:
        out[index[row.split(".")[0]]].append((io[row][1], 0))
    for column in columns:
        out[index[column.split(".")[0]]].append((0, io[column][0]))
    return out


def _smallest_split(model: nn.Sequential) -> int:
    """The smallest tp > 1 every pair's inner size (and the heads) divides; 1 if there is none."""
    sizes = [model.get_submodule(c).out_features for c, _ in tp_pairs(model)]
    sizes += [getattr(getattr(model, "config", None), "heads", None) or 0]
    common = reduce(math.gcd, sizes, 0)
    return next((t for t in range(2, common + 1) if common % t == 0), 1)


def _tp_sliced(model: nn.Sequential, tp: int) -> nn.Sequential:
    """A copy of `model` as one tensor-parallel rank holds it: column layers with out_features / tp, row layers with
    in_features / tp (the first slice of the weights)."""
    sliced = copy.deepcopy(model)
    for name, style in tp_plan(model).items():
        old = sliced.get_submodule(name)
        rows, cols = (old.out_features // tp, old.in_features) if style == "colwise" else (
            old.out_features, old.in_features // tp)
        new = nn.Linear(cols, rows, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight[:rows, :cols])
            if old.bias is not None:
                new.bias.copy_(old.bias[:rows])
        parent, _, child = name.rpartition(".")
        setattr(sliced.get_submodule(parent) if parent else sliced, child, new)
    return sliced


def sample_input(model: nn.Sequential, size: int = 1) -> torch.Tensor:
    """`size` samples of the model's input, filled deterministically: tokens below the vocabulary for the package's
    transformer (it has a `config`), else normal features for the first Linear."""
    config = getattr(model, "config", None)
    generator = torch.Generator().manual_seed(0)
    if config is not None and hasattr(config, "seq"):
        return torch.randint(0, config.vocab, (size, config.seq), generator=generator)
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise DistUsageError("cannot tell the model's input: it is neither nbdist.models.gpt nor starts with a Linear")
    return torch.randn(size, first.in_features, generator=generator)


def time_layers(model: nn.Sequential, sample_batch: torch.Tensor, repeats: int = 5) -> list[tuple[float, float]]:
    """(forward, backward) seconds per sample of each top-level layer, run alone in this process (an engine's, to
    time its device): the median of `repeats` runs after one warm-up, divided by the batch. A copy is timed, so the
    model's gradients are left as they were."""
    whole_number(repeats, "repeats")
    model, x = _runnable(copy.deepcopy(model), sample_batch)
    inputs = []
    with torch.no_grad():
        for layer in model:
            inputs.append(x)
            x = layer(x)
    return [_time_layer(layer, inp, repeats, sample_batch.shape[0]) for layer, inp in zip(model, inputs)]


def _time_layer(layer: nn.Module, x: torch.Tensor, repeats: int, batch: int) -> tuple[float, float]:
    # a GPU only queues kernels: wait for them before reading the clock (only ever on an engine's GPU tensors)
    wait = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    forward, backward = [], []
    for _ in range(repeats + 1):  # the first run warms up the allocator and autograd
        x_in = x.detach().requires_grad_(x.is_floating_point())
        wait()
        start = time.perf_counter()
        y = layer(x_in)
        wait()
        middle = time.perf_counter()
        if y.requires_grad:
            y.backward(torch.ones_like(y))
        wait()
        end = time.perf_counter()
        forward.append(middle - start)
        backward.append(end - middle)
    return statistics.median(forward[1:]) / batch, statistics.median(backward[1:]) / batch


def with_times(layers: Sequence[LayerProfile], times: Sequence[tuple[float, float]]) -> list[LayerProfile]:
    """The profiles with `time_layers`' seconds filled in."""
    if len(times) != len(layers):
        raise DistUsageError(f"got times for {len(times)} layers, but the profile has {len(layers)}")
    return [replace(layer, forward_s=f, backward_s=b) for layer, (f, b) in zip(layers, times)]


# ---------------------------------------------------------------------------------------------------------------
# Shapes a plan may take
# ---------------------------------------------------------------------------------------------------------------


def check_shape(model: nn.Sequential, *, dp: int, pp: int, tp: int, zero: int, microbatches: int, batch: int,
                boundaries: Sequence[tuple[int, int]] | None = None) -> None:
    """Refuse, in one line, a plan that cannot run on `model` (dp*pp*tp = world size is the plan's own check)."""
    for label, value in (("dp", dp), ("pp", pp), ("tp", tp), ("microbatches", microbatches), ("batch", batch)):
        whole_number(value, label)
    _zero(zero)
    if pp > len(model):
        raise DistUsageError(f"pp={pp} needs at least {pp} layers to cut into stages, but the model has {len(model)}")
    micro_batch_size(batch, dp, microbatches)
    if tp > 1:
        _check_tp(model, tp)
    if boundaries is not None:
        ranges = _checked_ranges(boundaries, len(model), len(boundaries) if len(boundaries) % pp == 0 else pp)
    else:  # as nbdist.pipeline cuts it: balanced by parameters
        ranges = ranges_of(layer_counts([sum(p.numel() for p in layer.parameters()) for layer in model], pp))
    if tp > 1 and pp > 1:
        _check_pairs_within_stages(model, ranges)


def _check_pairs_within_stages(model: nn.Sequential, ranges: list[tuple[int, int]]) -> None:
    """A column layer's output is split over the tp ranks until its row layer: no stage boundary may fall between."""
    names = [name for name, _ in model.named_children()]
    stage_of = {names[i]: s for s, (a, b) in enumerate(ranges) for i in range(a, b)}
    for column, row in tp_pairs(model):
        if stage_of[column.split(".")[0]] != stage_of[row.split(".")[0]]:
            raise DistUsageError(f"the stage boundaries {list(ranges)} cut the tensor-parallel pair ({column}, "
                                 f"{row}) between two stages: give boundaries that keep each pair in one stage")


def _check_tp(model: nn.Sequential, tp: int) -> None:
    config = getattr(model, "config", None)
    for what in ("heads", "hidden"):
        value = getattr(config, what, None)
        if value is not None and value % tp:
            raise DistUsageError(f"tp={tp} does not divide the model's {value} {what}: each tensor-parallel rank "
                                 f"takes {what} / tp of them")
    for column, row in tp_pairs(model, tp):
        inner = model.get_submodule(column).out_features
        if inner % tp:
            raise DistUsageError(f"tp={tp} does not divide the {inner} features between {column} and {row}, the "
                                 f"Linear pair tensor parallel splits")


def micro_batch_size(batch: int, dp: int, microbatches: int) -> int:
    """Samples in one micro-batch on one replica; refused unless the batch splits evenly."""
    if batch % dp:
        raise DistUsageError(f"a batch of {batch} does not split into dp={dp} equal shares")
    if (batch // dp) % microbatches:
        raise DistUsageError(f"each replica's {batch // dp} samples do not split into {microbatches} equal "
                             f"micro-batches")
    return batch // dp // microbatches


def _zero(zero: int) -> int:
    if not is_whole(zero) or zero not in ZERO_STAGES:
        raise DistUsageError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero!r}")
    return zero


def _checked_ranges(boundaries: Sequence[tuple[int, int]], layers: int, stages: int) -> list[tuple[int, int]]:
    ranges = [tuple(r) for r in boundaries]
    joined = all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    if len(ranges) != stages or not joined or ranges[0][0] != 0 or ranges[-1][1] != layers:
        raise DistUsageError(f"stage boundaries {ranges} must be {stages} non-empty (first, end) layer ranges "
                             f"that follow each other from 0 to {layers}")
    return ranges


def _layout(layers: Sequence[LayerProfile], pp: int, boundaries, microbatches: int,
            schedule: str | Schedule) -> tuple[Schedule, list[tuple[int, int]]]:
    """The schedule (built, or checked against pp and microbatches) and each stage's layer range (given, or
    balanced by parameters as nbdist.pipeline balances them)."""
    if isinstance(schedule, Schedule):
        if (schedule.ranks, schedule.microbatches) != (pp, microbatches):
            raise DistUsageError(f"the schedule has {schedule.ranks} ranks and {schedule.microbatches} "
                                 f"micro-batches, but the plan has pp={pp} and microbatches={microbatches}")
    else:
        schedule = build(schedule, pp, microbatches)
    if boundaries is None:
        return schedule, ranges_of(layer_counts([layer.params for layer in layers], schedule.stages))
    return schedule, _checked_ranges(boundaries, len(layers), schedule.stages)


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by kind (what nbdist.cluster.ranks.memory.state_bytes and ActivationMeter
    measure on a rank)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.params + self.grads + self.optimizer + self.activations)

    def __str__(self) -> str:
        return ", ".join(f"{k} {format_bytes(getattr(self, k))}"
                         for k in ("params", "grads", "optimizer", "activations", "total"))


def predict_memory(layers: Sequence[LayerProfile], *, dp: int, pp: int, tp: int, zero: int,
                   boundaries: Sequence[tuple[int, int]] | None, microbatches: int, schedule: str | Schedule,
                   batch: int, optimizer: str = "adam", param_bytes: int = 4) -> list[RankMemory]:
    """Per pipeline rank (the ranks of one stage hold the same), the bytes each rank holds at its peak.

    params: its stages' parameters, the split ones / tp. ZeRO-0/1: whole. ZeRO-3 (FSDP2 per top-level layer,
    resharded after forward): FSDP2's padded shards of every parameter, plus the largest layer gathered, in its
    all-gather buffers of dp padded shards (one layer at a time; FSDP2's backward prefetch can briefly hold two:
    not counted). ZeRO-2 (reshard_after_forward=False): the shards plus every layer gathered, held from its
    forward to its backward.
    grads: the parameters' size; ZeRO-2/3 the shards.
    optimizer: states per parameter element (adam 2, sgd-momentum 1, sgd 0; Adam's scalar step not counted).
    ZeRO-1: the largest share of ZeroRedundancyOptimizer's greedy partition; ZeRO-2/3: the padded shards (Adam's
    states take a rank's own rows, so the last rank may hold a little less: this is the largest rank's).
    activations: bytes saved for backward per sample x micro-batch size x the most micro-batches the schedule
    keeps in flight on that rank (pp=1: one, gradient accumulation); the last stage also holds what the loss saves.
    """
    _zero(zero)
    if optimizer not in OPTIMIZER_STATES:
        raise DistUsageError(f"unknown optimizer {optimizer!r}: choose {', '.join(OPTIMIZER_STATES)}")
    schedule, ranges = _layout(layers, pp, boundaries, microbatches, schedule)
    size = micro_batch_size(batch, dp, microbatches)
    peaks = {0: 1} if pp == 1 else schedule.simulate().peak_activations
    return [
        _rank_memory([list(layers[a:b]) for a, b in (ranges[s] for s in schedule.stages_of(rank))], peaks[rank],
                     size, dp, tp, zero, OPTIMIZER_STATES[optimizer], param_bytes, layers[-1])
        for rank in range(schedule.ranks)
    ]


def _rank_memory(stages: list[list[LayerProfile]], peak: int, size: int, dp: int, tp: int, zero: int,
                 states: int, param_bytes: int, last: LayerProfile) -> RankMemory:
    tensors = [t for stage in stages for layer in stage for t in layer.tensors]
    whole = sum(t.numel(tp) for t in tensors)
    shards = sum(t.shard_numel(tp, dp) for t in tensors)
    # a gathered layer lives in FSDP2's all-gather buffers: dp padded shards per parameter
    per_layer = [sum(t.shard_numel(tp, dp) * dp for t in layer.tensors) for stage in stages for layer in stage]
    if zero <= 1:
        params = grads = whole
    else:
        params, grads = shards + (sum(per_layer) if zero == 2 else max(per_layer, default=0)), shards
    state = {0: whole, 1: max(zero1_shares(tensors, dp, tp)), 2: shards, 3: shards}[zero]
    # with several chunks per rank, the schedule counts one chunk's activation: the largest chunk's is taken
    saved = max(_stage_saved_bytes(stage, tp, last) for stage in stages)
    return RankMemory(params * param_bytes, grads * param_bytes, states * state * param_bytes,
                      round(saved * size * peak))


def _stage_saved_bytes(stage: list[LayerProfile], tp: int, last: LayerProfile) -> float:
    """Bytes per sample a stage saves for backward: its layers', its received input again, and on the last stage
    what the loss saves: one output's size (cross-entropy keeps its log-softmax, MSE its input; a target the loss
    also keeps is not counted)."""
    loss = last.output_bytes_per_sample if stage[-1] is last else 0.0
    return sum(layer.saved_bytes(tp) for layer in stage) + stage[0].input_saved_bytes(tp) + loss


def zero1_shares(tensors: Sequence[ParamShape], dp: int, tp: int = 1) -> list[int]:
    """Parameter elements each of dp ranks owns under torch's ZeroRedundancyOptimizer: parameters largest first,
    each to the rank with the fewest so far (ties to the lowest rank). Sizes are full sizes (a DTensor's numel is
    global), the elements held the tp-local ones."""
    sizes, held = [0] * dp, [0] * dp
    for t in sorted(tensors, key=lambda t: t.numel(), reverse=True):
        rank = sizes.index(min(sizes))
        sizes[rank] += t.numel()
        held[rank] += t.numel(tp)
    return held


def zero_paper_bytes(psi: float, n: int, stage: int, k: float = 12) -> float:
    """Bytes per device in the ZeRO paper (Rajbhandari et al., arXiv 1910.02054, fig. 1): mixed-precision Adam,
    fp16 parameters and gradients (2Ψ each) and K·Ψ of optimizer state (fp32 master weights, momentum, variance:
    K = 12), over N data-parallel devices. Baseline (2+2+K)Ψ, ZeRO-1 4Ψ + KΨ/N, ZeRO-2 2Ψ + (2+K)Ψ/N, ZeRO-3
    (2+2+K)Ψ/N."""
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (4 + k) * psi / n}[_zero(stage)]


def fp32_zero_bytes(psi: float, n: int, stage: int) -> float:
    """Bytes per device our fp32 engines hold with Adam: parameters 4Ψ, gradients 4Ψ, Adam's two states 8Ψ.

    Baseline 16Ψ; ZeRO-1 (ZeroRedundancyOptimizer) 8Ψ + 8Ψ/N; ZeRO-3 (FSDP2) 16Ψ/N, plus one layer unsharded.
    ZeRO-2 is FSDP2 with reshard_after_forward=False, and there it differs from the paper: the paper keeps one
    replica of the parameters and shards the rest, 4Ψ + 12Ψ/N in fp32; FSDP2 keeps its sharded copy (4Ψ/N)
    separately from the unsharded parameters it holds from forward to backward (4Ψ), so 4Ψ + 16Ψ/N.
    """
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 16 * psi / n, 3: 16 * psi / n}[_zero(stage)]


# ---------------------------------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------------------------------


def default_alpha_beta() -> "AlphaBeta":
    """One message costs 10.3 us + S x 4.26e-10 s (2.35 GB/s): a 2-rank all-reduce measured on this machine.

    Measured with `nbdist.collectives.benchmark(ops="all_reduce", via="torch", sizes=2**10..2**24 by 4x)` on
    `nbdist.Cluster(ClusterOptions(n=2, backend="mpi"))` (2 CPU cores, MPICH shared memory) and fit_alpha_beta:
    the whole all-reduce took alpha 20.6 us, beta 4.26e-10 s/byte (load average 1; a second run at load 3.4:
    28.6 us, 4.29e-10). The ring model charges a 2-rank all-reduce 2 alpha + S beta, hence 10.3 us per message. A
    plain message is cheaper per byte (a 2-rank broadcast fitted 6-14 us, 5-9 GB/s: no additions), so pipeline
    messages are priced high. The plan passes a fit measured on its own cluster instead.
    """
    from nbdist.collectives.costmodel import AlphaBeta

    return AlphaBeta(alpha=10.3e-6, beta=4.26e-10, op="all_reduce", via="torch", ranks=2)


@dataclass(frozen=True)
class Overheads:
    """What the libraries cost beyond a layer's own compute and the bytes they move, measured on the engines by
    micro-benchmarks (nbdist/sharding/ranks/sharded.py, mechanism_costs), seconds per micro-batch:
    `tp_linear`: (forward, backward) per tensor-parallel Linear (DTensor's dispatch and redistribution);
    `fsdp_unit`: (forward, backward) per FSDP2 unit (its hooks, gathers and scatters of small shards);
    `optimizer_per_param`: the optimizer's step per parameter element (the profile's optimizer kind);
    `optimizer_per_dtensor`: its extra step time per parameter tensor that is a DTensor (FSDP2 shards, split
    Linears), DTensor's dispatch of every update op."""

    tp_linear: tuple[float, float] = (0.0, 0.0)
    fsdp_unit: tuple[float, float] = (0.0, 0.0)
    optimizer_per_param: float = 0.0
    optimizer_per_dtensor: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """A predicted step, every term in seconds. Per stage and micro-batch: compute (`forward_s`, `backward_s`,
    the split part / tp) and tensor-parallel all-reduces (`tp_forward_s`, `tp_backward_s`); `pp_message_s`, one
    activation (or gradient) message between stages; `pipeline`, the schedule simulated with those (makespan,
    bubble); `dp_sync_s`, per stage the data-parallel collectives of a step. Collectives are not overlapped with
    compute (DDP and FSDP2 overlap some): `total_s` is an upper bound on the step's communication."""

    forward_s: list[float]
    backward_s: list[float]
    tp_forward_s: list[float]
    tp_backward_s: list[float]
    pp_message_s: float
    dp_sync_s: list[float]
    pipeline: "Timeline"
    alpha_beta: "AlphaBeta"
    optimizer_s: list[float] = field(default_factory=list)  # per stage: the optimizer's step on a rank's share
    overheads: Overheads = Overheads()
    library_forward_s: list[float] = field(default_factory=list)  # per stage and micro-batch: DTensor, FSDP2
    library_backward_s: list[float] = field(default_factory=list)

    @property
    def makespan_s(self) -> float:
        return self.pipeline.makespan

    @property
    def bubble_fraction(self) -> float:
        return self.pipeline.bubble_fraction

    @property
    def total_s(self) -> float:
        return self.makespan_s + max(self.dp_sync_s) + max(self.optimizer_s, default=0.0)


def predict_step_seconds(layers: Sequence[LayerProfile], *, dp: int, pp: int, tp: int, zero: int,
                         boundaries: Sequence[tuple[int, int]] | None, microbatches: int, schedule: str | Schedule,
                         batch: int, alpha_beta: "AlphaBeta | None" = None, param_bytes: int = 4,
                         overheads: Overheads | None = None) -> StepTime:
    """The step's time from timed profiles (with_times), the schedule simulator and the alpha-beta model.

    Compute: each layer's seconds per sample x micro-batch size, its split part / tp, the split part taken as its
    share of split parameters (a Linear's work is 2 x parameters per token). Tensor parallel: per row-parallel
    Linear one all-reduce of its output in forward and one of its pair's input gradient in backward (2 + 2 per GPT
    block, 1 + 1 per MLP pair), ring-priced, inside the stage's F and B. Pipeline: the largest stage output
    per micro-batch as one message. Data parallel (ring-priced over dp), per step: ZeRO-0 an all-reduce of the
    gradients; ZeRO-1 that plus ZeroRedundancyOptimizer's broadcast of updated partitions (an all-gather, half a
    ring); FSDP2 gathers each layer in every micro-batch's forward (ZeRO-3: again in its backward) and
    reduce-scatters its gradients in every backward (its defaults: resharded after backward, gradients synced
    each micro-batch). `overheads` (measured on the engines): per tensor-parallel Linear and per FSDP2 unit, added
    to each micro-batch's forward and backward; the optimizer's step on each rank's share of the parameters.
    """
    _zero(zero)
    ab = alpha_beta or default_alpha_beta()
    extra = overheads or Overheads()
    schedule, ranges = _layout(layers, pp, boundaries, microbatches, schedule)
    size = micro_batch_size(batch, dp, microbatches)
    stages = [list(layers[a:b]) for a, b in ranges]
    if any(layer.forward_s is None or layer.backward_s is None for layer in layers):
        raise DistUsageError("the profile has no layer times yet: with_times(layers, time_layers(model, batch))")
    forward = [sum(layer.forward_s * _tp_share(layer, tp) * size for layer in stage) for stage in stages]
    backward = [sum(layer.backward_s * _tp_share(layer, tp) * size for layer in stage) for stage in stages]
    tp_f = [_tp_allreduces(stage, 0, size, tp, ab) for stage in stages]
    tp_b = [_tp_allreduces(stage, 1, size, tp, ab) for stage in stages]
    lib_f = [_library(stage, tp, zero, extra, 0) for stage in stages]
    lib_b = [_library(stage, tp, zero, extra, 1) for stage in stages]
    message = max((ab.predict(stage[-1].output_bytes_per_sample * size) for stage in stages[:-1]), default=0.0)
    v = schedule.chunks  # the simulator divides a rank's time by its chunks; these times are per stage already
    timeline = schedule.simulate(forward=[(f + t + o) * v for f, t, o in zip(forward, tp_f, lib_f)],
                                 backward=[(b + t + o) * v for b, t, o in zip(backward, tp_b, lib_b)], comm=message)
    timeline.name, timeline.unit = f"{schedule.name} (predicted)", "s"
    sync = [_dp_sync([sum(p.numel(tp) for p in layer.tensors) * param_bytes for layer in stage], dp, zero,
                     microbatches, ab) for stage in stages]
    shards = dp if zero >= 1 else 1
    optimizer = [extra.optimizer_per_param * sum(p.numel(tp) for layer in stage for p in layer.tensors) / shards
                 + extra.optimizer_per_dtensor * _dtensors(stage, tp, zero) for stage in stages]
    return StepTime(forward, backward, tp_f, tp_b, message, sync, timeline, ab, optimizer, extra, lib_f, lib_b)


def _library(stage: list[LayerProfile], tp: int, zero: int, extra: Overheads, direction: int) -> float:
    """The libraries' own time in one micro-batch's forward (0) or backward (1) of a stage: DTensor's per split
    Linear (each has one tensor-parallel all-reduce entry), FSDP2's per unit (a layer with parameters)."""
    linears = sum(len(layer.tp_allreduce_bytes_per_sample) for layer in stage) if tp > 1 else 0
    units = sum(1 for layer in stage if layer.params) if zero >= 2 else 0
    return linears * extra.tp_linear[direction] + units * extra.fsdp_unit[direction]


def _dtensors(stage: list[LayerProfile], tp: int, zero: int) -> int:
    """A stage's parameter tensors that are DTensors on a rank: all of them under FSDP2 (ZeRO-2/3), the split ones
    under tensor parallelism."""
    if zero >= 2:
        return sum(len(layer.tensors) for layer in stage)
    return sum(p.tp_dim is not None for layer in stage for p in layer.tensors) if tp > 1 else 0


def _tp_share(layer: LayerProfile, tp: int) -> float:
    """The part of a layer's compute one of tp ranks does: its split parameters' share is divided."""
    return 1 - layer.tp_params / layer.params * (1 - 1 / tp) if layer.params else 1.0


def _tp_allreduces(stage: list[LayerProfile], direction: int, size: int, tp: int, ab: "AlphaBeta") -> float:
    if tp == 1:
        return 0.0
    return sum(ab.ring(entry[direction] * size, tp) for layer in stage for entry in layer.tp_allreduce_bytes_per_sample
               if entry[direction])


def _dp_sync(layer_bytes: list[float], dp: int, zero: int, microbatches: int, ab: "AlphaBeta") -> float:
    if dp == 1:
        return 0.0
    if zero <= 1:
        ring = ab.ring(sum(layer_bytes), dp)
        return ring * (1.5 if zero == 1 else 1.0)
    gathers = 1 if zero == 2 else 2  # a reduce-scatter or an all-gather costs half a ring all-reduce
    return microbatches * sum(ab.ring(b, dp) / 2 * (1 + gathers) for b in layer_bytes if b)  # layers with weights

"""DDP communication hooks (this code runs ON the engines): all-reduce through MPI on CPU, and gradient compression.

DDP hands each bucket of gradients (one flat tensor) to a hook, which must return a future of the bucket's
averaged gradient. nbdist's engines already form an MPI world, and MPICH's shared-memory all-reduce beats gloo's
TCP loopback for the bucket sizes DDP uses (1-25 MB; figures: benchmarks/README.md), so on CPU the hook can skip
gloo entirely:
`mpi_allreduce_hook` sums the bucket's own memory in place (a numpy view, `MPI.IN_PLACE`, no copy).

Any process group works, not only the whole world: DDP over a mesh's dp dimension averages within each replica
group. The MPI hooks then talk on an MPI communicator of the same ranks in the same order (torch rank = MPI rank on
nbdist's engines), made once per group and kept in the engine registry, or the mesh's own communicator of that
dimension (nbdist/cluster/meshes/ranks/groups.py). Making it is collective over the group's members: exactly the ranks that
build the DDP model and call `register_hook` (building DDP is collective over them too).

Compression hooks trade accuracy for bytes: fp16 / bf16 (torch's own hooks on DDP's process group), top-k with
error feedback (over MPI) and PowerSGD (torch's). Every hook records what this rank sends per step in its state,
so a notebook can plot bytes sent against final loss; `register_hook(ddp_model, name)` builds the state and
registers the hook.

"Bytes sent" is the payload this rank hands to the collective each step (the all-reduced or all-gathered tensors),
not the traffic on the wire: that depends on the algorithm (a ring all-reduce moves 2(p-1)/p of the payload per
rank), while the payload is what compression changes.

The MPI calls block. Unlike the pipeline's point-to-point messages (which poll, so that an interrupt can stop a
rank and cancel them), a collective cannot be cancelled: a rank interrupted inside one would leave it half-done and
its next collective would pair with it. Blocking is also the fastest (polling with pauses added to the latency of
MiB-sized all-reduces on busy cores); a rank stuck here is freed the way one stuck in gloo is: nbdist restarts
the engines.

No `from __future__ import annotations` here: DDP inspects a hook's annotations and wants the real objects.
"""
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from nbdist.checks import known_options, whole_number
from nbdist.cluster.meshes.ranks import groups
from nbdist.errors import DistUsageError
from nbdist.runtime.ranks.devices import backend_for

Future = torch.futures.Future


# -- bookkeeping --------------------------------------------------------------------------------------------------


@dataclass
class HookState:
    """What a hook keeps between steps: the bytes this rank sends, per step, against the uncompressed bytes.

    A step ends with DDP's last bucket (`bucket.is_last()`); `bytes_per_step[i]` is what step i sent,
    `full_bytes_per_step[i]` what a plain all-reduce of the same buckets would have sent, and `buckets_per_step[i]`
    how many buckets the hook was handed (one all-reduce each for the plain hooks). A backward run under DDP's
    `no_sync()` hands over none, so it is no step here. `bucket_bytes` lists the uncompressed size of each bucket of
    the last finished step, in the order DDP handed them over.
    """

    name: str = "mpi"
    process_group: Any = None  # torch.distributed group for the hooks that run on torch (None: the world)
    comm: Any = None  # the MPI communicator of the same ranks, for the MPI hooks (None: MPI.COMM_WORLD)
    bytes_per_step: list = field(default_factory=list)
    full_bytes_per_step: list = field(default_factory=list)
    buckets_per_step: list = field(default_factory=list)
    bucket_bytes: list = field(default_factory=list)
    _step_bytes: int = 0
    _step_buckets: list = field(default_factory=list)

    def record(self, bucket: dist.GradBucket, sent: int) -> None:
        buffer = bucket.buffer()
        self._step_bytes += sent
        self._step_buckets.append(buffer.numel() * buffer.element_size())
        if bucket.is_last():
            self.bytes_per_step.append(self._step_bytes)
            self.full_bytes_per_step.append(sum(self._step_buckets))
            self.buckets_per_step.append(len(self._step_buckets))
            self.bucket_bytes, self._step_buckets, self._step_bytes = self._step_buckets, [], 0

    @property
    def bytes_sent(self) -> int:
        """All steps so far."""
        return sum(self.bytes_per_step)

    @property
    def compression(self) -> float:
        """Uncompressed bytes / bytes sent, over all steps so far (1.0 for a plain all-reduce)."""
        return sum(self.full_bytes_per_step) / self.bytes_sent if self.bytes_sent else float("nan")


def _comm(state: Any):
    """The MPI communicator a hook averages over: its state's, or the whole MPI world (state None or unset)."""
    comm = getattr(state, "comm", None)
    if comm is not None:
        return comm
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _check_cpu(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type != "cpu":
        raise DistUsageError(
            f"{what} moves CPU tensors only (MPI reads their memory), got a tensor on {tensor.device}: "
            "use hook='torch' (DDP's default all-reduce: gloo on CPU, nccl on GPUs) or a torch-based compression hook"
        )


def _as_numpy(tensor: torch.Tensor):
    try:
        return tensor.detach().numpy()
    except TypeError:  # bfloat16 has no numpy (nor MPI) type
        raise DistUsageError(f"MPI hooks need a numpy dtype, got {tensor.dtype}: use hook='torch' or 'bf16'") from None


def _done(tensor: torch.Tensor) -> Future:
    fut: Future = Future()
    fut.set_result(tensor)
    return fut


# -- all-reduce -----------------------------------------------------------------------------------------------------


def mpi_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in place over the state's MPI communicator (DDP's process group's ranks; MPI.COMM_WORLD
    when `state` is None); a completed future of the bucket's buffer.

    Divides before summing, as DDP's own all-reduce does (with 2 ranks the result is then bit-identical to gloo's;
    with more, only the order of the sum differs). `state` may be None (nothing recorded) or a HookState.
    The all-reduce is finished when the hook returns, so DDP overlaps nothing with it. gloo's runs in the background
    while the backward pass goes on, but on CPU engines both compete for the same core: a step with gloo costs its
    all-reduces in full anyway, and MPI's are shorter (see register_hook; figures: benchmarks/README.md).
    """
    buffer = bucket.buffer()
    _check_cpu(buffer, "the MPI all-reduce hook")
    from mpi4py import MPI

    comm = _comm(state)
    array = _as_numpy(buffer)  # the bucket's own memory
    buffer.div_(comm.size)
    comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)  # blocking: see the module docstring
    if state is not None:
        state.record(bucket, buffer.numel() * buffer.element_size())
    return _done(buffer)


def torch_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `allreduce_hook` (what DDP does with no hook: average over its process group, through whichever
    backend serves the bucket's device: gloo for CPU tensors, nccl for CUDA tensors), counted."""
    buffer = bucket.buffer()
    state.record(bucket, buffer.numel() * buffer.element_size())
    return default_hooks.allreduce_hook(state.process_group, bucket)


def fp16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `fp16_compress_hook`: all-reduce the bucket cast to float16 (half the bytes of float32)."""
    state.record(bucket, bucket.buffer().numel() * 2)
    return default_hooks.fp16_compress_hook(state.process_group, bucket)


def bf16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook`. DDP refuses that hook *by name* without NCCL >= 2.10, but gloo all-reduces
    bfloat16 on CPU, so this wrapper (another name) is accepted there."""
    state.record(bucket, bucket.buffer().numel() * 2)
    return default_hooks.bf16_compress_hook(state.process_group, bucket)


# -- top-k with error feedback ---------------------------------------------------------------------------------------


@dataclass
class TopKState(HookState):
    """Top-k sparsification with error feedback.

    Each step a rank adds its residual (what it did not send so far) to the bucket's gradient, sends the k
    largest-magnitude entries (k = ceil(ratio * bucket size); int32 indices + values, all-gathered over MPI) and
    keeps the rest as the new residual. Residuals are kept per bucket index; when DDP regroups its buckets (it
    does once, after the first step) they are carried over parameter by parameter.
    """

    name: str = "topk"
    ratio: float = 0.01
    residuals: dict = field(default_factory=dict)  # bucket index -> flat residual
    layouts: dict = field(default_factory=dict)  # bucket index -> ((id(param), numel), ...) of that residual
    _by_param: dict = field(default_factory=dict)  # id(param) -> residual, between a regrouping and its use

    def exchange(self, indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather every rank's indices and values (the same k on every rank) over the group's MPI communicator;
        rows in group rank order."""
        comm = _comm(self)
        all_indices = indices.new_empty((comm.size, indices.numel()))
        all_values = values.new_empty((comm.size, values.numel()))
        comm.Allgather(indices.numpy(), all_indices.numpy())
        comm.Allgather(values.numpy(), all_values.numpy())
        return all_indices, all_values

    def residual_for(self, bucket: dist.GradBucket) -> torch.Tensor:
        index, layout = bucket.index(), _layout(bucket)
        if index in self.residuals and self.layouts[index] == layout:
            return self.residuals[index]
        self._spill()
        parts = [self._by_param.pop(key, None) for key, _ in layout]
        buffer = bucket.buffer()
        return torch.cat([p if p is not None else buffer.new_zeros(n) for p, (_, n) in zip(parts, layout)])

    def keep(self, bucket: dist.GradBucket, residual: torch.Tensor) -> None:
        self.residuals[bucket.index()] = residual
        self.layouts[bucket.index()] = _layout(bucket)

    def _spill(self) -> None:
        """The buckets were regrouped: split every kept residual into its parameters' pieces."""
        for index, residual in self.residuals.items():
            self._by_param.update(zip((key for key, _ in self.layouts[index]), _split(residual, self.layouts[index])))
        self.residuals.clear()
        self.layouts.clear()

    def residual_by_parameter(self) -> dict:
        """id(parameter) -> its current residual (flat), for inspection and tests."""
        out = dict(self._by_param)
        for index, residual in self.residuals.items():
            out.update(zip((key for key, _ in self.layouts[index]), _split(residual, self.layouts[index])))
        return out


def _layout(bucket: dist.GradBucket) -> tuple:
    layout = tuple((id(p), p.numel()) for p in bucket.parameters())
    if sum(n for _, n in layout) != bucket.buffer().numel():
        raise RuntimeError("a DDP bucket's buffer is not its parameters laid end to end; top-k cannot map it")
    return layout


def _split(flat: torch.Tensor, layout: tuple) -> list[torch.Tensor]:
    return list(flat.split([n for _, n in layout]))


def topk_compress(corrected: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k largest-magnitude entries of `corrected` (int32 indices, values) and what is left (the residual)."""
    indices = corrected.abs().topk(k, sorted=False).indices
    values = corrected[indices]
    residual = corrected.clone()
    residual[indices] = 0
    return indices.to(torch.int32), values, residual


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the k largest entries of gradient + residual; the bucket becomes the mean of what all ranks sent."""
    buffer = bucket.buffer()
    _check_cpu(buffer, "the top-k hook")
    k = max(1, math.ceil(state.ratio * buffer.numel()))
    indices, values, residual = topk_compress(buffer + state.residual_for(bucket), k)
    state.keep(bucket, residual)
    all_indices, all_values = state.exchange(indices, values)
    buffer.zero_()
    buffer.index_add_(0, all_indices.flatten().long(), all_values.flatten())
    buffer.div_(all_indices.shape[0])
    state.record(bucket, indices.numel() * indices.element_size() + values.numel() * values.element_size())
    return _done(buffer)


# -- PowerSGD -----------------------------------------------------------------------------------------------------


@dataclass
class PowerSGDHookState(HookState):
    """torch's PowerSGDState plus the byte count. torch sends plain all-reduces for `start_powerSGD_iter` steps
    (DDP regroups its buckets after the first, and error feedback needs stable buckets), then per bucket the
    low-rank factors P (n x r) and Q (m x r) of every matrix worth compressing and the other tensors as they are."""

    name: str = "powersgd"
    powersgd: Any = None  # powerSGD_hook.PowerSGDState


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `powerSGD_hook`; the elements it sends are read from its own compression statistics."""
    inner = state.powersgd
    compressing = inner.iter >= inner.start_powerSGD_iter
    before = inner.total_numel_after_compression
    fut = powerSGD_hook.powerSGD_hook(inner, bucket)
    buffer = bucket.buffer()
    numel = inner.total_numel_after_compression - before if compressing else buffer.numel()
    state.record(bucket, numel * buffer.element_size())
    return fut


# -- registration ---------------------------------------------------------------------------------------------------


def _plain_state(name: str, group: Any) -> HookState:
    return HookState(name=name, process_group=group)


def _topk_state(group: Any, ratio: float = 0.01) -> TopKState:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise DistUsageError(f"top-k ratio must be in (0, 1], got {ratio!r}")
    return TopKState(process_group=group, ratio=float(ratio))


def _powersgd_state(group: Any, rank: int = 1, start_iter: int = 2) -> PowerSGDHookState:
    whole_number(rank, "PowerSGD rank")
    whole_number(start_iter, "PowerSGD start_iter (error feedback needs stable buckets)", minimum=2)
    inner = powerSGD_hook.PowerSGDState(
        process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
    )
    return PowerSGDHookState(process_group=group, powersgd=inner)


HOOKS: dict[str, tuple[Callable, Callable]] = {  # name -> (state factory(group, **options), hook)
    "mpi": (lambda group: _plain_state("mpi", group), mpi_allreduce_hook),
    "torch": (lambda group: _plain_state("torch", group), torch_allreduce_hook),
    "fp16": (lambda group: _plain_state("fp16", group), fp16_hook),
    "bf16": (lambda group: _plain_state("bf16", group), bf16_hook),
    "topk": (_topk_state, topk_hook),
    "powersgd": (_powersgd_state, powersgd_hook),
}
OPTIONS = {"mpi": (), "torch": (), "fp16": (), "bf16": (), "topk": ("ratio",), "powersgd": ("rank", "start_iter")}


RENAMED = {"gloo": "torch"}  # old name -> name: "gloo" ran nccl on GPUs, so it is named for what it calls


def _current_name(name: str) -> str:
    """A hook's name, old names translated with one line saying so."""
    if name in RENAMED:
        warnings.warn(f"hook {name!r} is now called {RENAMED[name]!r} (torch.distributed's all-reduce: gloo on CPU, "
                      f"nccl on GPUs); {name!r} will go", FutureWarning, stacklevel=3)
    return RENAMED.get(name, name)


def _on_cpu(ddp_model: DistributedDataParallel) -> bool:
    return all(p.device.type == "cpu" for p in ddp_model.parameters())


def _mpi_mirrors_torch() -> bool:
    """Whether MPI's world is torch.distributed's, rank for rank (so a torch group's ranks name MPI ranks): true on
    nbdist's engines, which initialise torch.distributed with rank = MPI rank."""
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    world = MPI.COMM_WORLD
    return (world.rank, world.size) == (dist.get_rank(), dist.get_world_size())


def _check_mpi_usable(ddp_model: DistributedDataParallel, name: str) -> None:
    if not _on_cpu(ddp_model):
        raise DistUsageError(f"hook {name!r} moves CPU tensors only (MPI reads their memory); the model is not on CPU")
    if not _mpi_mirrors_torch():
        raise DistUsageError(f"hook {name!r} talks over MPI, but this rank's MPI world is not torch.distributed's "
                             f"(torch rank {dist.get_rank()} of {dist.get_world_size()}): use hook='torch'")


def choose(ddp_model: DistributedDataParallel) -> str:
    """What name="auto" picks: "mpi" for CPU models on a gloo process group when MPI's world is torch's, else
    "torch" (DDP's own all-reduce: on the mpi4py backend, the CPU default, that already goes through MPI, and
    measured no slower than the hook; see register_hook)."""
    if not (_on_cpu(ddp_model) and _mpi_mirrors_torch()):
        return "torch"
    return "mpi" if backend_for(dist.get_backend(ddp_model.process_group), "cpu") == "gloo" else "torch"


def _check_one_bucket(ddp_model: DistributedDataParallel) -> None:
    """torch's PowerSGD hook fails on gloo as soon as DDP has more than one gradient bucket: at the first compressed
    step the ranks' all-reduces of different buckets get out of step, and the job hangs or gloo aborts it ("Received
    data size doesn't match expected size ... collective mismatch"). An observation made here (torch 2.13, torch's
    own hook registered directly on DDP, no nbdist in between, 2 CPU ranks, both outcomes seen); no upstream report
    was found. The same holds on nbdist's mpi4py backend, for the same reason: PowerSGD issues its second
    all-reduce from the first one's callback, and two buckets' callbacks may issue theirs in different orders on
    different ranks (NCCL is spared by its stream order). Refuse that rather than let it happen."""
    device_type = next(ddp_model.module.parameters()).device.type
    backend = backend_for(dist.get_backend(ddp_model.process_group), device_type)
    if backend not in ("gloo", "mpi4py"):
        return  # on GPU engines the gradients go through nccl, even though the group's backend string names gloo
    nbytes = sum(p.numel() * p.element_size() for p in ddp_model.module.parameters() if p.requires_grad)
    config = getattr(ddp_model, "_bucket_config", None)  # DDP's first bucket may be smaller than the others
    first = getattr(config, "first_bucket_bytes_cap", None) or ddp_model.bucket_bytes_cap
    caps = [first, ddp_model.bucket_bytes_cap, *(getattr(ddp_model, "bucket_bytes_cap_list", None) or [])]
    if nbytes > min(caps):
        need = math.ceil(nbytes / 2**20) + 1
        raise DistUsageError(
            f"PowerSGD on {backend} fails (hangs or aborts) with more than one gradient bucket (seen with torch 2.13): "
            f"build DDP with "
            f"bucket_cap_mb >= {need} so that all {nbytes / 2**20:.1f} MiB of gradients make one bucket "
            f"(nbdist.data_parallel.ranks.ddp.ddp(..., hook='powersgd') does this)"
        )


def register_hook(ddp_model: DistributedDataParallel, name: str = "auto", **options: Any) -> HookState:
    """Register communication hook `name` on a DDP model; returns its state (bytes sent per step, residuals...).

    Names: "mpi" (all-reduce through MPI, CPU), "torch" (torch.distributed's all-reduce on DDP's process group,
    DDP's default, counted: gloo on CPU, nccl on GPUs; "gloo", its old name, still works and says so), "fp16",
    "bf16", "topk" (option ratio, default 0.01), "powersgd" (options rank, default 1, and start_iter, default 2:
    plain all-reduce before it) and "auto".

    "auto" = "torch" on the mpi4py backend (CPU engines' default: DDP's own all-reduce then goes through MPI, and
    benchmarks/bench_mpi_backend_training.py finds the MPI hook no faster there); "mpi" on CPU over a gloo process
    group when MPI's world is torch's (always so on nbdist's engines; the MPI hooks talk on a communicator of the
    group's ranks); else "torch".
    Why "auto" is MPI on CPU over gloo (benchmarks/bench_dp_hook.py; figures: benchmarks/README.md): the MPI hook
    blocks the backward pass while it all-reduces, and gloo's all-reduce runs in the background, yet on CPU engines
    that overlap buys nothing (compute and transfer share the core: a gloo step costs its all-reduces in full)
    while MPI's all-reduce is shorter per bucket, so the MPI hook trains faster. Caveat: when other jobs load the
    cores beyond one process per core, MPI's shared-memory transfers (which need both ranks running at once)
    degrade more than gloo's sockets, and the MPI hook can then fall behind gloo.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise DistUsageError(f"register_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if name == "auto":
        name = choose(ddp_model)
    name = _current_name(name)
    if name not in HOOKS:
        raise DistUsageError(f"unknown hook {name!r}: choose one of auto, {', '.join(HOOKS)}")
    known_options(options, OPTIONS[name], f"hook {name!r}")
    if name in ("mpi", "topk"):
        _check_mpi_usable(ddp_model, name)
    if name == "powersgd":
        _check_one_bucket(ddp_model)
    make_state, hook = HOOKS[name]
    state = make_state(ddp_model.process_group, **options)
    if name in ("mpi", "topk"):
        state.comm = groups.mpi_comm(groups.group_ranks(ddp_model.process_group))
    ddp_model.register_comm_hook(state, hook)
    return state

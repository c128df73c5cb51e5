"""Which device and which process-group backend an engine uses (pure rules: the GPU count is passed in).

Why pure: the rules must hold on GPU machines the tests never see, so they take every count as an argument and the
tests try any counts on CPU. boot.py measures the counts on the engine and applies the result.

The rules:
- `--cpu`, `--backend gloo` or `--backend mpi` means CPU engines: no CUDA device is bound. CPU engines use `mpi`
  unless gloo is asked for by name: nbdist's own torch.distributed backend over mpi4py (backend/ranks/mpi_backend.py,
  registered as "mpi4py": torch keeps "mpi" for its source-build ProcessGroupMPI), whose small collectives cost
  microseconds where gloo's loopback TCP costs a millisecond. gloo's CUDA support is broadcast and
  all_reduce only, so gloo ranks on a GPU would fail at the pipeline's point-to-point messages and at `trace()`.
- A GPU engine binds `cuda:<local rank>`: NCCL runs one rank per GPU, so more ranks on a host than GPUs visible
  there is refused in one line naming the host and both counts (no `local_rank % device_count` wrap, which would
  put two ranks on one GPU and fail later, inside a user's first collective).
- A GPU engine's process group is "cpu:gloo,cuda:nccl" (torch's device-map form): CUDA tensors go through NCCL
  and CPU tensors through gloo, so `dist.all_reduce(torch.ones(2))` still works there. CPU engines use "mpi4py" (or
  "gloo" by name).
- Every rank uses the same backend: a world where some hosts have GPUs and others none is refused.

Code that compares backend names must not compare `dist.get_backend()` with "nccl" or "gloo": on GPU engines it
is "cpu:gloo,cuda:nccl". `backend_for(backend, device_type)` says which backend serves tensors of a device type.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from nbdist.errors import DistUsageError

REQUESTS = ("auto", "gloo", "nccl", "mpi")  # what --backend accepts
CPU_BACKEND = "gloo"
MPI_BACKEND = "mpi4py"  # the name backend/ranks/mpi_backend.py registers with torch.distributed
GPU_BACKEND = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True)
class Binding:
    """One engine's device ("cpu" or "cuda:<i>") and the backend string its process group is initialised with."""

    device: str
    backend: str

    @property
    def gpu_index(self) -> int | None:
        """The CUDA device index, or None on a CPU engine."""
        return int(self.device.partition(":")[2]) if self.device.startswith("cuda") else None


CPU_ENGINE = Binding("cpu", CPU_BACKEND)
MPI_ENGINE = Binding("cpu", MPI_BACKEND)


def wants_gpus(requested: str, cpu: bool) -> bool:
    """Whether engines look for GPUs at all: not with --cpu, nor with --backend gloo or mpi (CPU engines)."""
    return not cpu and requested not in ("gloo", "mpi")


def bind(requested: str, cpu: bool, local_rank: int, ranks_on_host: int, gpus: int, host: str) -> Binding:
    """The device and backend of the rank `local_rank` of `ranks_on_host` ranks on `host`, where `gpus` GPUs are
    visible. Raises DistUsageError (one line, naming the host and the counts) when no valid choice exists."""
    if requested not in REQUESTS:
        raise DistUsageError(f"unknown backend {requested!r}: choose one of {', '.join(REQUESTS)}")
    if cpu and requested == "nccl":
        raise DistUsageError("--cpu and --backend nccl contradict each other: NCCL needs GPUs")
    if requested == "mpi":
        return MPI_ENGINE
    if requested == "gloo":
        return CPU_ENGINE
    if cpu or gpus == 0 and requested == "auto":
        return MPI_ENGINE  # CPU engines: MPI shared memory unless gloo is asked for by name
    if gpus == 0:
        raise DistUsageError(f"--backend nccl needs GPUs and host {host} has none visible; use --backend gloo")
    if ranks_on_host > gpus:
        raise DistUsageError(
            f"host {host} runs {ranks_on_host} ranks but has {gpus} GPU(s) visible: NCCL runs one rank per GPU; "
            f"start at most {gpus} engine(s) there, or use --cpu / --backend gloo for CPU engines"
        )
    return Binding(f"cuda:{local_rank}", GPU_BACKEND)


def check_world(choices: Sequence[Binding | str], hosts: Sequence[str]) -> None:
    """Every rank's choice (a Binding, or the refusal message `bind` raised there), gathered on every rank: raise
    the first refusal on all of them (so that no rank waits for one that gave up), or refuse a world whose ranks
    would initialise different backends (GPUs on some hosts, none on others)."""
    refusals = [c for c in choices if isinstance(c, str)]
    if refusals:
        raise DistUsageError(refusals[0])
    if len({c.backend for c in choices}) > 1:
        gpu = next(r for r, c in enumerate(choices) if c.gpu_index is not None)
        cpu = next(r for r, c in enumerate(choices) if c.gpu_index is None)
        raise DistUsageError(
            f"rank {gpu} on {hosts[gpu]} has a GPU but rank {cpu} on {hosts[cpu]} has none: all ranks must use one "
            f"backend; use --cpu / --backend gloo for CPU engines, or hosts that all have GPUs"
        )


def init_options(binding: Binding, accepted: Collection[str]) -> dict:
    """Extra keyword arguments for `init_process_group`: `device_id` on GPU engines, which makes torch form the NCCL
    communicator at once (an error shows at start-up, not in a user's first collective) and lets sub-groups split
    from it. `accepted` is init_process_group's parameter names: older torch builds lack `device_id`."""
    if binding.gpu_index is None or "device_id" not in accepted:
        return {}
    import torch

    return {"device_id": torch.device("cuda", binding.gpu_index)}


def backend_for(backend: str, device_type: str) -> str | None:
    """Which backend of a process group whose backend string is `backend` (what `dist.get_backend(group)` returns:
    "gloo", "nccl", "cpu:gloo,cuda:nccl", ...) serves tensors on `device_type` ("cpu", "cuda"); None if none does.
    torch's own parser (BackendConfig) decides, so the answer is the one torch routes by: "gloo" serves cpu and
    cuda, "nccl" cuda only."""
    from torch.distributed import Backend, BackendConfig

    served = BackendConfig(Backend(backend)).get_device_backend_map().get(device_type)
    return None if served is None else str(served)


def process_gpu_bytes(processes: Sequence, pid: int) -> int | None:
    """GPU bytes NVML lists for process `pid`, from `nvmlDeviceGetComputeRunningProcesses` (entries with `pid` and
    `usedGpuMemory`, the latter None where the driver cannot account per process). None when `pid` is not listed:
    inside a container NVML reports the host's PIDs, so a process may not find itself."""
    used = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory is not None]
    return sum(used) if used else None

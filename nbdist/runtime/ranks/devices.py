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

import re
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


def nvml_uuids(pynvml) -> list[str]:
    """The UUIDs of the GPUs NVML lists, in NVML's order (NVML initialised by the caller): what `cuda_shows` and
    `nvml_device` map CUDA_VISIBLE_DEVICES against. Older nvidia-ml-py returns bytes, newer str."""
    uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
    return [u.decode() if isinstance(u, bytes) else u for u in uuids]


def nvml_device(cuda_index: int, visible: str | None, uuids: Sequence[str]) -> int | str | None:
    """What NVML calls CUDA device `cuda_index` of a process whose CUDA_VISIBLE_DEVICES is `visible` (None: unset),
    where NVML lists GPUs whose UUIDs are `uuids` (NVML index i is uuids[i]). The one mapping telemetry and boot use.

    Why: NVML numbers every GPU of the machine, CUDA only those CUDA_VISIBLE_DEVICES shows, in its order: under
    "3,1" CUDA's 0 is NVML's 3, so one index used for both reads another GPU's figures.

    Returns NVML's index (int); for a MIG instance ("MIG-..." entries), its UUID (str), which
    nvmlDeviceGetHandleByUUID opens as that instance alone: its own memory (NVML reports no utilisation for it).
    Not the parent GPU: its memory counts every instance's, other users' included, so it is not this rank's figure.
    None where CUDA shows no device `cuda_index`.

    CUDA_VISIBLE_DEVICES is read as CUDA reads it (torch.cuda._parse_visible_devices follows it): integers by their
    leading digits ("1gpu" is 1), a negative or unreadable entry ending the list and an index beyond NVML's count
    too; "GPU-" entries are UUID prefixes, each matching exactly one GPU, the first that does not ending the list;
    a device named twice hides all. NVML orders GPUs by PCI bus; CUDA's default order (fastest first) agrees
    except on hosts that mix GPU models, where CUDA_DEVICE_ORDER=PCI_BUS_ID makes it agree."""
    shown = cuda_shows(visible, uuids)
    return shown[cuda_index] if 0 <= cuda_index < len(shown) else None


def cuda_shows(visible: str | None, uuids: Sequence[str]) -> list[int | str]:
    """The devices CUDA shows, in CUDA's order: NVML indices, or MIG instances' UUIDs (the kernel counts them
    with this, without a CUDA context: cluster/options.visible_gpus)."""
    if visible is None:
        return list(range(len(uuids)))
    entries = [e.strip() for e in visible.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        named = _unique(_while(entries, lambda e: e.startswith(prefix)))
        return named if prefix == "MIG-" else _unique(_while([_uuid_index(e, uuids) for e in named], _found))
    ordinals = _unique(_while([_leading_int(e) for e in entries], lambda i: i >= 0))
    return _while(ordinals, lambda i: i < len(uuids))


def _while(items: list, keep) -> list:
    """The items before the first that `keep` refuses: CUDA stops reading the list there."""
    for i, item in enumerate(items):
        if not keep(item):
            return items[:i]
    return items


def _unique(items: list) -> list:
    """The items, or none if one repeats: CUDA shows no device when one is named twice."""
    return items if len(set(items)) == len(items) else []


def _found(index: int | None) -> bool:
    return index is not None


def _uuid_index(prefix: str, uuids: Sequence[str]) -> int | None:
    """The NVML index of the one GPU whose UUID starts with `prefix`; None if none or several do."""
    matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None


def _leading_int(text: str) -> int:
    """The integer `text` starts with, as C's strtoul reads it ("1gpu" is 1); -1 where it starts with none."""
    match = re.match(r"[+-]?\d+", text)
    return int(match.group()) if match else -1

"""What tests/test_gpu.py and tests/test_gpu_paths.py share: one-engine clusters on CUDA or on CPU, whether CUDA is
there (asked without a CUDA context in this process, which stands for the notebook kernel), and what NVML and
nvidia-smi say of the GPU.

Each check runs on a one-engine cluster, as a user with one GPU starts one: parametrized over the engine's kind,
`cuda` (marked `gpu`, skipped with the reason where CUDA is absent) and `cpu` (mpi4py, the CPU default).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import nbdist
from nbdist.cluster.options import ClusterOptions, visible_gpus

START_TIMEOUT = 180.0  # seconds a cluster start may take (a cold GPU machine imports torch and CUDA for a while)
LEFTOVER_WAIT = 10.0  # seconds nvidia-smi may take to stop listing a stopped engine

CUDA = pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")
CPU = pytest.param("cpu", id="cpu")
KINDS = [CUDA, CPU]  # CUDA first, in every module: pytest groups the tests by this index, one cluster per kind
cuda_only = pytest.mark.parametrize("engine", [CUDA], indirect=True)  # the module's `engine` fixture, CUDA only


@dataclass
class Engine:
    kind: str  # "cuda" or "cpu": what the cluster was started for
    cluster: nbdist.Cluster


@functools.cache
def cuda_missing() -> str | None:
    """Why CUDA engines cannot run here, or None. Asked as nbdist asks, without a CUDA context in this process:
    NVML counts the GPUs (visible_gpus), and only where it finds one does a child process ask
    torch.cuda.is_available()."""
    gpus = visible_gpus()
    if gpus == 0:
        return "needs CUDA: no GPU visible here (NVML finds none, or CUDA_VISIBLE_DEVICES hides them)"
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.__version__)"],
                           capture_output=True, text=True, timeout=300, check=False)
    said = probe.stdout.split()
    if not said or said[0] != "True":
        return (f"needs CUDA: NVML sees {gpus} GPU(s), but torch.cuda.is_available() is not True in a fresh process "
                f"({' '.join(said) or probe.stderr.strip()[-300:]})")
    return None


def skip_without_cuda() -> None:
    reason = cuda_missing()
    if reason:
        pytest.skip(reason)


def start_cluster(kind: str, n: int = 1) -> nbdist.Cluster:
    """An `n`-engine cluster (one by default): on GPUs with nccl (skipped where CUDA is absent), or CPU engines
    (mpi4py)."""
    if kind == "cuda":
        skip_without_cuda()
    return nbdist.Cluster(ClusterOptions(n=n, cpu=kind == "cpu", timeout=START_TIMEOUT)).start()


def start_engine(kind: str) -> Engine:
    return Engine(kind, start_cluster(kind))


def assert_device(engine: Engine, device: str) -> None:
    """A GPU check that ran on CPU proves nothing about the GPU (and the other way round)."""
    assert device.startswith(engine.kind), f"ran on {device}, not on {engine.kind}"


# -- the kernel holds no CUDA context ---------------------------------------------------------------------------------


def assert_no_cuda_context_in_kernel(cluster: nbdist.Cluster) -> None:
    """The kernel (this process) never touches CUDA: torch did not initialise it here, and NVML's list of the GPU's
    compute processes (which must show the engine, else the list proves nothing) does not hold this process."""
    import torch

    engine_pid = cluster.run(on_rank_touch_cuda, timeout=60)[0]["pid"]
    listed = nvml_compute_pids()
    libcuda = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcuda.so" in line}
    detail = {"kernel_pid": os.getpid(), "engine_pid": engine_pid, "nvml_compute_pids": sorted(listed),
              "libcuda_mapped_in_kernel": sorted(libcuda)}
    assert not torch.cuda.is_initialized(), f"torch.cuda.is_initialized() is True in the kernel: {detail}"
    assert os.getpid() not in listed, f"NVML lists the kernel's pid among the GPU's compute processes: {detail}"
    assert engine_pid in listed or not libcuda, (
        f"NVML does not list the engine's pid (another pid namespace?), so its list proves nothing, and the kernel "
        f"has libcuda mapped: {detail}")


def nvml_compute_pids() -> set[int]:
    """Pids of the compute processes NVML sees on every GPU (a CUDA context makes a process one)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids.update(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return pids
    finally:
        pynvml.nvmlShutdown()


# -- nvidia-smi -------------------------------------------------------------------------------------------------------


def nvidia_smi(*query: str) -> list[str] | None:
    """nvidia-smi's CSV lines for a query, or None where it cannot be run."""
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_pids_by_nvidia_smi() -> set[int] | None:
    lines = nvidia_smi("--query-compute-apps=pid")
    return None if lines is None else {int(line) for line in lines if line.isdigit()}


def gpu_memory_used_mib() -> float | None:
    lines = nvidia_smi("--query-gpu=memory.used", "-i", "0")
    try:
        return float(lines[0]) if lines else None
    except ValueError:
        return None


def wait_off_gpu(pids: set[int], seconds: float = LEFTOVER_WAIT) -> set[int] | None:
    """Those of `pids` nvidia-smi still lists after up to `seconds` (None: nvidia-smi cannot be run)."""
    deadline = time.monotonic() + seconds
    while True:
        listed = gpu_pids_by_nvidia_smi()
        if listed is None or not (listed & pids) or time.monotonic() > deadline:
            return None if listed is None else listed & pids
        time.sleep(0.5)


# -- on the rank (ipyparallel sends the code; each function imports what it needs) ------------------------------------


def on_rank_touch_cuda() -> dict:
    """A CUDA tensor on the rank's device, so that its context surely exists; this engine's pid."""
    import os

    import torch

    from nbdist.cluster.launching.ranks.boot import boot

    torch.ones(1, device=boot().device).sum().item()
    return {"pid": os.getpid()}


def on_rank_collectives(where: str) -> dict:
    """all_reduce, all_gather and broadcast of rank-dependent values on the default process group, each compared
    exactly with what it must give; `where`: "engine" (the rank's device) or "cpu". One failing op does not stop
    the others."""
    import torch
    import torch.distributed as dist

    from nbdist.cluster.launching.ranks.boot import boot

    device = torch.device(boot().device if where == "engine" else "cpu")
    rank, n = dist.get_rank(), dist.get_world_size()

    def mine(r: int) -> torch.Tensor:
        return torch.arange(4, dtype=torch.float32) + 10 * (r + 1)

    def all_reduce():
        t = mine(rank).to(device)
        dist.all_reduce(t)
        return t, sum(mine(r) for r in range(n))

    def all_gather():
        parts = [torch.full((4,), -1.0, device=device) for _ in range(n)]
        dist.all_gather(parts, mine(rank).to(device))
        return torch.cat(parts), torch.cat([mine(r) for r in range(n)])

    def broadcast():
        t = mine(rank).to(device) if rank == 0 else torch.full((4,), -1.0, device=device)
        dist.broadcast(t, src=0)
        return t, mine(0)

    ops = {}
    for name, op in (("all_reduce", all_reduce), ("all_gather", all_gather), ("broadcast", broadcast)):
        try:
            got, want = op()
            if got.device != device:
                ops[name] = f"result on {got.device}, not {device}"
            else:
                ops[name] = "ok" if torch.equal(got.cpu(), want) else f"got {got.tolist()}, expected {want.tolist()}"
        except Exception as e:  # noqa: BLE001 - reported per op
            ops[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return {"device": str(device), "backend": str(dist.get_backend()), "ranks": n, "ops": ops}

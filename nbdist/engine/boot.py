"""Engine start-up: MPI rank and local rank, device binding, torch.distributed rendezvous.

Runs in every engine process *before* it registers with the ipyparallel controller, so that importing torch and
initialising the process group overlap with the controller's own start-up. Settings arrive as environment
variables (ipyparallel gives every rank the same environment; per-rank choices are made here, from the rank).
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import asdict, dataclass

BACKEND_ENV = "NBDIST_BACKEND"  # "gloo" | "nccl" | "auto"
DEVICE_ENV = "NBDIST_DEVICE"  # "cpu" forces CPU engines even where GPUs exist; "auto" binds GPUs by local rank
PG_TIMEOUT_ENV = "NBDIST_PG_TIMEOUT"  # seconds a collective may wait before torch.distributed gives up


@dataclass
class RankInfo:
    """What the notebook learns about one engine; `%dist_status` prints these."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    device: str
    backend: str
    boot_seconds: float




def _rendezvous_store(comm, single_host: bool, timeout: datetime.timedelta):
    """torch.distributed's key-value store for the rendezvous: rank 0 serves it on a port the OS picks while it
    binds (no port chosen first and bound later, which another process may take in between), and everyone learns
    that port over MPI."""
    from torch.distributed import TCPStore

    store, address = None, None
    if comm.rank == 0:
        host = os.environ.get("NBDIST_MASTER_ADDR") or ("127.0.0.1" if single_host else socket.getfqdn())
        store = TCPStore(host, 0, comm.size, True, timeout, wait_for_workers=False)
        address = (host, store.port)
    host, port = comm.bcast(address, root=0)
    return store if store is not None else TCPStore(host, port, comm.size, False, timeout)


def _choose_device(local_rank: int) -> str:
    import torch

    if os.environ.get(DEVICE_ENV, "auto") == "cpu" or not torch.cuda.is_available():
        return "cpu"
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def boot() -> RankInfo:
    """Join the MPI world, bind a device and initialise torch.distributed. Idempotent."""
    from nbdist.engine import registry

    booted = registry.find(registry.RANK, "boot")
    if booted is not None:
        return booted
    started = time.perf_counter()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this host: local rank = GPU index
    local_rank = node.rank
    single_host = node.size == comm.size
    node.Free()
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "1800")))
    store = _rendezvous_store(comm, single_host, timeout)
    device = _choose_device(local_rank)
    backend = os.environ.get(BACKEND_ENV, "auto")
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=comm.rank, world_size=comm.size, timeout=timeout)
    return registry.put(registry.RANK, "boot", RankInfo(
        rank=comm.rank,
        world_size=comm.size,
        local_rank=local_rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        backend=backend,
        boot_seconds=time.perf_counter() - started,
    ))


def info() -> dict:
    """This rank's description plus live memory use, for the status table."""
    import psutil

    data = asdict(boot())
    data["rss_mib"] = psutil.Process().memory_info().rss / 2**20
    if data["device"].startswith("cuda"):
        import torch

        data["gpu_mib"] = torch.cuda.memory_allocated() / 2**20
    return data

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


INFO: RankInfo | None = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _rendezvous_address(comm, single_host: bool) -> str:
    """Rank 0 picks its host and a free port; everyone learns it over MPI (no fixed port, no collisions)."""
    address = None
    if comm.rank == 0:
        host = os.environ.get("NBDIST_MASTER_ADDR") or ("127.0.0.1" if single_host else socket.getfqdn())
        address = f"tcp://{host}:{_free_port()}"
    return comm.bcast(address, root=0)


def _choose_device(local_rank: int) -> str:
    import torch

    if os.environ.get(DEVICE_ENV, "auto") == "cpu" or not torch.cuda.is_available():
        return "cpu"
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def boot() -> RankInfo:
    """Join the MPI world, bind a device and initialise torch.distributed. Idempotent."""
    global INFO
    if INFO is not None:
        return INFO
    started = time.perf_counter()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this host: local rank = GPU index
    local_rank = node.rank
    address = _rendezvous_address(comm, single_host=node.size == comm.size)
    node.Free()
    import torch.distributed as dist

    device = _choose_device(local_rank)
    backend = os.environ.get(BACKEND_ENV, "auto")
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "1800")))
    dist.init_process_group(backend, init_method=address, rank=comm.rank, world_size=comm.size, timeout=timeout)
    INFO = RankInfo(
        rank=comm.rank,
        world_size=comm.size,
        local_rank=local_rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        backend=backend,
        boot_seconds=time.perf_counter() - started,
    )
    return INFO


def info() -> dict:
    """This rank's description plus live memory use, for the status table."""
    import psutil

    data = asdict(boot())
    data["rss_mib"] = psutil.Process().memory_info().rss / 2**20
    if data["device"].startswith("cuda"):
        import torch

        data["gpu_mib"] = torch.cuda.memory_allocated() / 2**20
    return data

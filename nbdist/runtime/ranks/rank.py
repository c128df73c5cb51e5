"""What this rank is: its number, host, device and backend, as its boot found them (cluster/launching/ranks/boot.py
fills it in at the engine's start). Here, not in boot, so that every parallelism reads it without importing the
launch."""
from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.errors import DistUsageError
from nbdist.runtime.ranks import registry


@dataclass
class RankInfo:
    """What the notebook learns about one engine; `%dist_status` prints these."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    device: str
    backend: str  # what dist.get_backend() reports: "mpi4py" or "gloo" (CPU), "cpu:gloo,cuda:nccl" (GPU engines)
    boot_seconds: float
    launched_pid: int = 0  # the process mpiexec started: this one, or the stand-in of a rank forked from the kernel
    left_open: list[str] = field(default_factory=list)  # protections the OS refused: what stays open, in words


KEY = "boot"  # where boot keeps it in the registry's RANK scope


def this_rank() -> RankInfo:
    """This rank, as booted; one line where this process is no booted rank (an engine boots before anything runs)."""
    found = registry.find(registry.RANK, KEY)
    if found is None:
        raise DistUsageError("this process is not a booted nbdist rank: rank-side code runs on a cluster's engines "
                             "(cluster.run, %%dist)")
    return found

"""What the backend's rank functions answer the kernel: plain data, made on the ranks and unpickled in the kernel
(cluster/waiting/recovery.py), so this module imports neither torch nor mpi4py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Renewed:
    """mpi_backend.renew on one rank: every mpi4py group it holds, given a fresh communicator."""

    groups: list[list[int]]  # each renewed group's global ranks, in the order they were made
    broken: int  # how many of them had given up an operation on this rank (0: renewed quietly)

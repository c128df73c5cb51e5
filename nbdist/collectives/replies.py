"""What the benchmark's rank functions (ranks/collective_timing.py) answer the notebook (sweep.py): plain data, made
on the ranks and unpickled in the kernel, so this module imports neither torch nor mpi4py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MpiWorld:
    """collective_timing.mpi_world: this engine's MPI rank and size beside torch.distributed's, or why the
    benchmark cannot use MPI on it."""

    torch_rank: int | None = None
    torch_size: int | None = None
    mpi_rank: int | None = None
    mpi_size: int | None = None
    problem: str | None = None  # torch.distributed not initialised, or mpi4py not importable


@dataclass(frozen=True)
class Timed:
    """collective_timing.measure on one rank: one collective, one way, one size."""

    rank: int
    backend: str
    note: str  # shown beside the row (a backend's caveat; where the backend lacks the op, what it said)
    seconds: float | None = None  # per operation on this rank (None: not run)
    iters: int | None = None
    wrong: str | None = None  # what was wrong with the checked result (None: right, or not checked)
    unsupported: bool = False  # the backend lacks this op

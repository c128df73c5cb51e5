"""Renewing the MPI backend's groups after a rank gave up an operation (runs ON the engines), told to the kernel as
plain numbers.

Why a module of its own: the kernel sends this function by reference, and it imports the MPI backend only on the
rank. Imported in the kernel, the backend's mpi4py starts MPI there: the kernel's later starts can no longer fork
their ranks (a fork of an MPI process is not a rank), and the kernel's MPI left its shared-memory file in /dev/shm
when it was killed (a culled JupyterHub server)."""
from __future__ import annotations


def renew() -> tuple[int, int]:
    """(groups given a fresh communicator, operations this rank had given up): mpi_backend.renew, on every rank."""
    from nbdist.backend.ranks import mpi_backend

    renewed = mpi_backend.renew()
    return len(renewed.groups), renewed.broken

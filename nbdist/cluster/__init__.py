"""The cluster: the engines' processes and what every rank is. This folder is its face; each concern is a folder.

- here: `Cluster` (api.py) and the module-level start/stop/current, the options a start takes (options.py), the
  checks of call arguments (arguments.py), the status table (status.py);
- launching/: start and stop the controller and the MPI engines (launch.py, files.py, controller.py), the warm
  process the ranks are forked from (warm.py), MPICH's leftover files (mpi_segments.py); ranks/: a rank's entry,
  its boot (rank, device, process group), the warm process and mpiexec's stand-in for a forked rank, the relay of a
  rank's PMI socket (pmi_relay.py: an MPI_Abort is recorded before Hydra hears of it);
- hosts/: what ties engines on other hosts (and on this one) to the kernel: the lifeline (lifeline.py,
  lifeline_server.py), a Slurm allocation (slurm.py, slurm_holder.py); ranks/: the addresses a rank listens on,
  the rendezvous over MPI (mpi_store.py);
- waiting/: waiting on the ranks, their output, failures and deaths (remote.py, tracebacks.py, deaths.py); ranks/:
  the inspector thread that says what a rank is doing, the GPU synchronisation a waiting rank does;
- meshes/: a mesh laid over the ranks (mesh.py); ranks/: its communicators and groups.

What every parallelism uses on a rank (placement, memory, the registry, devices, compat) is `nbdist.runtime`.

Imported on first use (PEP 562), so that `python -m nbdist.cluster.hosts.lifeline` and the engines' rank-side
imports do not pull in the kernel's side (ipyparallel) first.
"""
from __future__ import annotations

import importlib

from nbdist.lazy import submodules_on_demand

_API = ("Cluster", "Status", "current", "start", "stop", "parse_rank_spec")
_submodule = submodules_on_demand(__name__)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module("nbdist.cluster.api"), name)
    return _submodule(name)

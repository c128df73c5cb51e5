"""The cluster: the engines' processes and what every rank is.

Kernel side (this folder): start and stop the controller and the MPI engines (launch.py, files.py; the controller's
own entry, controller.py), keep them tied to the kernel (lifeline.py, lifeline_server.py), wait on the ranks and show
their output and failures (remote.py, tracebacks.py, deaths.py), check options and call arguments (options.py,
arguments.py), hold a Slurm allocation (slurm.py), lay meshes over the ranks (mesh.py), tabulate status (status.py),
remove MPICH's files a killed start left (mpi_segments.py, also run by each rank as it starts); `Cluster` (api.py) is
the face of all of it. Rank side (ranks/): start-up, device, process group, registry, groups, meshes' communicators.

Imported on first use (PEP 562), so that `python -m nbdist.cluster.lifeline` and the engines' rank-side imports do
not pull in the kernel's side (ipyparallel) first.
"""
from __future__ import annotations

import importlib

_API = ("Cluster", "Status", "current", "start", "stop", "parse_rank_spec")


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module("nbdist.cluster.api"), name)
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"nbdist.cluster.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"nbdist.cluster.{name}":
                raise
    raise AttributeError(f"module 'nbdist.cluster' has no attribute {name!r}")

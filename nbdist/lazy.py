"""Packages whose submodules are imported when first asked for (PEP 562): `nbdist.schedules`,
`nbdist.cluster.meshes.mesh`, without importing every submodule (and the kernel's ipyparallel) up front."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def submodules_on_demand(package: str) -> Callable[[str], Any]:
    """A package's `__getattr__` that imports its submodule `name` when first asked (`nbdist.cluster.meshes.mesh`)."""

    def __getattr__(name: str):
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

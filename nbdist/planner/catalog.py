"""`hardware(name)`: a profile by name, the datasheet ones (nbdist/cost/hardware.py) or "local", measured (local.py)."""
from __future__ import annotations

from dataclasses import fields, replace

from nbdist.checks import one_of
from nbdist.cost.hardware import PROFILES, Hardware
from nbdist.errors import DistUsageError
from nbdist.planner import local

NAMES = (*PROFILES, "local")


def hardware(name: str, cluster=None, **changes) -> Hardware:
    """The named profile ("a100-80gb", "a100-40gb", "h100-sxm", "h200", or "local"), with `changes` applied
    (e.g. gpus_per_host=4, matmul_efficiency=0.7).

    "local" is the running cluster's engines, CPU or GPU. Without `cluster`, the measurements stored in
    planner/local.py (taken on 2 CPU cores with 2 engines; the command is in its docstring). With a running `cluster`
    (nbdist.start(n)), measured now on it, on each engine's device: a matmul probe on every engine at once and, with
    two engines or more, the α-β fit of a 2-rank all-reduce.
    """
    one_of(name, NAMES, "hardware profile")
    if name == "local":
        profile = local.measure(cluster) if cluster is not None else local.stored()
    else:
        if cluster is not None:
            raise DistUsageError(f"only the 'local' profile is measured on a cluster; {name!r} is a datasheet")
        profile = PROFILES[name]
    unknown = sorted(set(changes) - {f.name for f in fields(Hardware)})
    if unknown:
        raise DistUsageError(f"a hardware profile has no {', '.join(unknown)}: choose from "
                             f"{', '.join(f.name for f in fields(Hardware))}")
    return replace(profile, **changes) if changes else profile

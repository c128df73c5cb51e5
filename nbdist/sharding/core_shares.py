"""What a plan's ranks get of this host's cores, measured when the plan is profiled (kernel side): the share of a
core each rank gets with every rank computing at once, other work on the host counted (a classroom machine is
loaded), and from it how much longer a rank's compute takes in the step than its core seconds in the profile.

The layers are timed in core seconds on CPU engines (sharding/ranks/timing.py), so a prediction holds while the
load stays near the one its share was measured under: the share carries that load and says it (measured.CoreShare).
"""
from __future__ import annotations

import os
import socket
import statistics

from nbdist.measured import CoreShare, machine_load
from nbdist.sharding.ranks import timing


def on_cpu(cluster) -> bool:
    return all(device.startswith("cpu") for device in cluster.devices)


def ranks_here(cluster) -> int:
    """The cluster's ranks on this host, which share its cores."""
    return sum(host == socket.gethostname() for host in cluster.hosts)


def share_now(cluster) -> float | None:
    """The share of a core the slowest rank gets now with every rank computing at once (timing.core_share);
    None on GPU engines, whose layers are timed on the GPU's own clock."""
    return min(cluster.run(timing.core_share)) if on_cpu(cluster) else None


def measured(cluster, shares: list[float | None]) -> CoreShare | None:
    """The median of shares measured through a profile (its start, middle and end: a classroom's load moves within
    seconds, and one window can fall on another process's burst), with the load beside it."""
    if not shares or any(s is None for s in shares):
        return None
    return CoreShare(max(statistics.median(shares), 1e-3), ranks_here(cluster), machine_load())


def contention(cluster, cores: CoreShare | None) -> float:
    """How much longer a rank's compute takes in the step, every rank busy, than the profile's layer times: on CPU
    engines those are core seconds, so 1 / the share of a core each rank got at profile time with every rank busy
    (4 ranks on 2 quiet cores about 2x, beside two busy processes about 3x); before a profile, the ranks here over
    the cores. 1 on GPU engines."""
    if not on_cpu(cluster):
        return 1.0
    if cores is not None:
        return cores.slowdown
    return max(1.0, ranks_here(cluster) / len(os.sched_getaffinity(0)))

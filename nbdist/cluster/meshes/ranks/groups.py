"""Process groups and MPI communicators over chosen ranks, made once and kept in the engine registry (runs ON the
engines).

Two kinds of entry, named by their ranks ("ranks:0,2"):

- "group": a torch.distributed process group. `dist.new_group` is collective over the WHOLE world (every rank
  calls it, member or not, in the same order), so `torch_group` must be called on every rank alike; since every
  rank's registry then grows the same way, the groups stay paired.
- "mpi-comm": an MPI communicator of the same ranks in the same order. `MPI.COMM_WORLD.Create_group` is collective
  over the members only, so `mpi_comm` is called by the members alone (as DDP calls its hook's set-up only on its
  group's ranks). A mesh's communicator is reused when a mesh dimension holds exactly these ranks.

nbdist's engines initialise torch.distributed with torch rank = MPI rank, so a torch group's (global) ranks name
the MPI ranks of its communicator. A restart empties the registry; the groups are made again on first use.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nbdist.runtime.ranks import registry

GROUP, COMM = "group", "mpi-comm"


@dataclass
class Held:
    """A group or communicator in the registry, with the line `%dist_status` shows for it."""

    what: str
    ranks: tuple[int, ...]
    handle: Any

    def describe(self) -> str:
        return f"{self.what} of ranks {list(self.ranks)}"

    def close(self) -> None:
        free = getattr(self.handle, "Free", None)  # an MPI communicator; torch groups are freed with the world
        if callable(free):
            free()


def name(ranks: Iterable[int]) -> str:
    return "ranks:" + ",".join(map(str, ranks))


def torch_group(ranks: Iterable[int]):
    """The process group of these world ranks (None, the default group, when they are the whole world in order).
    Collective over the whole world the first time: call it on every rank."""
    import torch.distributed as dist

    ranks = tuple(ranks)
    if ranks == tuple(range(dist.get_world_size())):
        return None
    made = registry.get_or_make(GROUP, name(ranks), lambda: Held("torch group", ranks, dist.new_group(list(ranks))))
    return made.handle


def first_ranks(n: int):
    """The process group of ranks 0..n-1 (call on every rank)."""
    return torch_group(range(n))


def group_ranks(group) -> list[int]:
    """The world ranks of a torch process group (None: the default group) in the order of their group ranks."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    return sorted(dist.get_process_group_ranks(group), key=lambda r: dist.get_group_rank(group, r))


def mpi_comm(ranks: Iterable[int]):
    """The MPI communicator of these world ranks, in this order (its rank i is ranks[i]); COMM_WORLD when they are
    the whole world in order; a mesh's communicator when a mesh dimension holds exactly these ranks. Collective over
    the members only, the first time: call it on each of them (and only them)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ranks = tuple(ranks)
    if ranks == tuple(range(world.size)):
        return world
    if world.rank not in ranks:
        raise RuntimeError(f"MPI rank {world.rank} asked for the communicator of ranks {list(ranks)}, not its own")
    return _from_a_mesh(ranks) or registry.get_or_make(COMM, name(ranks), lambda: _create(world, ranks)).handle


def _create(world, ranks: tuple[int, ...]) -> Held:
    members = world.group.Incl(list(ranks))
    try:
        return Held("MPI communicator", ranks, world.Create_group(members))
    finally:
        members.Free()


def _from_a_mesh(ranks: tuple[int, ...]):
    """The communicator of a mesh dimension (nbdist/cluster/meshes/ranks/rank_mesh.py) whose group is exactly `ranks`, if any."""
    for mesh_name in registry.names("mesh"):
        here = registry.get("mesh", mesh_name)
        for dim in here.mesh.names:
            if tuple(here.ranks(dim)) == ranks:
                return here.comm(dim)
    return None

"""A mesh on the ranks (this code runs ON the engines): per dimension, a torch process group and an MPI communicator.

`build(mesh)` runs on every rank of the world (making process groups and splitting communicators are collective
over the whole world, members or not) and keeps, on the ranks inside the mesh, a `RankMesh` in the registry. The
torch side is a `DeviceMesh` (what DTensor, FSDP2 and tensor parallelism take); the MPI side is one sub-communicator
per dimension whose rank order is the dimension's coordinate, for nbdist's own MPI transports and hooks. Both come
from the same `nbdist.mesh.Mesh`, so they agree on who is who.

In a %%dist cell (or a function run on the ranks): `me = nbdist.cluster.meshes.ranks.rank_mesh.here(m)` (m: the notebook's
Mesh, or its name); then `me.coords`, `me.group("dp")`, `me.comm("pp")`, `me.ranks("dp")`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbdist.cluster.meshes.mesh import Mesh
from nbdist.runtime.ranks import registry

KIND = "mesh"


@dataclass
class RankMesh:
    """This rank's view of a mesh: its coordinates, and its groups and communicators along each dimension."""

    mesh: Mesh
    rank: int
    device_mesh: Any  # torch.distributed.DeviceMesh
    comms: dict[str, Any] = field(default_factory=dict)  # dimension -> mpi4py communicator
    everyone: Any = None  # an MPI communicator of all the mesh's ranks (a barrier across every replica)

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.rank)

    def coord(self, dim: str) -> int:
        return self.coords[dim]

    def ranks(self, dim: str) -> list[int]:
        """The (world) ranks of this rank's group along `dim`, in coordinate order."""
        return self.mesh.group_of(dim, self.rank)

    def group(self, dim: str):
        """The torch.distributed process group along `dim` (for dist.all_reduce(..., group=...), DDP, FSDP2)."""
        return self.device_mesh.get_group(dim)

    def comm(self, dim: str):
        """The MPI communicator along `dim`; its rank is this rank's coordinate in `dim`."""
        return self.comms[dim]

    def describe(self) -> str:
        coords = ", ".join(f"{k}={v}" for k, v in self.coords.items())
        return f"{' × '.join(f'{n}={s}' for n, s in self.mesh.dims)}; this rank at {coords}"

    def close(self) -> None:
        for comm in [*self.comms.values(), self.everyone]:
            if comm is not None:
                comm.Free()
        self.comms, self.everyone = {}, None


def build(mesh: Mesh) -> str | None:
    """Make `mesh`'s groups and communicators (collective: every world rank calls this, once per mesh: the
    notebook keeps track, nbdist.cluster.meshes.mesh.mesh; a rank outside the mesh keeps nothing of it)."""
    import torch
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh

    from nbdist.cluster.launching.ranks.boot import boot

    info = boot()
    device_type = "cuda" if info.device.startswith("cuda") else "cpu"
    ranks = torch.arange(mesh.size).view(*mesh.shape)
    device_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=mesh.names)
    comms = {dim: _split(MPI.COMM_WORLD, mesh, dim) for dim in mesh.names}
    inside = mesh.coords(info.rank) is not None
    everyone = MPI.COMM_WORLD.Split(0 if inside else MPI.UNDEFINED, info.rank)
    if not inside:
        return None
    for dim in mesh.names:  # the flight recorder names the groups of the MPI backend by their dimension
        group = device_mesh.get_group(dim)
        if hasattr(group, "recorded_as") and group is not torch.distributed.group.WORLD:  # (a 1-D mesh's is it)
            group.recorded_as = (dim, *group.recorded_as[1:])
    registry.put(KIND, mesh.name, RankMesh(mesh, info.rank, device_mesh, comms, everyone))
    return mesh.name


def _split(world, mesh: Mesh, dim: str):
    """The communicator of this rank's group along `dim`, ranked by its coordinate; None outside the mesh."""
    from mpi4py import MPI

    index = mesh.group_index(dim, world.rank)
    if index is None:
        world.Split(MPI.UNDEFINED, 0)
        return None
    return world.Split(index, mesh.coords(world.rank)[dim])


def here(mesh: Mesh | str) -> RankMesh:
    """This rank's view of `mesh` (the notebook's Mesh object or its name)."""
    return registry.get(KIND, mesh if isinstance(mesh, str) else mesh.name)

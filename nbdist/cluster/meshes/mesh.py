"""A mesh: named parallel dimensions laid out over the cluster's ranks.

    m = nbdist.mesh(dp=2, pp=2)    # 4 ranks: 2 data-parallel replicas of a 2-stage pipeline
    m                              # a table: which rank is which replica and which stage
    m.groups("pp")                 # [[0, 2], [1, 3]]: the ranks of each pipeline, one list per replica
    m.figure()                     # the same as a picture

One documented order (as Megatron-LM and torchtitan lay out ranks): the dimensions go from outermost to innermost
as pp, dp, then any other names in the order given, then tp; the innermost one varies fastest. So the ranks of a
tensor-parallel group are neighbours (one host: tensor parallelism talks most), data-parallel replicas come next,
and pipeline stages are furthest apart (they exchange the least). Dimensions of size 1 are kept: `tp=1` is a mesh
with trivial tensor-parallel groups, which later features can rely on.

`Mesh` is plain data (no torch.distributed, no processes): the kernel draws and checks it, the engines build their
process groups and MPI sub-communicators from the same object (nbdist/cluster/meshes/ranks/rank_mesh.py), so both sides agree
on every coordinate. `nbdist.mesh(...)` (Cluster.mesh) asks the running cluster to build it, once per shape.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from itertools import product

from nbdist.checks import is_whole
from nbdist.errors import DistUsageError

FIRST = ("pp", "dp")  # outermost dimensions, in this order
LAST = ("tp",)  # innermost


@dataclass(frozen=True)
class Mesh:
    """Named dimensions over ranks 0 .. size-1 of a world of `world_size` ranks (the rest are not in the mesh)."""

    dims: tuple[tuple[str, int], ...]  # (name, size), outermost first
    world_size: int
    name: str = ""  # the mesh's name on the engines, once built there
    generation: int | None = None  # which start of the cluster it was built on (a restart makes it stale)
    hosts: tuple[str, ...] | None = None  # each rank's host, once built on a cluster (where the groups lie)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    @property
    def size(self) -> int:
        """How many ranks the mesh covers."""
        return math.prod(self.shape)

    def dim_size(self, dim: str) -> int:
        return dict(self.dims)[self._known(dim)]

    # -- coordinates ----------------------------------------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int] | None:
        """rank -> {dimension: coordinate}; None for a rank outside the mesh."""
        if not 0 <= rank < self.size:
            return None
        out, rest = {}, rank
        for name, size in reversed(self.dims):
            rest, out[name] = divmod(rest, size)
        return {name: out[name] for name in self.names}

    def rank_at(self, **coords: int) -> int:
        """The rank at these coordinates (every dimension named)."""
        if set(coords) != set(self.names):
            raise DistUsageError(f"give a coordinate for each of {', '.join(self.names)}; got {', '.join(coords)}")
        rank = 0
        for name, size in self.dims:
            if not is_whole(coords[name]) or not 0 <= coords[name] < size:
                raise DistUsageError(f"{name}={coords[name]!r} is outside 0..{size - 1}")
            rank = rank * size + coords[name]
        return rank

    def groups(self, dim: str) -> list[list[int]]:
        """The ranks of every group along `dim`: ranks that differ only in `dim`, ordered by their `dim` coordinate.
        Groups are listed in the order of the other coordinates (outermost first)."""
        dim = self._known(dim)
        others = [(name, size) for name, size in self.dims if name != dim]
        out = []
        for fixed in product(*(range(size) for _, size in others)):
            where = dict(zip((name for name, _ in others), fixed))
            out.append([self.rank_at(**where, **{dim: i}) for i in range(self.dim_size(dim))])
        return out

    def group_of(self, dim: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group along `dim` (empty if `rank` is outside the mesh)."""
        return next((g for g in self.groups(dim) if rank in g), [])

    def group_index(self, dim: str, rank: int) -> int | None:
        """Which of `groups(dim)` holds `rank` (e.g. for dim="pp": which replica's pipeline)."""
        return next((i for i, g in enumerate(self.groups(dim)) if rank in g), None)

    def spans(self, dim: str) -> str | None:
        """Where `dim`'s groups lie: "within a host" (every group's ranks share one), "across hosts", or None when
        the hosts are not known or the mesh is on one host."""
        if self.hosts is None or len(set(self.hosts[: self.size])) < 2:
            return None
        within = all(len({self.hosts[r] for r in group}) == 1 for group in self.groups(dim))
        return "within a host" if within else "across hosts"

    def _known(self, dim: str) -> str:
        if dim not in self.names:
            raise DistUsageError(f"the mesh has no dimension {dim!r}: it has {', '.join(self.names)}")
        return dim

    # -- showing --------------------------------------------------------------------------------------------------

    def rows(self) -> list[dict]:
        return [{"rank": rank, **self.coords(rank)} for rank in range(self.size)]

    def __str__(self) -> str:
        table = [["rank", *self.names]] + [[str(v) for v in row.values()] for row in self.rows()]
        widths = [max(len(cell) for cell in column) for column in zip(*table)]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
        return "\n".join([self._headline()] + lines)

    def _headline(self) -> str:
        shape = " × ".join(f"{name}={size}" for name, size in self.dims)
        unused = self.world_size - self.size
        where = [f"{name} groups {self.spans(name)}" for name, size in self.dims if size > 1 and self.spans(name)]
        return f"mesh {self.name or '(not built)'}: {shape} on {self.size} ranks" + (
            f" ({unused} of the {self.world_size} ranks outside it)" if unused else "") + (
            f"; {', '.join(where)}" if where else "")

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(n)}</th>" for n in ("rank", *self.names))
        body = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in row.values()) + "</tr>" for row in self.rows())
        return f"<p>{html.escape(self._headline())}</p><table><tr>{head}</tr>{body}</table>"

    def __repr__(self) -> str:
        return f"<{self._headline()}>"

    def figure(self, title: str | None = None):
        """Which rank is which replica, stage and slice, as a plotly grid."""
        from nbdist.viz.mesh import mesh_figure

        return mesh_figure(self, title=title)


def make_mesh(world_size: int, **dims: int) -> Mesh:
    """The Mesh of `dims` (name=size) over the first ranks of a `world_size`-rank world, in the documented order
    (plain data: nothing is built on the ranks). Impossible meshes are refused in one line."""
    if not dims:
        raise DistUsageError("a mesh needs at least one dimension, e.g. nbdist.mesh(dp=2, pp=2)")
    for name, size in dims.items():
        if not is_whole(size) or size < 1:
            raise DistUsageError(f"mesh dimension {name}={size!r} must be a whole number >= 1")
    ordered = [n for n in FIRST if n in dims] + [n for n in dims if n not in FIRST + LAST] + \
              [n for n in LAST if n in dims]
    mesh = Mesh(tuple((name, dims[name]) for name in ordered), world_size)
    if mesh.size > world_size:
        shape = " × ".join(f"{name}={size}" for name, size in mesh.dims)
        raise DistUsageError(f"mesh {shape} needs {mesh.size} ranks but the cluster has {world_size}")
    return mesh


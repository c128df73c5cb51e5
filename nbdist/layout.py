"""Layout: how one model is laid over the ranks, as one frozen object.

dp data-parallel replicas (ZeRO stage `zero` shards their state), pp pipeline stages run by `schedule` with
`microbatches` per replica and step (gradient accumulation when pp = 1) and `chunks` model pieces per stage rank,
tp tensor-parallel slices; `balance` optionally gives the layers of each pipeline piece. `zero3_sync` says when
ZeRO-3 reduce-scatters the gradients of accumulated micro-batches: after "every" one (the default), or only the
"last" (the others keep unsharded gradients and gathered parameters: memory traded for fewer collectives).
The same object goes to `nbdist.shard(model_fn, layout)`, to `Trainer(plan=layout)`, and comes out of the
cluster-scale planner (`Shape.layout`), so a layout chosen in one place is the layout run in the other. Keyword
calls (`nbdist.shard(model_fn, dp=2, tp=2)`) make one too.

The ranks are laid out as every mesh of nbdist is (cluster/meshes/mesh.py): pp outermost, then dp, tp innermost.
Plain data; checks are one line each (DistUsageError).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from nbdist.checks import whole_number
from nbdist.cluster.meshes.mesh import Mesh, make_mesh
from nbdist.cost.memory import check_zero
from nbdist.errors import DistUsageError

ZERO3_SYNCS = ("every", "last")  # Layout.zero3_sync


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1
    balance: tuple[int, ...] | None = None
    zero3_sync: str = "every"

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "microbatches", "chunks"):
            whole_number(getattr(self, name), name)
        check_zero(self.zero)
        if not isinstance(self.schedule, str):
            raise DistUsageError(f"schedule must be a schedule's name, got {self.schedule!r}")
        if self.balance is not None:
            object.__setattr__(self, "balance", tuple(self.balance))
        self._check_zero3_sync()

    def _check_zero3_sync(self) -> None:
        """zero3_sync="last" needs what it changes: ZeRO-3 (FSDP2) with micro-batches to accumulate, at pp = 1."""
        if self.zero3_sync not in ZERO3_SYNCS:
            raise DistUsageError(f"zero3_sync must be 'every' (reduce-scatter after every micro-batch) or 'last' "
                                 f"(only after the last), got {self.zero3_sync!r}")
        if self.zero3_sync == "every":
            return
        if self.zero != 3:
            raise DistUsageError(f"zero3_sync='last' changes how ZeRO-3 accumulates, but this layout has zero="
                                 f"{self.zero}: give zero=3, or leave zero3_sync at 'every'")
        if self.microbatches == 1:
            raise DistUsageError("zero3_sync='last' skips the reduce-scatter of the micro-batches before the last, "
                                 "but there is one micro-batch: give microbatches=k > 1 (the Trainer's grad_accum)")
        if self.pp > 1:
            raise DistUsageError("zero3_sync='last' is for pp = 1 plans: a pipeline's FSDP2 stages reduce-scatter "
                                 "each micro-batch as its backward ends")

    @classmethod
    def of(cls, value: "Layout | dict | None" = None, **choices) -> "Layout":
        """A Layout from a Layout, a dict of its fields, or keywords (unknown names refused in one line)."""
        if isinstance(value, Layout):
            return value.with_(**choices) if choices else value
        given = {**(value or {}), **choices}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise DistUsageError(f"unknown layout choice {', '.join(map(repr, unknown))}: choose from "
                                 f"{', '.join(sorted(known))}")
        return cls(**given)

    def with_(self, **changes) -> "Layout":
        """This layout with some choices changed (checked again)."""
        return replace(self, **changes)

    @property
    def ranks(self) -> int:
        """dp × pp × tp: the ranks this layout needs."""
        return self.dp * self.pp * self.tp

    def mesh(self) -> Mesh:
        """Which rank is which replica, stage and slice, as plain data (nothing built on the ranks)."""
        return make_mesh(self.ranks, pp=self.pp, dp=self.dp, tp=self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s replica (dp), stage (pp) and slice (tp)."""
        return self.mesh().coords(rank)

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"pp={self.pp}", f"tp={self.tp}"] + ([f"ZeRO-{self.zero}"] if self.zero else [])
        if self.pp > 1:
            parts.append(f"{self.schedule}, {self.microbatches} micro-batches"
                         + (f", {self.chunks} chunks" if self.chunks > 1 else ""))
        elif self.microbatches > 1:
            parts.append(f"{self.microbatches} micro-batches accumulated"
                         + (", reduce-scattered once" if self.zero3_sync == "last" else ""))
        return " × ".join(parts[:3]) + "".join(f", {p}" for p in parts[3:])

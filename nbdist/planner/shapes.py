"""A plan's shape (dp × cp × tp × pp, micro-batches, chunks, ZeRO, recomputation), checked, and where its groups
sit.

Ranks are laid out as nbdist's meshes and Megatron-LM lay them: pp outermost, then dp, then cp (context
parallelism: each sequence split over cp ranks), tp innermost, filling hosts of `gpus_per_host` in rank order.
So a tensor-parallel group is on one host when tp fits in it (it talks most), a context-parallel group's members
are t ranks apart, pipeline neighbours t·c·d ranks apart (on different hosts as soon as t·c·d fills a host), and
the gradient-sync group (dp × cp ranks: a cp group's ranks hold the same parameters, Megatron's "dp-cp" group)
has one member every t ranks. Which link a group's collective runs over, and how many of its
members share a host (they share the host's network ports), follows from that.

Every refusal is one line naming the numbers (DistUsageError).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nbdist.checks import one_of, whole_number
from nbdist.cost.collectives import all_gather_seconds, all_reduce_seconds
from nbdist.cost.hardware import Hardware, Link
from nbdist.cost.zero3 import ISSUERS
from nbdist.errors import DistUsageError
from nbdist.layout import Layout
from nbdist.planner.model import GPT, RECOMPUTE


@dataclass(frozen=True)
class Shape:
    """dp × tp × pp over `gpus`, the batch cut into micro-batches, and the memory savers used."""

    gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    microbatch: int
    chunks: int
    zero: int
    recompute: str
    sequence_parallel: bool
    flash_attention: bool = True
    cp: int = 1  # context parallelism: ranks each sequence is split over
    zero3_calls: str = "layer"  # how ZeRO-3 issues its collectives: per block (FSDP2) or per tensor (cost/zero3.py)

    @property
    def replicas(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: dp × cp."""
        return self.dp * self.cp

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel replica and step: B / (d·b)."""
        return self.global_batch // (self.dp * self.microbatch)

    @property
    def schedule(self) -> str:
        """The pipeline schedule this shape runs: interleaved 1F1B with chunks >= 2, else 1F1B (GPipe when there
        are fewer micro-batches than stages, which 1F1B cannot interleave)."""
        if self.chunks > 1:
            return "interleaved-1f1b"
        return "1f1b" if self.microbatches >= self.pp else "gpipe"

    @property
    def layout(self) -> Layout:
        """The same choices as the Layout that nbdist.shard and the Trainer take."""
        if self.cp > 1:
            raise DistUsageError(f"cp={self.cp}: nbdist.shard and the Trainer run no context parallelism; the "
                                 f"planner predicts it, nbdist cannot run it")
        return Layout(dp=self.dp, pp=self.pp, tp=self.tp, zero=self.zero, schedule=self.schedule,
                      microbatches=self.microbatches, chunks=self.chunks)

    def describe(self) -> str:
        extras = [f"cp={self.cp}"] if self.cp > 1 else []
        extras += [f"v={self.chunks}"] if self.chunks > 1 else []
        extras += [f"ZeRO-{self.zero}" + (" per tensor" if self.zero == 3 and self.zero3_calls == "parameter"
                                          else "")] if self.zero else []
        extras += [f"recompute {self.recompute}"] if self.recompute != "none" else []
        extras += ["sequence parallel"] if self.sequence_parallel and self.tp > 1 else []
        extras += [] if self.flash_attention else ["unfused attention"]
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}, b={self.microbatch} × m={self.microbatches}"
                + "".join(f", {e}" for e in extras))


def shape(model: GPT, gpus: int, tp: int, pp: int, global_batch: int, microbatch: int = 1, chunks: int = 1,
          zero: int = 0, recompute: str = "none", sequence_parallel: bool = False,
          flash_attention: bool = True, cp: int = 1, zero3_calls: str = "layer") -> Shape:
    """The checked shape of a plan; dp = gpus / (tp·cp·pp)."""
    for label, value in (("gpus", gpus), ("tp", tp), ("pp", pp), ("global_batch", global_batch),
                         ("microbatch", microbatch), ("chunks", chunks), ("cp", cp)):
        whole_number(value, label)
    one_of(zero, (0, 1, 2, 3), "ZeRO stage")
    one_of(recompute, RECOMPUTE, "recompute")
    one_of(zero3_calls, ISSUERS, "zero3_calls")
    _check_model_split(model, tp, pp, chunks)
    if cp > 1 and model.seq % (2 * cp):
        raise DistUsageError(f"cp={cp} does not split the sequence of {model.seq} into 2·cp = {2 * cp} equal "
                             f"pieces: each context-parallel rank takes two (one early, one late: causal balance)")
    if gpus % (tp * cp * pp):
        names, sizes = ("tp × cp × pp", f"{tp} × {cp} × {pp}") if cp > 1 else ("tp × pp", f"{tp} × {pp}")
        raise DistUsageError(f"gpus ({gpus}) must be a multiple of {names} = {sizes} = {tp * cp * pp}: "
                             f"dp = gpus / ({names.replace(' × ', '·')}) must be whole")
    dp = gpus // (tp * cp * pp)
    if global_batch % (dp * microbatch):
        raise DistUsageError(f"global batch {global_batch} is not divisible by dp × microbatch = {dp} × "
                             f"{microbatch} = {dp * microbatch}: every replica runs whole micro-batches")
    s = Shape(gpus, tp, pp, dp, global_batch, microbatch, chunks, zero, recompute, bool(sequence_parallel),
              bool(flash_attention), cp, zero3_calls)
    _check_schedule(s)
    return s


def _check_model_split(model: GPT, tp: int, pp: int, chunks: int) -> None:
    if model.heads % tp:
        raise DistUsageError(f"tp={tp} does not divide heads={model.heads}: each tensor-parallel rank must hold "
                             f"whole attention heads")
    if model.groups % tp:
        raise DistUsageError(f"tp={tp} does not divide kv_heads={model.groups}: each tensor-parallel rank must hold "
                             f"whole key/value heads (Megatron-LM's query groups)")
    if model.ff % tp:
        raise DistUsageError(f"tp={tp} does not divide ff={model.ff}: the MLP's columns are split over tp")
    if pp > model.layers:
        raise DistUsageError(f"pp={pp} > layers={model.layers}: every pipeline stage needs at least one layer")
    if pp * chunks > model.layers:
        raise DistUsageError(f"pp × chunks = {pp} × {chunks} = {pp * chunks} > layers={model.layers}: every "
                             f"model chunk needs at least one layer")


def _check_schedule(s: Shape) -> None:
    """The pipeline schedule's own checks (nbdist.schedules: interleaving needs m divisible by p, ...)."""
    if s.pp == 1:
        if s.chunks > 1:
            raise DistUsageError(f"chunks={s.chunks} needs a pipeline: with pp=1 there is nothing to interleave")
        return
    from nbdist.schedules.generators import check_parameters

    check_parameters(s.schedule, s.pp, s.microbatches, s.chunks)


# -- where the groups sit ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """One group's placement: its members, the hosts it spans, the most members on one host, and its link's
    bandwidth per member (across hosts: the members on a host share that host's ports, one per accelerator)."""

    members: int
    hosts: int
    per_host: int
    link: Link
    bandwidth: float

    def all_reduce(self, size: float) -> float:
        """Ring all-reduce of `size` bytes: 2(n-1) steps, 2(n-1)/n·S bytes per member (cost/collectives.py)."""
        return all_reduce_seconds(size, self.members, self.link.latency, 1 / self.bandwidth)

    def gather(self, size: float) -> float:
        """Ring all-gather (or reduce-scatter) of a `size`-byte whole: n-1 steps, (n-1)/n·S bytes per member."""
        return all_gather_seconds(size, self.members, self.link.latency, 1 / self.bandwidth)

    def describe(self) -> str:
        where = "one host" if self.hosts == 1 else f"{self.hosts} hosts, {self.per_host} per host"
        return f"{self.members} ranks on {where}, {self.link.name}, {self.bandwidth / 1e9:.3g} GB/s"


def place(members: list[int], hw: Hardware) -> Placement:
    """Where the ranks `members` sit on `hw`'s hosts, and the bandwidth their collective gets per member."""
    return _placement(*_hosts(tuple(members), hw.gpus_per_host), hw)


def _hosts(members: tuple[int, ...], per_host_gpus: int) -> tuple[int, int, int]:
    """(members, hosts spanned, most members on one host)."""
    hosts: dict[int, int] = {}
    for rank in members:
        hosts[rank // per_host_gpus] = hosts.get(rank // per_host_gpus, 0) + 1
    return len(members), len(hosts), max(hosts.values())


def _placement(members: int, hosts: int, per_host: int, hw: Hardware) -> Placement:
    if hosts == 1:
        return Placement(members, 1, per_host, hw.intra_host, hw.intra_host.bandwidth)
    ports = min(hw.intra_host.bandwidth, per_host * hw.inter_host.bandwidth)
    return Placement(members, hosts, per_host, hw.inter_host, ports)


def groups(s: Shape, hw: Hardware) -> dict[str, Placement]:
    """Per kind (tp, cp, dp: the gradient-sync group of dp × cp ranks, and a pipeline neighbour pair), the
    placement of its slowest group: the one spanning most hosts with fewest members per host (tp = 6 on hosts of 8
    puts every other group across two hosts)."""
    worst = _worst_groups(s.tp, s.cp, s.dp, s.pp, hw.gpus_per_host)
    return {kind: _placement(*placed, hw) for kind, placed in worst.items()}


@lru_cache(maxsize=512)
def _worst_groups(t: int, c: int, d: int, p: int, per_host_gpus: int) -> dict[str, tuple[int, int, int]]:
    stage = t * c * d  # ranks per pipeline stage
    tp = [range(g * t, (g + 1) * t) for g in range(c * d * p)]
    cp = [[block + i + k * t for k in range(c)] for block in range(0, stage * p, t * c) for i in range(t)]
    dp = [[st * stage + k * t + i for k in range(c * d)] for st in range(p) for i in range(t)]
    pp = [[i, i + stage] for i in range(stage)] if p > 1 else [[0]]
    return {kind: max((_hosts(tuple(g), per_host_gpus) for g in kind_groups), key=lambda h: (h[1], -h[2]))
            for kind, kind_groups in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp))}

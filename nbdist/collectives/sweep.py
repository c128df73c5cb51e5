"""Every collective timed through torch.distributed and through MPI, with nccl-tests' algbw and busbw.

    result = nbdist.collectives.benchmark(sizes=[2**k for k in range(10, 27, 2)])
    result                      # a table: op, via, size, time, algbw, busbw, iterations, check
    result.figure()             # busbw against size, log-log, one line per (op, via)

Conventions are nccl-tests' (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), so figures can
be set beside theirs:
- S, the size of a row, is the whole buffer: the all-reduce's and broadcast's buffer, all-gather's *output*,
  reduce-scatter's *input*, all-to-all's send buffer. float32 elements.
- time t per operation: warm-up, a barrier, then a loop of `iters` back-to-back operations, t = loop time / iters;
  the slowest rank's t counts (nccl-tests' `-a 3`; its default averages over ranks, which hides a straggler).
- algbw = S / t, busbw = algbw × a factor that makes every operation comparable with the link's bandwidth: the
  bytes each rank must move per byte of S in the bandwidth-optimal algorithm. all_reduce 2(n-1)/n (a ring moves
  each byte out and back in), all_gather, reduce_scatter and all_to_all (n-1)/n, broadcast 1 (as nccl-tests'
  broadcast and reduce). GB/s are 1e9 bytes per second.

Two ways through the same ranks ("via"):
- "torch": torch.distributed with the process group's backend (gloo on CPU engines, nccl on GPUs).
- "mpi": mpi4py on CPU tensors' own memory (numpy views, no copies), the engines' MPI world.

gloo has no reduce-scatter of its own: torch (2.2 and later, 2.13 included) emulates `reduce_scatter_single` by
cloning the whole S-byte input, all-reducing it, and copying out the rank's chunk. It moves 2(n-1)/n·S where a
real reduce-scatter moves (n-1)/n·S, so its busbw comes out at about half of gloo's all-reduce busbw; those rows
carry a note saying so. An operation a backend does not support is reported as a row without a time, with the
backend's message as its note.

`ranks=k` times the ops on ranks 0..k-1 only (the others make the group with them, then wait): a 2-rank broadcast
is exactly one message, the α + β·S that the alpha-beta model (costmodel.py) prices every step with.

Iterations are chosen so that one timed loop lasts about `target_seconds` (0.1 s; small messages need thousands
of iterations to rise above the clock and the loop's own cost); every rank uses the same count (agreed with a
max-reduction), since a collective must be called equally often everywhere.

This module is the notebook's side: it validates the request (before any collective starts), sends the timed loops
of nbdist/collectives/ranks/collective_timing.py to the ranks and makes rows of their reports. The ops and their buffers
are plain data (nbdist/collectives/ops.py), read on both sides.
"""
from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from nbdist.checks import is_whole, one_of, positive_seconds, whole_number
from nbdist.collectives.ops import CHUNKED, ELEMENT_BYTES, OPS, VIAS
from nbdist.collectives.replies import Timed
from nbdist.errors import DistError, DistUsageError
from nbdist.units import format_bytes

DEFAULT_SIZES = tuple(2**k for k in range(10, 27, 2))  # 1 KiB, 4 KiB, ..., 64 MiB
TARGET_SECONDS = 0.1  # one timed loop lasts about this long (between 50 and 200 ms)


def busbw_factor(op: str, ranks: int) -> float:
    """busbw / algbw for `op` on `ranks` ranks (nccl-tests' factors; see the module docstring for why)."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in CHUNKED:
        return (ranks - 1) / ranks
    if op == "broadcast":
        return 1.0
    raise DistUsageError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


# -- the notebook side ------------------------------------------------------------------------------------------


def benchmark(
    ops: str | Iterable[str] = OPS,
    sizes: int | Iterable[int] = DEFAULT_SIZES,
    via: str | Iterable[str] = VIAS,
    cluster=None,
    iters: int | None = None,
    warmup: int = 5,
    check: bool = True,
    *,
    target_seconds: float = TARGET_SECONDS,
    ranks: int | None = None,
) -> "BenchmarkResult":
    """Time every op at every size (bytes, S as nccl-tests defines it) through every `via` on the cluster's ranks.

    iters: operations per timed loop; None chooses them so that a loop takes about `target_seconds`.
    warmup: untimed operations first (connections, buffers and caches settle).
    check: run each operation once on rank-dependent values and compare the result exactly (a wrong result raises
    DistError naming op, via and size); the timing is done afterwards on zeroed buffers.
    ranks: time the ops among ranks 0..ranks-1 only (default: all of the cluster's ranks).
    Everything is validated here, before any collective starts: a bad request raises DistUsageError and leaves
    no rank waiting in a collective.
    """
    from nbdist.cluster.api import current
    from nbdist.collectives.ranks import (
        collective_timing,  # sent to the engines by reference: they import it themselves
    )

    cluster = cluster or current()
    ops, vias, sizes = _parse(ops, OPS, "op"), _parse(via, VIAS, "via"), _parse_sizes(sizes)
    n = _parse_ranks(ranks, cluster.world_size)
    _check_sizes(ops, sizes, n)
    _check_counts(iters, warmup, target_seconds)
    if "mpi" in vias:
        _require_mpi_world(cluster, collective_timing.mpi_world)
    rows = []
    for op in ops:
        for size in sizes:
            for v in vias:  # torch and MPI side by side at each size: the same moment of a noisy machine
                per_rank = cluster.run(collective_timing.measure, op, v, size, iters, warmup, check,
                                       target_seconds, n)
                rows.append(_row(op, v, size, n, check, per_rank[:n]))
    return BenchmarkResult(rows)


def _parse(value: str | Iterable[str], allowed: tuple[str, ...], what: str) -> list[str]:
    chosen = [value] if isinstance(value, str) else list(value)
    if not chosen:
        raise DistUsageError(f"no {what} given: choose {', '.join(allowed)}")
    return list(dict.fromkeys(one_of(item, allowed, what) for item in chosen))


def _parse_ranks(ranks: int | None, world_size: int) -> int:
    if ranks is None:
        return world_size
    if not is_whole(ranks) or not 1 <= ranks <= world_size:
        raise DistUsageError(f"ranks must be a whole number from 1 to {world_size} (the cluster's ranks), "
                             f"got {ranks!r}")
    return ranks


def _parse_sizes(sizes: int | Iterable[int]) -> list[int]:
    chosen = list(sizes) if isinstance(sizes, Iterable) and not isinstance(sizes, str) else [sizes]
    if not chosen:
        raise DistUsageError("no sizes given: pass sizes in bytes, e.g. sizes=[1024, 2**20]")
    for size in chosen:
        if not is_whole(size) or size <= 0:
            raise DistUsageError(f"sizes must be positive whole numbers of bytes, got {size!r}")
    return sorted(set(chosen))


def _check_sizes(ops: list[str], sizes: list[int], n: int) -> None:
    """float32 buffers, and one equal chunk per rank for the ops that split S."""
    for size in sizes:
        if size % ELEMENT_BYTES:
            raise DistUsageError(f"size {size} bytes is not a whole number of float32 elements (a multiple of 4)")
        chunked = [op for op in ops if op in CHUNKED]
        if chunked and size % (n * ELEMENT_BYTES):
            raise DistUsageError(
                f"size {size} bytes: {chunked[0]} needs one equal float32 chunk per rank, so a multiple of "
                f"world size × 4 = {n * ELEMENT_BYTES} bytes"
            )


def _check_counts(iters: int | None, warmup: int, target_seconds: float) -> None:
    if iters is not None:
        whole_number(iters, "iters (or None: chosen for you)")
    whole_number(warmup, "warmup", minimum=0)
    positive_seconds(target_seconds, "target_seconds")


def _require_mpi_world(cluster, mpi_world) -> None:
    """via="mpi" needs mpi4py on every engine and one MPI world whose ranks are torch.distributed's ranks
    (`mpi_world`: the engines' report of both)."""
    worlds = cluster.run(mpi_world)
    for rank, world in enumerate(worlds):
        if world.problem:
            raise DistUsageError(f"via='mpi' is not possible: rank {rank}: {world.problem}")
        if (world.mpi_rank, world.mpi_size) != (world.torch_rank, world.torch_size):
            raise DistUsageError(
                f"via='mpi' needs the engines to form one MPI world matching torch.distributed, but rank {rank} is "
                f"MPI rank {world.mpi_rank} of {world.mpi_size} and torch rank {world.torch_rank} of "
                f"{world.torch_size}"
            )


def _row(op: str, via: str, size: int, n: int, check: bool, per_rank: list[Timed]) -> dict:
    """One table row from every rank's report; a wrong result on any rank raises DistError."""
    for report in per_rank:
        if report.wrong:
            raise DistError(f"{op} via {via} at {size} bytes gave a wrong result: rank {report.rank}: "
                            f"{report.wrong}")
    first = per_rank[0]
    row = {"op": op, "via": via, "size_bytes": size, "seconds": None, "algbw": None, "busbw": None, "ranks": n,
           "checked": False, "iters": first.iters, "backend": first.backend, "note": first.note}
    if first.unsupported:
        return row
    seconds = max(report.seconds for report in per_rank)  # the slowest rank's time per operation
    algbw = size / seconds / 1e9
    row.update(seconds=seconds, algbw=algbw, busbw=algbw * busbw_factor(op, n), checked=check)
    return row


# -- the result ---------------------------------------------------------------------------------------------------


class BenchmarkResult(Sequence):
    """The rows of a benchmark (dicts: op, via, size_bytes, seconds, algbw, busbw, ranks, checked, iters, backend,
    note); a list to code, a table to people (text and HTML), a figure on request."""

    HEADER = ("op", "via", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "iters", "check")

    def __init__(self, rows: Iterable[dict]):
        self.rows: list[dict] = list(rows)

    def __getitem__(self, index):
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def to_dicts(self) -> list[dict]:
        """The rows as plain dicts (copies: JSON, pandas.DataFrame)."""
        return [dict(row) for row in self.rows]

    def select(self, op: str | None = None, via: str | None = None) -> "BenchmarkResult":
        """The rows of one op and/or one via."""
        return BenchmarkResult(r for r in self.rows if op in (None, r["op"]) and via in (None, r["via"]))

    def figure(self, title: str | None = None):
        """busbw against size, log-log, one line per (op, via): torch solid, MPI dashed."""
        from nbdist.viz.collectives import busbw_figure

        return busbw_figure(self.rows, title=title)

    def fit(self, op: str = "all_reduce", via: str = "torch"):
        """The alpha-beta model of one op through one via (see nbdist.collectives.costmodel.fit_alpha_beta)."""
        from nbdist.collectives.costmodel import fit_alpha_beta

        return fit_alpha_beta(self.rows, op=op, via=via)

    # -- text and HTML

    def _notes(self) -> list[str]:
        return list(dict.fromkeys(r["note"] for r in self.rows if r.get("note")))

    def _cells(self, row: dict) -> list[str]:
        notes = self._notes()
        mark = f" [{notes.index(row['note']) + 1}]" if row.get("note") else ""
        via = f"{row['via']} ({row['backend']})" if row.get("backend") else row["via"]
        if row["seconds"] is None:
            return [row["op"], via, format_bytes(row["size_bytes"]), "-", "-", "-", "-", "not run" + mark]
        check = ("ok" if row["checked"] else "off") + mark
        return [row["op"], via, format_bytes(row["size_bytes"]), f"{row['seconds'] * 1e6:.1f}",
                f"{row['algbw']:.3f}", f"{row['busbw']:.3f}", str(row["iters"]), check]

    def _footer(self) -> list[str]:
        ranks = {r["ranks"] for r in self.rows}
        lines = [f"{', '.join(map(str, sorted(ranks)))} ranks; time = slowest rank's loop / iters; "
                 "busbw = algbw × 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all), "
                 "1 (broadcast)"] if ranks else []
        return lines + [f"[{i}] {note}" for i, note in enumerate(self._notes(), 1)]

    def table(self) -> str:
        table = [list(self.HEADER)] + [self._cells(r) for r in self.rows]
        widths = [max(len(cell) for cell in column) for column in zip(*table)]
        right = {3, 4, 5, 6}  # numbers line up on the right
        lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 .rstrip() for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + self._footer())

    def _repr_html_(self) -> str:
        def tr(cells: list[str], tag: str) -> str:
            return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

        body = tr(list(self.HEADER), "th") + "".join(tr(self._cells(r), "td") for r in self.rows)
        return f"<table>{body}</table>" + "".join(f"<p>{html.escape(line)}</p>" for line in self._footer())

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return self.table()

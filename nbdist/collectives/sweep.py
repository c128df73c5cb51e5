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

The functions whose names start with `_engine` run ON the engines; they import what they need inside (so that
the notebook kernel needs neither mpi4py nor a process group to import this module).
"""
from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from nbdist.errors import DistError, DistUsageError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
VIAS = ("torch", "mpi")
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all")  # ops that split S into one equal chunk per rank
DEFAULT_SIZES = tuple(2**k for k in range(10, 27, 2))  # 1 KiB, 4 KiB, ..., 64 MiB
ELEMENT_BYTES = 4  # float32
TARGET_SECONDS = 0.1  # one timed loop lasts about this long (between 50 and 200 ms)
MAX_ITERS = 1_000_000
CALIBRATE_SECONDS = 0.005  # a calibration loop shorter than this is too close to the clock to trust
ROOT = 0  # broadcast's root

GLOO_REDUCE_SCATTER_NOTE = (
    "gloo has no reduce-scatter: torch clones the input, all-reduces all S bytes and keeps this rank's chunk "
    "(moves 2(n-1)/n·S, not (n-1)/n·S: busbw about half of all_reduce's)"
)


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
    from nbdist.cluster import current

    cluster = cluster or current()
    ops, vias, sizes = _parse(ops, OPS, "op"), _parse(via, VIAS, "via"), _parse_sizes(sizes)
    n = _parse_ranks(ranks, cluster.world_size)
    _check_sizes(ops, sizes, n)
    _check_counts(iters, warmup, target_seconds)
    if "mpi" in vias:
        _require_mpi_world(cluster)
    rows = []
    for op in ops:
        for size in sizes:
            for v in vias:  # torch and MPI side by side at each size: the same moment of a noisy machine
                per_rank = cluster.run(_engine_measure, op, v, size, iters, warmup, check, target_seconds, n)
                rows.append(_row(op, v, size, n, check, per_rank[:n]))
    return BenchmarkResult(rows)


def _parse(value: str | Iterable[str], allowed: tuple[str, ...], what: str) -> list[str]:
    chosen = [value] if isinstance(value, str) else list(value)
    if not chosen:
        raise DistUsageError(f"no {what} given: choose from {', '.join(allowed)}")
    for item in chosen:
        if item not in allowed:
            raise DistUsageError(f"unknown {what} {item!r}: choose from {', '.join(allowed)}")
    return list(dict.fromkeys(chosen))


def _parse_ranks(ranks: int | None, world_size: int) -> int:
    if ranks is None:
        return world_size
    if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= world_size:
        raise DistUsageError(f"ranks must be a whole number from 1 to {world_size} (the cluster's ranks), "
                             f"got {ranks!r}")
    return ranks


def _parse_sizes(sizes: int | Iterable[int]) -> list[int]:
    chosen = list(sizes) if isinstance(sizes, Iterable) and not isinstance(sizes, str) else [sizes]
    if not chosen:
        raise DistUsageError("no sizes given: pass sizes in bytes, e.g. sizes=[1024, 2**20]")
    for size in chosen:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
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
    if iters is not None and (not isinstance(iters, int) or isinstance(iters, bool) or iters < 1):
        raise DistUsageError(f"iters must be a positive whole number or None (chosen for you), got {iters!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise DistUsageError(f"warmup must be a whole number >= 0, got {warmup!r}")
    if not isinstance(target_seconds, (int, float)) or not target_seconds > 0:
        raise DistUsageError(f"target_seconds must be a positive number, got {target_seconds!r}")


def _require_mpi_world(cluster) -> None:
    """via="mpi" needs mpi4py on every engine and one MPI world whose ranks are torch.distributed's ranks."""
    worlds = cluster.run(_engine_mpi_world)
    for rank, world in enumerate(worlds):
        if world.get("problem"):
            raise DistUsageError(f"via='mpi' is not possible: rank {rank}: {world['problem']}")
        if (world["mpi_rank"], world["mpi_size"]) != (world["torch_rank"], world["torch_size"]):
            raise DistUsageError(
                f"via='mpi' needs the engines to form one MPI world matching torch.distributed, but rank {rank} is "
                f"MPI rank {world['mpi_rank']} of {world['mpi_size']} and torch rank {world['torch_rank']} of "
                f"{world['torch_size']}"
            )


def _row(op: str, via: str, size: int, n: int, check: bool, per_rank: list[dict]) -> dict:
    """One table row from every rank's report; a wrong result on any rank raises DistError."""
    for report in per_rank:
        if report.get("error"):
            raise DistError(f"{op} via {via} at {size} bytes gave a wrong result: rank {report['rank']}: "
                            f"{report['error']}")
    row = {"op": op, "via": via, "size_bytes": size, "seconds": None, "algbw": None, "busbw": None, "ranks": n,
           "checked": False, "iters": per_rank[0].get("iters"), "backend": per_rank[0]["backend"],
           "note": per_rank[0].get("note", "")}
    if per_rank[0].get("unsupported"):
        return row
    seconds = max(report["seconds"] for report in per_rank)  # the slowest rank's time per operation
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


def format_bytes(size: float) -> str:
    """1024 -> '1 KiB', 4194304 -> '4 MiB', 1000 -> '1000 B', 1536 -> '1.5 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{size:.0f} B"


# -- the engine side ----------------------------------------------------------------------------------------------
# Run on the engines (imported there by reference: nbdist is installed on them). Every rank makes the same calls
# in the same order, whatever its data: a collective called on some ranks only would wait forever.


def _engine_mpi_world() -> dict:
    """Whether this engine can use MPI for the benchmark: its MPI rank and size beside torch.distributed's."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {"problem": "torch.distributed is not initialised on this engine"}
    world = {"torch_rank": dist.get_rank(), "torch_size": dist.get_world_size()}
    try:
        from mpi4py import MPI
    except ImportError as e:
        return {**world, "problem": f"mpi4py cannot be imported on the engines ({e})"}
    return {**world, "mpi_rank": MPI.COMM_WORLD.Get_rank(), "mpi_size": MPI.COMM_WORLD.Get_size()}


def _engine_measure(op: str, via: str, size: int, iters: int | None, warmup: int, check: bool,
                    target_seconds: float, members: int | None = None) -> dict | None:
    """Check (optional), warm up, calibrate and time `op` through `via` on S = `size` bytes among ranks
    0..members-1 (default: all); seconds per op. None on a rank outside them."""
    import torch.distributed as dist

    members = members or dist.get_world_size()
    group, comm = _engine_group(members, via)  # collective: every rank makes them, members or not
    if dist.get_rank() >= members:
        return None
    try:
        return _engine_time(_Collective(op, via, size, members, dist.get_rank(), group, comm), iters, warmup, check,
                            target_seconds)
    finally:
        if comm is not None and members < dist.get_world_size():
            comm.Free()


def _engine_group(members: int, via: str):
    """(torch.distributed group, MPI communicator) of ranks 0..members-1; (None, COMM_WORLD) for everyone. The MPI
    communicator is made only for via="mpi" (a collective of MPI.COMM_WORLD) and is None for the others."""
    import torch.distributed as dist

    from nbdist.collectives.algorithms import _group  # the one cache of rank groups (made once per size)

    group = _group(members)
    if via != "mpi":
        return group, None
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if members == world.Get_size():
        return group, world
    inside = dist.get_rank() < members
    comm = world.Split(0 if inside else MPI.UNDEFINED, world.Get_rank())
    return group, comm if inside else None


def _engine_time(bench: "_Collective", iters: int | None, warmup: int, check: bool, target_seconds: float) -> dict:
    """This rank's report for one collective: checked (optional), warmed up, calibrated, timed."""
    report = {"rank": bench.rank, "backend": bench.backend, "note": bench.note}
    try:  # a backend without this op says so on the first call, on every rank alike
        error = _engine_first_call(bench, check)
    except RuntimeError as e:
        if "support" not in str(e):
            raise
        return {**report, "unsupported": True, "note": f"{bench.backend}: {str(e).splitlines()[0]}"}
    bench.zero()
    for _ in range(warmup):
        bench.call()
    count = iters or _engine_calibrate(bench, target_seconds)
    bench.barrier()
    seconds = bench.timed(count) / count
    return {**report, "seconds": seconds, "iters": count, "error": error}


def _engine_first_call(bench: "_Collective", check: bool) -> str | None:
    """With check, run the op once on rank-dependent values: None if the result is exactly right, else what is
    wrong. Without, just call it once."""
    if check:
        bench.fill()
    bench.call()
    return bench.verify() if check else None


def _engine_calibrate(bench: "_Collective", target_seconds: float) -> int:
    """Iterations for a loop of about target_seconds, the same on every rank: loops of k = 1, 10, 100, ... until
    one lasts long enough to measure (slowest rank's time), then scale."""
    k = 1
    while True:
        bench.barrier()
        elapsed = bench.agree_max(bench.timed(k))
        if elapsed >= min(CALIBRATE_SECONDS, target_seconds / 2) or k >= MAX_ITERS:
            return max(1, min(MAX_ITERS, round(target_seconds * k / elapsed)))
        k = min(MAX_ITERS, k * 10)


def _fill_values(count: int, rank: int, start: int = 0):
    """Rank-dependent, position-dependent float32 integers: (i mod 251) + 256(rank + 1) for i from start.
    Sums over up to a few hundred ranks stay exact in float32 (below 2**24)."""
    import torch

    i = torch.arange(start, start + count, dtype=torch.int64)
    return ((i % 251) + 256 * (rank + 1)).to(torch.float32)


class _Collective:
    """One op, one via, one size, on this rank: buffers, the call, its expected result (runs on an engine)."""

    def __init__(self, op: str, via: str, size: int, n: int, rank: int, group=None, comm=None):
        import torch
        import torch.distributed as dist

        self.op, self.via, self.n, self.rank = op, via, n, rank
        self.group, self.comm = group, comm  # torch group (None: the default one), MPI communicator (via="mpi")
        self.count = size // ELEMENT_BYTES
        self.chunk = self.count // n
        backend = dist.get_backend(group)
        cuda = via == "torch" and backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.backend = backend if via == "torch" else _mpi_library()
        self.note = GLOO_REDUCE_SCATTER_NOTE if (via, backend, op) == ("torch", "gloo", "reduce_scatter") else ""
        send, recv = {"all_reduce": (self.count, 0), "broadcast": (self.count, 0),
                      "all_gather": (self.chunk, self.count), "reduce_scatter": (self.count, self.chunk),
                      "all_to_all": (self.count, self.count)}[op]
        self.send = torch.zeros(send, device=self.device)
        self.recv = torch.zeros(recv, device=self.device) if recv else self.send  # in place when no output
        self.call = self._torch_call() if via == "torch" else self._mpi_call()

    # -- the call

    def _torch_call(self):
        import torch.distributed as dist

        from nbdist.collectives.compat import all_gather_single, reduce_scatter_single

        send, recv, group = self.send, self.recv, self.group
        return {
            "all_reduce": lambda: dist.all_reduce(send, group=group),
            "all_gather": lambda: all_gather_single(recv, send, group=group),
            "reduce_scatter": lambda: reduce_scatter_single(recv, send, group=group),
            "broadcast": lambda: dist.broadcast(send, src=ROOT, group=group),  # ROOT = 0 is in every group here
            "all_to_all": lambda: dist.all_to_all_single(recv, send, group=group),
        }[self.op]

    def _mpi_call(self):
        from mpi4py import MPI

        comm = self.comm
        send, recv = self.send.numpy(), self.recv.numpy()  # views of the tensors' memory, not copies
        return {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM),
            "all_gather": lambda: comm.Allgather(send, recv),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(send, root=ROOT),
            "all_to_all": lambda: comm.Alltoall(send, recv),
        }[self.op]

    # -- timing

    def barrier(self) -> None:
        """The barrier of the way being measured (gloo's or MPI's), then the GPU idle, so that all start together."""
        if self.via == "torch":
            import torch.distributed as dist

            dist.barrier(group=self.group)
        else:
            self.comm.Barrier()
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def timed(self, k: int) -> float:
        """Seconds for k back-to-back calls on this rank (waiting for the GPU at the end, as nccl-tests does)."""
        import time

        call = self.call
        started = time.perf_counter()
        for _ in range(k):
            call()
        self._sync()
        return time.perf_counter() - started

    def agree_max(self, value: float) -> float:
        """The largest of every rank's value (torch.distributed: present on every engine, whatever the via)."""
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    # -- checking

    def zero(self) -> None:
        """Timing runs on zeros: an all-reduce repeated in place on them stays zero (no overflow to inf)."""
        self.send.zero_()
        self.recv.zero_()

    def fill(self) -> None:
        """Inputs for the check; outputs set to -1, so that an output left unwritten shows."""
        if self.op == "broadcast" and self.rank != ROOT:
            self.send.fill_(-1)
        else:
            self.send.copy_(_fill_values(self.send.numel(), self.rank))
        if self.recv is not self.send:
            self.recv.fill_(-1)

    def expected(self):
        """What every rank must hold after one call on `fill`'s values."""
        import torch

        n, chunk = self.n, self.chunk
        if self.op == "all_reduce":
            return sum(_fill_values(self.count, r) for r in range(n))
        if self.op == "broadcast":
            return _fill_values(self.count, ROOT)
        if self.op == "all_gather":
            return torch.cat([_fill_values(chunk, r) for r in range(n)])
        if self.op == "reduce_scatter":
            return sum(_fill_values(chunk, r, start=self.rank * chunk) for r in range(n))
        return torch.cat([_fill_values(chunk, r, start=self.rank * chunk) for r in range(n)])  # all_to_all

    def verify(self) -> str | None:
        got, want = self.recv.cpu(), self.expected()
        if got.shape == want.shape and bool((got == want).all()):
            return None
        wrong = (got != want).nonzero()
        if got.shape != want.shape or wrong.numel() == 0:
            return f"output has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        i = int(wrong[0])
        return f"element {i} of {got.numel()} is {got[i].item():g}, expected {want[i].item():g} ({wrong.numel()} wrong)"


def _mpi_library() -> str:
    """'MPICH 5.0.2', 'Open MPI v5.0.3', ...: the MPI shown in the via column."""
    from mpi4py import MPI

    first = (MPI.Get_library_version().strip().splitlines() or ["MPI"])[0]
    if "Version:" in first:  # MPICH and its derivatives: "MPICH Version:      5.0.2"
        name, _, version = first.partition("Version:")
        return f"{name.strip()} {version.strip()}"
    return first.split(",")[0].strip() or "MPI"  # Open MPI: "Open MPI v5.0.3, package: ..."

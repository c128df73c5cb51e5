"""Ranks agree on a collective before its result is taken: the same call, element count and dtype (runs ON the
engines).

MPI trusts its callers: when ranks disagree on a collective's size, MPICH returns without an error and the result
is wrong (tried with 4 ranks, rank 0 all-reducing 4 elements and ranks 1-3 eight: rank 0 got [4, 4, 4, 4], the
others [4, 4, 4, 4, 3, 3, 3, 3]); when they disagree on the call itself (one rank in all_reduce, another in
broadcast) MPI's behaviour is undefined. gloo checks sizes in its own protocol. So every collective of the mpi4py
backend also gathers, from every rank of its group, six numbers: which call, how many elements, which dtype,
which reduction (or root), whether counts must be equal, and the output elements (all_gather's list form). Equal
everywhere: the operation's result is taken. Not: every rank raises the same line naming the ranks and what each
brought.

Cost: one non-blocking all-gather of 48 bytes per rank and call, posted just before the operation's data so that
both travel at once (MpiProcessGroup._start), and looked at first by whoever waits: it about doubles a small
all-reduce's MPI part (bench_mpi_backend.py's breakdown; figures: benchmarks/README.md). When the
ranks disagree, the data's result is dropped (MPI never writes past a buffer's count, so no memory is harmed)
and, if MPI could not complete it, the group is marked out of step until renewed (nbdist renews its groups after
a failed cell).
"""
from __future__ import annotations

import struct

import numpy as np
import torch
import torch.distributed as dist

from nbdist.backend.ranks import mpi_data as data

CALLS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
         "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "all_to_all",
         "all_to_all_single", "barrier")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
          torch.bool)
NO_DTYPE = -1
ANY = -2  # no reduction or root to compare; no output total to show
_CALL_CODES = {call: i for i, call in enumerate(CALLS)}
ALL_REDUCE, SUM = _CALL_CODES["all_reduce"], int(dist.ReduceOp.RedOpType.SUM.value)
_pack = struct.Struct("=6q").pack_into  # the six numbers into an int64 array, without numpy's per-item work
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(DTYPES)}


class Agreement:
    """One call's check: this rank's six numbers and everyone's, and the all-gather that brings them."""

    __slots__ = ("mine", "everyone", "request", "same_count")

    def __init__(self, comm, call: str, count: int, dtype: torch.dtype | None, detail: int = ANY,
                 same_count: bool = True, outputs: int = ANY, buffers: tuple | None = None, request=None):
        """Post the all-gather. Counts may differ where each rank brings its own share (all_gather's list form,
        gather, scatter, all_to_all): then `detail` carries what must still be equal (a code of the output sizes
        every rank expects), `outputs` their total, which the line shows. `buffers`: (mine, everyone) to reuse
        (a group's own, for calls completed before the next begins), else new ones."""
        self.same_count = same_count
        self.mine, self.everyone = buffers or self.new_buffers(comm.size)
        if request is not None:  # posted already (MpiProcessGroup's hot path), with these buffers
            self.request = request
            return
        _pack(self.mine, 0, _CALL_CODES[call], count, _DTYPE_CODES.get(dtype, NO_DTYPE), detail, same_count, outputs)
        self.request = comm.Iallgather(self.mine, self.everyone)

    @staticmethod
    def new_buffers(size: int) -> tuple:
        return np.empty(6, dtype=np.int64), np.empty((size, 6), dtype=np.int64)

    def counts(self) -> list[int]:
        return self.everyone[:, 1].tolist()

    def disagreement(self, global_ranks: list[int]) -> str | None:
        """None when every rank brought the same numbers (counts only where they must be equal); else what each
        rank brought."""
        rows = self.everyone
        if self.same_count and rows.tobytes() == self.mine.tobytes() * len(rows):  # the common case, cheaply
            return None
        compared = rows if rows[0, 4] else rows[:, [0, 2, 3, 4, 5]]
        if (compared == compared[0]).all():
            return None
        said: dict[str, list[int]] = {}
        for row, rank in zip(rows.tolist(), global_ranks):
            said.setdefault(_describe(row), []).append(rank)
        return "; ".join(f"{_ranks(ranks)} {what}" for what, ranks in said.items())

    def buffers(self) -> tuple:
        return self.mine, self.everyone


class Planned:
    """An operation ready to go: what its ranks must agree on, how to post its data, and what it returns.
    `expected`: where each rank brings its own share into outputs every rank holds (all_gather's list form), the
    elements each rank's share must have; the agreement then compares a code of it, not the counts."""

    __slots__ = ("call", "count", "dtype", "detail", "post", "outputs_list", "finish", "buffers", "same_count",
                 "outputs", "expected")

    def __init__(self, call: str, count: int, dtype, detail: int, post, outputs_list: list, finish=None,
                 buffers: tuple = (), same_count: bool = True, expected: list[int] | None = None):
        self.call, self.count, self.dtype, self.detail = call, count, dtype, detail
        self.post, self.outputs_list, self.finish, self.buffers = post, outputs_list, finish, buffers
        self.same_count, self.expected, self.outputs = same_count, expected, ANY
        if expected is not None:
            self.same_count, self.detail, self.outputs = False, sizes_code(expected), sum(expected)

    @staticmethod
    def joined(parts: list[Planned], outputs_list: list | None = None, call: str = "all_reduce_coalesced") -> Planned:
        """The operations of one coalesced call, agreed on as one (counts and shares summed) and posted together."""
        if not parts:
            return Planned(call, 0, None, ANY, lambda: [], outputs_list or [])
        first = parts[0]
        expected = None
        if all(p.expected is not None for p in parts):
            expected = [sum(share) for share in zip(*(p.expected for p in parts))]
        return Planned(first.call, sum(p.count for p in parts), one_dtype(p.dtype for p in parts), first.detail,
                       lambda: [r for p in parts for r in p.post()],
                       outputs_list if outputs_list is not None else [t for p in parts for t in p.outputs_list],
                       data.all_of(p.finish for p in parts), tuple(b for p in parts for b in p.buffers),
                       same_count=all(p.same_count for p in parts), expected=expected)


def one_dtype(items) -> torch.dtype | None:
    """The dtype shared by tensors (or dtypes), None if they have several (the line then says 'mixed-dtype')."""
    found = {getattr(item, "dtype", item) for item in items}
    return found.pop() if len(found) == 1 else None


class SumAgreement:
    """The agreement of the hot path, a waited-for all_reduce SUM, with buffers of its own: what this rank brings
    stays packed from one call to the next (a training loop sums the same sizes over and over), and so does what
    every rank must then have brought."""

    def __init__(self, size: int):
        self.buffers = Agreement.new_buffers(size)
        self._size, self.packed, self._expected = size, None, b""

    def post(self, comm, count: int, dtype: torch.dtype):
        """Post the agreement of a sum of `count` elements of `dtype`; returns the request."""
        mine, everyone = self.buffers
        if self.packed != (count, dtype):  # a new tuple per size: the flight recorder's run key (recorder.py)
            _pack(mine, 0, ALL_REDUCE, count, _DTYPE_CODES.get(dtype, NO_DTYPE), SUM, 1, ANY)
            self.packed, self._expected = (count, dtype), mine.tobytes() * self._size
        return comm.Iallgather(mine, everyone)

    def agreed(self) -> bool:
        """Whether every rank brought what this one did (the agreement complete)."""
        return self.buffers[1].tobytes() == self._expected


def sizes_code(sizes: list[int]) -> int:
    """A number that differs (as good as surely) when the list of sizes does."""
    return hash(tuple(sizes)) & 0x7FFFFFFFFFFFFFFF


def reduction_code(op) -> int:
    """A reduction as a number both sides compare (ReduceOp or its type)."""
    kind = op if isinstance(op, dist.ReduceOp.RedOpType) else op.op  # a RedOpType passes isinstance(ReduceOp) too
    return int(kind.value)


def _describe(row: list[int]) -> str:
    call, count, dtype, detail, same_count, outputs = row
    name = CALLS[call] if 0 <= call < len(CALLS) else f"call {call}"
    if name == "barrier":
        return "called barrier"
    kind = str(DTYPES[dtype]).removeprefix("torch.") if 0 <= dtype < len(DTYPES) else "mixed-dtype"
    what = f"called {name} with {count} {kind} element{'s' * (count != 1)}"
    if not same_count and outputs != ANY:
        what += f" into outputs of {outputs} in all"
    elif detail != ANY and same_count:
        what += f" ({_detail(name, detail)})"
    elif detail != ANY:
        what += f" (root {detail})"
    return what


def _detail(name: str, detail: int) -> str:
    if name == "reduce":
        return f"{_reduction_name(detail % 64)}, root {detail // 64}"
    if name in ("broadcast", "gather", "scatter"):
        return f"root {detail}"
    return _reduction_name(detail)


def _reduction_name(value: int) -> str:
    for kind in dist.ReduceOp.RedOpType.__members__.values():
        if int(kind.value) == value:
            return kind.name
    return f"op {value}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))

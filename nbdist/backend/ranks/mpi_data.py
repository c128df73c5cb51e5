"""Tensors as MPI buffers for the mpi4py process group (runs ON the engines): byte views, datatypes, staging.

Why buffers are made from addresses: `MPI.buffer.fromaddress(tensor.data_ptr(), nbytes)` costs a fraction of a
microsecond and works for every dtype, where `tensor.numpy()` builds a numpy array per call (slower) and fails
for bfloat16 (numpy has none). The tensor itself must stay alive until MPI is done with it: the Work object keeps
it (nbdist/backend/ranks/mpi_work.py).

Moving data (broadcast, gathers, scatters, all-to-all, send/recv) goes as bytes, so any dtype moves unchanged.
Reductions need MPI's datatype: `Reduction` picks it, stages float16 / bfloat16 through float32 (MPI has no
bfloat16, and MPICH's float16 is an extension), stages non-contiguous tensors through contiguous copies, and
says what to do once MPI is done (divide for AVG, copy back).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI

from nbdist.errors import DistUsageError

IN_PLACE, MPI_SUM = MPI.IN_PLACE, MPI.SUM
_address = MPI.buffer.fromaddress
_RedOp = dist.ReduceOp.RedOpType

DATATYPES = {
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX, torch.int8: MPI.INT8_T, torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.uint8: MPI.UINT8_T, torch.uint16: MPI.UINT16_T,
    torch.uint32: MPI.UINT32_T, torch.uint64: MPI.UINT64_T, torch.bool: MPI.C_BOOL,
}
WIDENED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # reduced through this dtype
OPS = {_RedOp.SUM: MPI.SUM, _RedOp.AVG: MPI.SUM, _RedOp.PRODUCT: MPI.PROD, _RedOp.MIN: MPI.MIN,
       _RedOp.MAX: MPI.MAX, _RedOp.BAND: MPI.BAND, _RedOp.BOR: MPI.BOR, _RedOp.BXOR: MPI.BXOR}
BOOL_OPS = {_RedOp.SUM: MPI.LOR, _RedOp.MAX: MPI.LOR, _RedOp.BOR: MPI.LOR, _RedOp.PRODUCT: MPI.LAND,
            _RedOp.MIN: MPI.LAND, _RedOp.BAND: MPI.LAND, _RedOp.BXOR: MPI.LXOR}  # what torch does on bools


# -- buffers -------------------------------------------------------------------------------------------------------


def raw(tensor: torch.Tensor) -> list:
    """A contiguous tensor's bytes as an MPI buffer."""
    return [_address(tensor.data_ptr(), tensor.nbytes), MPI.BYTE]


def typed(tensor: torch.Tensor, count: int | None = None) -> list:
    """A contiguous tensor of a dtype in DATATYPES as an MPI buffer of that datatype (`count`: mpi4py's count
    where it means a block, as in reduce_scatter_block)."""
    return [_address(tensor.data_ptr(), tensor.nbytes), tensor.numel() if count is None else count,
            DATATYPES[tensor.dtype]]


_SUMMABLE: dict = {}  # (address, bytes, dtype) -> typed()'s buffer spec (it holds nothing but those), or None
SUMMABLE_KEPT = 512


def summable(tensor: torch.Tensor) -> list | None:
    """typed(tensor) where MPI can sum a contiguous `tensor` where it lies (a dtype MPI reduces), else None; made
    once per memory and dtype: a training loop sums the same tensors (gradients, buckets) over and over, and making
    an MPI buffer object costs about as much as the rest of a small call's checks."""
    key = (tensor.data_ptr(), tensor.nbytes, tensor.dtype)
    try:
        return _SUMMABLE[key]
    except KeyError:
        if len(_SUMMABLE) >= SUMMABLE_KEPT:
            _SUMMABLE.clear()
        spec = _SUMMABLE[key] = typed(tensor) if direct(tensor) else None
        return spec


def direct(tensor: torch.Tensor) -> bool:
    """Whether MPI can reduce this tensor where it lies (contiguous, a dtype MPI reduces)."""
    return tensor.is_contiguous() and tensor.dtype in DATATYPES and tensor.dtype != torch.bool


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def gather_source(send: torch.Tensor, out: torch.Tensor, rank: int) -> torch.Tensor | None:
    """What an all-gather into `out` sends: None (MPI_IN_PLACE) when `send` already is this rank's slot of `out`
    (FSDP2 gathers that way; MPI refuses aliased buffers otherwise), a copy when it overlaps `out` elsewhere."""
    start, end = send.data_ptr(), send.data_ptr() + send.nbytes
    if send.nbytes == 0 or end <= out.data_ptr() or start >= out.data_ptr() + out.nbytes:
        return send
    return None if start == out.data_ptr() + rank * send.nbytes else send.clone()


# -- staging -------------------------------------------------------------------------------------------------------


class Output:
    """Where MPI writes a result: the tensor itself when contiguous, else a contiguous copy written back after."""

    def __init__(self, tensor: torch.Tensor, copy_in: bool):
        self.tensor = tensor
        if tensor.is_contiguous():
            self.work, self.finish = tensor, None
        else:
            self.work = tensor.contiguous() if copy_in else torch.empty(tensor.shape, dtype=tensor.dtype)
            self.finish = self._copy_back

    def _copy_back(self) -> None:
        self.tensor.copy_(self.work)


class Reduction:
    """A tensor made ready for an MPI reduction `op` over `n` ranks: `work` (what MPI reduces), `mpi_op`, and
    `finish` (None when nothing is left to do after MPI)."""

    def __init__(self, tensor: torch.Tensor, op, n: int, what: str, copy_in: bool):
        kind = op if isinstance(op, _RedOp) else op.op  # a RedOpType passes isinstance(op, ReduceOp) too
        self.tensor, self.n = tensor, n
        self.average = kind == _RedOp.AVG
        dtype = WIDENED.get(tensor.dtype, tensor.dtype)
        if dtype not in DATATYPES:
            raise DistUsageError(f"{what}: the mpi4py backend cannot reduce {tensor.dtype} tensors")
        table = BOOL_OPS if dtype == torch.bool else OPS
        if kind not in table:
            raise DistUsageError(f"{what}: the mpi4py backend does not support {kind.name} on {tensor.dtype}")
        if self.average and not (dtype.is_floating_point or dtype.is_complex):
            raise DistUsageError(f"{what}: AVG of {tensor.dtype} tensors is not a {tensor.dtype}; use SUM")
        self.mpi_op = table[kind]
        if dtype == tensor.dtype and tensor.is_contiguous():
            self.work = tensor
        elif copy_in:
            self.work = tensor.contiguous() if dtype == tensor.dtype else tensor.to(dtype).contiguous()
        else:
            self.work = torch.empty(tensor.shape, dtype=dtype)
        self.finish = self._finish if (self.average or self.work is not tensor) else None

    def _finish(self) -> None:
        if self.average:
            self.work.div_(self.n)
        if self.work is not self.tensor:
            self.tensor.copy_(self.work)


def flat_for_reduction(inputs: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The inputs one after another in one contiguous tensor of `dtype` (no copy for one contiguous input)."""
    if len(inputs) == 1 and inputs[0].dtype == dtype and inputs[0].is_contiguous():
        return inputs[0]
    return torch.cat([t.reshape(-1).to(dtype) for t in inputs])


class Pieces:
    """Outputs of a gather-like operation: one flat byte buffer MPI fills, copied into each output after."""

    def __init__(self, outputs: Sequence[torch.Tensor]):
        self.outputs = outputs
        self.counts = [t.nbytes for t in outputs]
        self.displs = _offsets(self.counts)
        self.flat = torch.empty(sum(self.counts), dtype=torch.uint8)

    def spec(self) -> list:
        return [_address(self.flat.data_ptr(), self.flat.nbytes), self.counts, self.displs, MPI.BYTE]

    def finish(self) -> None:
        for t, start, count in zip(self.outputs, self.displs, self.counts):
            if count:
                t.copy_(self.flat[start:start + count].view(t.dtype).view(t.shape))


def concatenated(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The inputs' bytes one after another (one copy)."""
    if not inputs:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([contiguous(t).reshape(-1).view(torch.uint8) for t in inputs])


def pieces_spec(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list:
    counts = [t.nbytes for t in tensors]
    return [_address(flat.data_ptr(), flat.nbytes), counts, _offsets(counts), MPI.BYTE]


def split_spec(tensor: torch.Tensor, splits: Sequence[int], n: int, what: str) -> list:
    """all_to_all_single's buffer spec: `splits` rows of dim 0 per rank (empty: equal parts)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = tensor.nbytes // rows if rows else 0
    if not splits:
        if rows % n:
            raise DistUsageError(f"{what}: {rows} rows do not split into {n} equal parts; give split sizes")
        splits = [rows // n] * n
    if len(splits) != n or sum(splits) != rows:
        raise DistUsageError(f"{what}: split sizes {list(splits)} must be {n} numbers adding up to {rows}")
    counts = [s * row_bytes for s in splits]
    return [_address(tensor.data_ptr(), tensor.nbytes), counts, _offsets(counts), MPI.BYTE]


def _offsets(counts: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return offsets


# -- checks and composition ----------------------------------------------------------------------------------------


def on_cpu(op: str, arguments: tuple) -> None:
    """Refuse, in one line, any tensor not in CPU memory among an operation's tensor arguments (tensors, lists of
    them, lists of lists). Why: buffers are made from `data_ptr()`, and the MPI under this backend is not
    CUDA-aware, so a CUDA pointer would have MPI read or write device memory as if it were host memory (a crash,
    or wrong data); a "meta" tensor has no memory at all. Checked where every operation enters
    (MpiProcessGroup._usable), before anything is posted."""
    for argument in arguments:
        for item in argument if isinstance(argument, (list, tuple)) else (argument,):
            for tensor in item if isinstance(item, (list, tuple)) else (item,):
                if tensor.layout != torch.strided:
                    raise DistUsageError(
                        f"mpi4py {op}: a {str(tensor.layout).removeprefix('torch.')} tensor, but the mpi4py backend "
                        f"moves dense tensors only; make it dense first (.to_dense())")
                if not tensor.is_cpu:
                    raise DistUsageError(
                        f"mpi4py {op}: a tensor on {tensor.device}, but the mpi4py backend moves CPU tensors only "
                        f"(its MPI is not CUDA-aware); use the nccl backend (GPU engines start with it by default), "
                        f"or move the tensor to CPU first (.cpu())")


def single(items: Sequence, what: str) -> Sequence:
    """torch passes lists of one tensor (or one list) per call; this backend serves one device per rank."""
    if len(items) != 1:
        raise DistUsageError(f"{what}: the mpi4py backend takes one tensor (list) per rank, got {len(items)}")
    return items


def same_count(items: Sequence, n: int, what: str) -> None:
    if len(items) != n:
        raise DistUsageError(f"{what}: needs one tensor per rank of the group ({n}), got {len(items)}")


def sizes_match(got: int, expected: int, what: str) -> None:
    if got != expected:
        raise DistUsageError(f"{what}: the output must hold the group's size times the input: {got} elements, "
                             f"expected {expected}")


def all_of(finishes: Iterable[Callable | None]) -> Callable | None:
    """One finish step running each of these in turn (None if there is nothing to run)."""
    steps = [f for f in finishes if f is not None]
    if not steps:
        return None

    def run() -> None:
        for step in steps:
            step()
    return run


class SourcedRequest:
    """A receive's request that keeps the status MPI fills when it completes: which rank sent (for a receive from
    any source) and how much arrived."""

    def __init__(self, request):
        self._request, self._status = request, MPI.Status()

    def Test(self) -> bool:  # noqa: N802 - MPI's name, called where a plain request's Test is
        return self._request.Test(self._status)

    def source(self) -> int:
        return self._status.Get_source()

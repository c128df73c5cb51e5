"""all_reduce of a sparse (COO) tensor over the mpi4py backend, as gloo does it (runs ON the engines).

Gloo sums sparse tensors by gathering every rank's indices and values and adding them up; torch's own test
(test_sparse_all_reduce_sum) runs on gloo alone. Here the same: each rank's number of non-zeros is all-gathered,
then its indices (as rows) and its values, each with one Iallgatherv on raw bytes; the concatenation is coalesced
(duplicate indices summed) and copied into the caller's tensor. SUM only, as gloo.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from nbdist.backend.ranks import mpi_data as data
from nbdist.backend.ranks.mpi_work import complete_now
from nbdist.debugging.ranks import recorder
from nbdist.errors import DistUsageError


def all_reduce(group, comm, tensor: torch.Tensor, op, seconds: float):
    """Sum the sparse `tensor` over the group's ranks into itself; returns the completed work."""
    kind = op if isinstance(op, dist.ReduceOp.RedOpType) else op.op
    if kind != dist.ReduceOp.RedOpType.SUM:
        raise DistUsageError(f"mpi4py all_reduce of a sparse tensor: only SUM (as gloo), got {kind.name}")
    if not tensor.is_cpu:
        raise DistUsageError(f"mpi4py all_reduce: a sparse tensor on {tensor.device}; the backend moves CPU tensors")
    group.calls += 1
    name = f"all_reduce #{group.calls}"
    slot = recorder.begin(group.recorded_as, group.calls, "all_reduce", None, tensor._nnz(), tensor.dtype)
    try:
        _sum_sparse(group, comm, tensor, name, seconds)
    except BaseException:
        recorder.failed(slot)
        raise
    recorder.end(slot)
    return complete_now(group, name, [], None, (), seconds)


def _sum_sparse(group, comm, tensor: torch.Tensor, name: str, seconds: float) -> None:
    """Gather every rank's non-zeros (their counts first) and sum them into `tensor`."""
    local = tensor.coalesce()
    rows = local.indices().t().contiguous()  # (nnz, sparse dims): one row per non-zero
    values = local.values().contiguous()  # (nnz, *dense dims)
    mine, every = np.array([rows.shape[0]], dtype=np.int64), np.empty(comm.size, dtype=np.int64)
    complete_now(group, name, [comm.Iallgather(mine, every)], None, (mine, every), seconds)
    counts = every.tolist()
    total = sum(counts)
    all_rows = torch.empty((total, rows.shape[1]), dtype=rows.dtype)
    all_values = torch.empty((total, *values.shape[1:]), dtype=values.dtype)
    requests = [comm.Iallgatherv(data.raw(rows), data.split_spec(all_rows, counts, comm.size, "all_reduce")),
                comm.Iallgatherv(data.raw(values), data.split_spec(all_values, counts, comm.size, "all_reduce"))]
    complete_now(group, name, requests, None, (rows, values, all_rows, all_values), seconds)
    summed = torch.sparse_coo_tensor(all_rows.t(), all_values, tensor.shape).coalesce()
    tensor.copy_(summed)


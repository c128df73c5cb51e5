"""Point-to-point messages between pipeline stages (this code runs ON the engines).

Two transports with one interface, `isend(tensor, peer, tag)` / `irecv(tensor, peer, tag)` returning a handle
with `.wait()`, where `peer` is a rank of the pipeline (its coordinate along the mesh's pp dimension), not a rank
of the world: with data parallelism several pipelines run side by side, each on its own ranks.
- MPI (mpi4py) for CPU tensors, over the mesh's pp communicator: the engines already form an MPI world, and
  MPICH's shared memory moves a 4 KiB activation in about half the time gloo needs over TCP loopback. The
  tensor's own memory is sent (no copy). Tags keep messages apart, so receives can be posted early, in any order,
  and an abandoned step's receives are cancelled.
- torch.distributed for GPU tensors (nccl) or when asked (gloo): one process group per direction between two
  neighbours (pipeline_parallel/ranks/pairs.py), messages matched first-in first-out as NCCL does (tags are not sent,
  also on gloo, so CPU runs obey the rule GPUs impose). The order is safe when `nbdist.schedules.check_nccl` passes,
  which the pipeline checks before it builds; an abandoned step's receives cannot be cancelled, so the notebook renews
  the pipeline's pair groups before the next step (pairs.connect).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nbdist.backend.ranks.waiting import poll


class _TorchRequest:
    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor  # keep the buffer alive until the message is complete

    def wait(self) -> None:
        """gloo: blocks until the message is complete; NCCL: the current CUDA stream waits, the host does not."""
        self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class TorchTransport:
    name = "torch"
    max_tag = 2**31 - 1  # unused: messages on a pair match in order

    def __init__(self, pairs: dict, world_ranks: list[int], me: int):
        self.pairs, self.world_ranks, self.me = pairs, world_ranks, me  # world_ranks[p]: world rank of pp rank p

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        tensor = tensor.contiguous()
        return _TorchRequest(dist.isend(tensor, self.world_ranks[peer], group=self.pairs[(self.me, peer)]), tensor)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        return _TorchRequest(dist.irecv(tensor, self.world_ranks[peer], group=self.pairs[(peer, self.me)]), tensor)


class _MpiRequest:
    def __init__(self, request, tensor: torch.Tensor):
        self.request, self.tensor = request, tensor  # keep the buffer alive until the message is complete

    def wait(self) -> None:
        """Poll rather than block in MPI_Wait, so that an interrupt (a failed peer, the kernel's stop button)
        stops this rank between polls instead of leaving it stuck: the mpi4py backend's poll loop (spin, then yield
        the core, then nap; backend/ranks/waiting.py). An earlier loop here slept 100 us after 200 tests: a 64 KiB
        message (MPICH's rendezvous, which needs both sides polling) then took 103 us one time in two instead of 14."""
        poll([self.request], math.inf)

    def cancel(self) -> None:
        if not self.request.Test():
            self.request.Cancel()
            self.request.Free()

    def is_completed(self) -> bool:
        return self.request.Test()


class MpiTransport:
    name = "mpi"

    def __init__(self, comm):
        from mpi4py import MPI

        self.comm = comm  # the pipeline's communicator: its rank p is pipeline rank p
        self.max_tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        tensor = tensor.contiguous()
        return _MpiRequest(self.comm.Isend(tensor.numpy(), dest=peer, tag=tag), tensor)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        return _MpiRequest(self.comm.Irecv(tensor.numpy(), source=peer, tag=tag), tensor)


def make_transport(name: str, mesh, device: torch.device, pairs: dict | None = None):
    """The transport `name` ("mpi" or "torch", chosen in the notebook) over `mesh`'s pp dimension (a RankMesh);
    "torch" sends over the pipeline's `pairs` (pipeline_parallel/ranks/pairs.py)."""
    if name == "mpi":
        if device.type != "cpu":
            raise ValueError("the MPI transport moves CPU tensors only; use transport='torch' on GPUs")
        return MpiTransport(mesh.comm("pp"))
    return TorchTransport(pairs or {}, mesh.ranks("pp"), mesh.coord("pp"))

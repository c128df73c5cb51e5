"""Point-to-point messages between pipeline stages (this code runs ON the engines).

Two transports, where `peer` is a rank of the pipeline (its coordinate along the mesh's pp dimension), not a rank of
the world: with data parallelism several pipelines run side by side, each on its own ranks.
- MPI (mpi4py) for CPU tensors, over the mesh's pp communicator: `isend(tensor, peer, tag)` / `irecv(...)`, each a
  handle with `.wait()`. The engines already form an MPI world, and MPICH's shared memory moves a small activation
  faster than gloo over TCP loopback (figures: benchmarks/README.md). The tensor's own memory is sent (no copy).
  Tags keep messages apart (`message_tag`), so receives can be posted early, in any order, and an abandoned step's
  are cancelled.
- torch.distributed for GPU tensors (nccl) or when asked (gloo): `post(ops)` posts one round's sends and receives
  together, as one NCCL group (batch_isend_irecv), on the pipeline's one group (pipeline_parallel/ranks/pairs.py),
  and returns one handle for them all: NCCL completes a group as a whole, so waiting for a receive waits for its
  round, also on gloo, so CPU runs obey what GPUs impose. Messages match first-in first-out per directed pair (tags
  are not sent). Why rounds, and the proof they complete: schedules/nccl.py, which the pipeline checks before it
  builds. An interrupted step's receives cannot be cancelled, so the notebook renews the pipeline's group before the
  next step (pairs.connect).
"""
from __future__ import annotations

import math
import threading
import time

import torch
import torch.distributed as dist

from nbdist.backend.ranks.waiting import poll
from nbdist.debugging.ranks import recorder
from nbdist.schedules.actions import RECV_F

TAG_EPOCHS = 64  # MPI: steps before message tags repeat


class _TorchRequest:
    """The works of one posted round (one work on NCCL, one per message on gloo) and the tensors they use."""

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self.works, self.tensors = works, tensors  # keep the buffers alive until the messages are complete

    def wait(self) -> None:
        """gloo: blocks until the round is complete; NCCL: the current CUDA stream waits, the host does not."""
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class TorchTransport:
    name = "torch"
    max_tag = 2**31 - 1  # unused: messages on a pair match in order

    def __init__(self, groups: dict, world_ranks: list[int], me: int):
        self.groups, self.world_ranks, self.me = groups, world_ranks, me  # world_ranks[p]: world rank of pp rank p

    def post(self, ops: list[tuple[bool, torch.Tensor, int]]) -> _TorchRequest:
        """Post (sending?, tensor, peer) operations together; one handle for them all."""
        group, tensors, p2p = self.groups["group"], [], []
        for sending, tensor, peer in ops:
            tensors.append(tensor.contiguous() if sending else tensor)
            p2p.append(dist.P2POp(dist.isend if sending else dist.irecv, tensors[-1], self.world_ranks[peer],
                                  group=group))
        return _TorchRequest(dist.batch_isend_irecv(p2p) if p2p else [], tensors)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> _TorchRequest:
        return self.post([(True, tensor, peer)])

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> _TorchRequest:
        return self.post([(False, tensor, peer)])


class _MpiRequest:
    def __init__(self, request, tensor: torch.Tensor, what: tuple):
        self.request, self.tensor = request, tensor  # keep the buffer alive until the message is complete
        self.what = what  # (group as the flight recorder names it, "send" or "recv", the peer's world rank)

    def wait(self) -> None:
        """Poll rather than block in MPI_Wait, so that an interrupt (a failed peer, the kernel's stop button)
        stops this rank between polls instead of leaving it stuck: the mpi4py backend's poll loop (spin, then yield
        the core, then nap; backend/ranks/waiting.py). An earlier loop here slept after a fixed number of tests: a
        64 KiB message (MPICH's rendezvous, which needs both sides polling) then took several times as long one time
        in two (figures: benchmarks/README.md)."""
        group, call, peer = self.what
        slot = recorder.begin(group, None, call, peer, self.tensor.numel(), self.tensor.dtype)  # the wait, recorded
        try:
            poll([self.request], math.inf)
        except BaseException:
            recorder.failed(slot)
            raise
        recorder.end(slot)

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
        world = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.size)), MPI.COMM_WORLD.Get_group())
        self.world_ranks = [int(r) for r in world]
        self.recorded_as = ("pipeline", tuple(self.world_ranks))  # its name in the flight recorder

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        tensor = tensor.contiguous()
        return _MpiRequest(self.comm.Isend(tensor.numpy(), dest=peer, tag=tag), tensor,
                           (self.recorded_as, "send", self.world_ranks[peer]))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        return _MpiRequest(self.comm.Irecv(tensor.numpy(), source=peer, tag=tag), tensor,
                           (self.recorded_as, "recv", self.world_ranks[peer]))


def message_tag(spec, epoch: int, receive, max_tag: int) -> int:
    """MPI: one tag per message, (pipeline, step epoch, direction, receiving stage, micro-batch), from `receive`'s
    action. The pipeline and the epoch keep a message left over by an interrupted step from matching a receive of a
    later one."""
    stages, m = spec.stages, spec.microbatches
    per_step = 2 * stages * m
    within = ((0 if receive.kind == RECV_F else 1) * stages + receive.stage) * m + receive.microbatch
    steps = max(1, max_tag // per_step)
    return ((spec.number * TAG_EPOCHS + epoch % TAG_EPOCHS) * per_step + within) % (steps * per_step)


def cancel(requests) -> None:
    """Cancel the receives an interrupted step left posted (MPI would fill those buffers later; others cannot)."""
    for request in requests:
        if hasattr(request, "cancel"):
            request.cancel()


class Drainer:
    """Keeps a paused rank's posted sends moving between a Stepper's calls.

    A large MPI message (rendezvous protocol) completes only while the *sender* also calls into MPI, and a paused rank
    calls nothing; a small thread tests the pending sends until they are done or the rank resumes. (A rank must not
    block on them either: on MPI the receive may only be posted at a later tick.)
    """

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.halt = threading.Event()

    def start(self, requests: list) -> list:
        """Drain `requests` in the background; returns those still pending."""
        pending = [r for r in requests if not r.is_completed()]
        if pending:
            self.halt = threading.Event()
            self.thread = threading.Thread(target=_drain, args=(list(pending), self.halt), daemon=True)
            self.thread.start()
        return pending

    def stop(self) -> None:
        if self.thread is not None:
            self.halt.set()
            self.thread.join()
            self.thread = None


def _drain(requests: list, halt: threading.Event) -> None:
    while requests and not halt.is_set():
        requests = [r for r in requests if not r.is_completed()]
        time.sleep(0.0005)


def make_transport(name: str, mesh, device: torch.device, groups: dict | None = None):
    """The transport `name` ("mpi" or "torch", chosen in the notebook) over `mesh`'s pp dimension (a RankMesh);
    "torch" sends over the pipeline's group (pipeline_parallel/ranks/pairs.py)."""
    if name == "mpi":
        if device.type != "cpu":
            raise ValueError("the MPI transport moves CPU tensors only; use transport='torch' on GPUs")
        return MpiTransport(mesh.comm("pp"))
    return TorchTransport(groups if groups is not None else {}, mesh.ranks("pp"), mesh.coord("pp"))

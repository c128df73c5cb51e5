"""What every synchronisation strategy shares (runs ON the engines; the strategies: sync_modes.py, sync_ssp.py).

All communication goes over a private duplicate of the replicas' communicator (so that it never pairs with the
Trainer's or anyone else's traffic) as non-blocking MPI requests completed by the mpi4py backend's poll loop
(backend/ranks/waiting.py): a rank waiting for a peer that failed is freed by nbdist's interrupt (SIGINT) instead of
hanging in MPI_Wait and forcing a restart of the engines. An operation given up that way cannot be cancelled, so
the synchronizer is then marked broken and refuses further use in one line.

Every step reports where its time went: compute_s (forward, backward, the optimizer's own step), idle_s (waiting
for slower replicas: a zero-byte barrier posted with each all-reduce, or SSP's staleness bound) and comm_s (the
rest: moving and applying the data). The barrier is what tells idle from communication.
"""
from __future__ import annotations

import math
import time

import torch

from nbdist.models import batches
from torch import nn

from nbdist.backend.ranks.waiting import complete_or_abandon, poll
from nbdist.errors import DistUsageError

# -- flat views of parameters and gradients --------------------------------------------------------------------------


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous float32 CPU copy of `tensors`: MPI moves it in one message, from host memory."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def write(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy `flat` back into `tensors` (each takes its own dtype and device)."""
    with torch.no_grad():
        for t, piece in _pieces(flat, tensors):
            t.copy_(piece)


def add(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """tensors += flat, piece by piece."""
    with torch.no_grad():
        for t, piece in _pieces(flat, tensors):
            t.add_(piece.to(t.device, t.dtype))


def _pieces(flat: torch.Tensor, tensors: list[torch.Tensor]):
    """(tensor, the part of `flat` that is its copy, shaped like it), in flatten's order."""
    offset = 0
    for t in tensors:
        yield t, flat[offset:offset + t.numel()].view_as(t)
        offset += t.numel()


def duplicate(comm):
    """A private copy of `comm`, made with a polled Idup: a rank whose peer never arrives stays interruptible."""
    copy, request = comm.Idup()
    poll([request], math.inf)
    return copy


class Synchronizer:
    """The part every strategy shares: this replica's forward and backward over its share, the communicator, the
    step counter, the time accounting and the broken state after an interrupt. Subclasses write `step`."""

    kind = ""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm, options: dict):
        self.model, self.optimizer, self.options = model, optimizer, options
        self.comm = duplicate(comm)
        self.rank, self.replicas = self.comm.Get_rank(), self.comm.Get_size()
        self.params = list(model.parameters())
        self.steps = 0  # steps taken: the strategies' schedules count these (the Trainer's own number may differ)
        self.broken: str | None = None
        self._closed = False
        self.scale = None  # the Trainer's loss scaling (fp16): loss -> scaled loss, before backward
        self.apply = None  # the Trainer's optimizer step (unscale, clip, step): replaces optimizer.step()

    # -- the interface --------------------------------------------------------------------------------------------

    def step(self, step: int, inputs, targets, loss_fn, microbatches: int = 1) -> dict:
        """One training step of this replica on its share (`inputs`, `targets`, split into `microbatches` for
        gradient accumulation), then the strategy's communication and the optimizer's step. Returns {"loss",
        "compute_s", "comm_s", "idle_s", "staleness"} (staleness: SSP's, of each peer update applied, else []).
        `step` is the caller's number, for messages: the strategies' schedules count their own steps, which
        state() saves."""
        raise NotImplementedError

    @property
    def lag(self) -> int:
        """How many steps this strategy lets the replicas run apart before they must meet (0: every step). The
        Trainer's step boundary waits no more often than this."""
        return 0

    def finish(self) -> None:
        """Bring the replicas to one model (collective). Nothing to do where they never diverge."""
        self.usable()

    def state(self) -> dict:
        """What a checkpoint needs besides the model and optimizer: the step counter that the schedule reads."""
        return {"kind": self.kind, "steps": self.steps}

    def load_state(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise DistUsageError(f"{self.kind}: cannot load the state of a {state.get('kind')!r} synchronizer")
        self.steps = int(state["steps"])

    def close(self) -> None:
        """Free the private communicator (once). MPI frees it after any operation still pending on it."""
        if not self._closed:
            self._closed = True
            self.comm.Free()

    # -- shared pieces --------------------------------------------------------------------------------------------

    def usable(self) -> None:
        if self._closed:
            raise DistUsageError(f"{self.kind}: this synchronizer was closed")
        if self.broken is not None:
            raise DistUsageError(f"{self.kind}: this synchronizer was interrupted in {self.broken}, so its replicas "
                                 f"are out of step; make a new one")

    def backward(self, inputs, targets, loss_fn, microbatches: int) -> float:
        """Gradients of the mean loss over this replica's share, accumulated over `microbatches` chunks (each
        weighted by its size, so the gradient equals the whole share's). Returns that mean loss."""
        n = batches.check(inputs, "inputs")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or not 1 <= microbatches <= n:
            raise DistUsageError(f"{self.kind}: microbatches must be an integer from 1 to this replica's "
                                 f"{n} samples, got {microbatches!r} (rank {self.rank})")
        self.optimizer.zero_grad()
        total = 0.0
        ys = [None] * microbatches if targets is None else targets.tensor_split(microbatches)
        for x, y in zip(batches.split(inputs, microbatches), ys):
            loss = batches.loss_of(batches.call(self.model, x), y, loss_fn)
            share = batches.check(x) / n
            part = loss * share
            (part if self.scale is None else self.scale(part)).backward()
            total += loss.item() * share
        return total

    def step_optimizer(self) -> None:
        """This replica's optimizer step (the Trainer's, with clipping and loss scaling, where it set one)."""
        self.optimizer.step() if self.apply is None else self.apply(self.optimizer)

    def grads(self) -> list[torch.Tensor]:
        """Every trained parameter's gradient, zeros where backward left none (every replica must send the same
        shape)."""
        trained = [p for p in self.params if p.requires_grad]
        for p in trained:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in trained]

    def wait(self, requests: list, what: str, buffers: tuple = (), also: list | None = None) -> float:
        """Complete `requests` by polling (interruptible); seconds waited. Interrupted, the requests (and `also`,
        others in flight with them) are given up for good (their buffers kept alive: MPI may still write into
        them) and this synchronizer is broken."""
        start = time.perf_counter()
        try:
            complete_or_abandon(requests, buffers, math.inf, what, abandon=requests + (also or []))
        except BaseException:
            self.broken = f"{what} at step {self.steps} (rank {self.rank})"
            raise
        return time.perf_counter() - start

    def sum_over_replicas(self, flat: torch.Tensor, what: str) -> tuple[float, float]:
        """flat := the sum of every replica's `flat`, in place; (idle, comm) seconds.

        A zero-byte barrier is posted with the all-reduce and completed first: the time until every replica has
        arrived is idle (waiting for the slowest), the rest is the all-reduce's own. Both are posted at once, so
        MPI progresses them together and the barrier adds no round of its own, as a barrier completed before
        posting the all-reduce did (figures: benchmarks/README.md)."""
        from mpi4py import MPI

        barrier = self.comm.Ibarrier()
        reduction = self.comm.Iallreduce(MPI.IN_PLACE, flat.numpy())
        idle = self.wait([barrier], f"{what} (waiting for every replica)", (flat,), also=[reduction])
        return idle, self.wait([reduction], what, (flat,))

    def average(self, tensors: list[torch.Tensor], what: str) -> tuple[float, float]:
        """Average `tensors` over the replicas in one flat all-reduce; (idle, comm) seconds. Each replica's share is
        divided before the sum, as torch's model averaging does."""
        start = time.perf_counter()
        flat = flatten(tensors).div_(self.replicas)
        idle, _ = self.sum_over_replicas(flat, what)
        write(flat, tensors)
        return idle, time.perf_counter() - start - idle


def report(loss: float, compute: float, comm: float, idle: float, staleness: list[int] | None = None) -> dict:
    return {"loss": loss, "compute_s": compute, "comm_s": comm, "idle_s": idle, "staleness": staleness or []}

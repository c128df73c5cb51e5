"""Stale-synchronous parallel training without a parameter server (runs ON the engines; made by sync_modes.make).

SSP (Ho et al. 2013) lets workers run at their own pace as long as none is more than `s` clocks ahead of the
slowest: a worker at clock c must see every update of clocks <= c - s - 1, and may see newer ones. Here every
replica keeps a full copy of the model, so there is no server: after its step at clock c a replica sends its update
tagged c to every other replica (non-blocking Isend on a private communicator) and goes on. Before it computes
clock c it applies every update of clocks < c that has arrived, and it waits (idle_s) only for updates of clocks
<= c - s - 1 that have not. With s = 0 that is synchronous training: everyone applies every update of clock c - 1
first, and nothing else.

Updates of clocks >= c (from a replica that is ahead) wait in their receive buffers until this replica has
reached them. Applying them at once is allowed by SSP ("may see newer"), but then a replica's gradient would depend
on when messages happened to arrive, and s = 0 would no longer be synchronous training.

What is sent: the parameter *delta* of this replica's optimizer step divided by the number of replicas, not the
gradient. A delta is added as it is, in any order, so once every update has been applied every replica holds the
initial parameters plus the sum of all updates (`finish` drains to that point), whatever order they arrived in;
a gradient would have to go through every receiver's optimizer state, which then depends on the order. Dividing by
the number of replicas keeps the scale of synchronous training: N replicas together move the model by one step's
worth per clock, and with plain or momentum SGD and s = 0 the replicas follow synchronous SGD on the mean gradient
exactly (up to float rounding: each replica adds the deltas in its own order). Each replica's optimizer state is
its own and sees only its own gradients.

Staleness of an applied update = this replica's clock - the update's clock, where "this replica's clock" is the
last clock it has completed: an update of the clock this replica has just finished is fresh (0). Before computing
clock c a replica has completed c - 1, applies only updates of clocks <= c - 1 and already holds every update of
clocks <= c - s - 2 (the previous step's bound), so every staleness lies in 0 .. s. A replica's own update is
applied at once (always 0) and is not listed.

Messages: receives for the next 2s + 2 clocks of every peer are posted ahead (the most a peer can be ahead of
this replica's oldest unapplied update of it), so that MPI can deliver a large update without the receiver in a
blocking call; all waiting goes through the mpi4py backend's poll loop, so an interrupt frees a waiting rank.
"""
from __future__ import annotations

import time

import torch

from nbdist.backend.ranks.waiting import abandoned
from nbdist.errors import DistUsageError
from nbdist.training.ranks.sync_base import Synchronizer, add, flatten, report, write


class StaleSynchronous(Synchronizer):
    kind = "ssp"

    def __init__(self, model, optimizer, comm, options):
        from mpi4py import MPI

        super().__init__(model, optimizer, comm, options)
        self.bound = options["staleness"]
        self.window = 2 * self.bound + 2  # receives posted ahead per peer
        self.tags = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1  # a clock's tag is clock % tags
        self.size = sum(p.numel() for p in self.params)
        self.peers = [r for r in range(self.replicas) if r != self.rank]
        self.clock = 0  # clocks completed; the next one computed
        self.next_of = {peer: 0 for peer in self.peers}  # each peer's oldest clock not yet applied here
        self.posted: dict[int, dict[int, tuple]] = {peer: {} for peer in self.peers}  # peer -> clock -> (request, buffer)
        self.sends: list[tuple] = []  # (requests, buffer) of updates on their way out
        self.contributed = torch.zeros(self.size)  # the sum of this replica's own updates since it started
        self.drained_at: int | None = 0  # the clock at which every update sent was applied everywhere
        self.peer_clocks = [0] * self.replicas  # every replica's clock at that point
        self._post_receives(self.peers)

    # -- the interface --------------------------------------------------------------------------------------------

    @property
    def lag(self) -> int:
        return self.bound + 1  # a replica may be `bound` clocks ahead of the slowest, and finish the one after

    def step(self, step: int, inputs, targets, loss_fn, microbatches: int = 1) -> dict:
        self.usable()
        start = time.perf_counter()
        self._reap_sends()
        staleness = self._apply_arrived()
        idle = self._await_clocks(self.clock - self.bound - 1, staleness)
        staleness += self._apply_arrived()
        comm = time.perf_counter() - start - idle
        start = time.perf_counter()
        loss = self.backward(inputs, targets, loss_fn, microbatches)
        before = flatten(self.params)
        self.step_optimizer()
        update = flatten(self.params).sub_(before).div_(self.replicas)
        write(before.add_(update), self.params)
        compute = time.perf_counter() - start
        start = time.perf_counter()
        self._send(update)
        self.contributed.add_(update)
        self.clock += 1
        self.steps += 1
        self.drained_at = None
        return report(loss, compute, comm + time.perf_counter() - start, idle, staleness)

    def finish(self) -> None:
        """Every replica applies every update sent so far (collective: the replicas first tell each other how many
        clocks each has completed), and its own sends complete. A second call finds nothing left to do."""
        self.usable()
        import numpy as np

        clocks = np.zeros(self.replicas, dtype=np.int64)
        self.wait([self.comm.Iallgather(np.array([self.clock], dtype=np.int64), clocks)], "the clock exchange")
        for peer in self.peers:
            self._await_clocks_of(peer, int(clocks[peer]) - 1, [])
        for requests, buffer in self.sends:
            self.wait(requests, "the last sends", (buffer,))
        self.sends = []
        self.drained_at = self.clock
        self.peer_clocks = [int(c) for c in clocks]

    def state(self) -> dict:
        """The clocks (this replica's and how far it has applied each peer's), taken after finish(): a checkpoint
        of a model with updates still in flight would lose them."""
        if self.drained_at != self.clock:
            raise DistUsageError(f"ssp: call finish() before state(): updates are in flight at clock {self.clock} "
                                 f"(rank {self.rank})")
        return {**super().state(), "clock": self.clock, "peer_clocks": list(self.peer_clocks)}

    def load_state(self, state: dict) -> None:
        """Continue from a drained checkpoint: every replica loads its own state, all at the same point."""
        super().load_state(state)
        self._cancel_receives()
        self.clock = int(state["clock"])
        self.next_of = {peer: int(state["peer_clocks"][peer]) for peer in self.peers}
        self.contributed.zero_()
        self.drained_at, self.peer_clocks = self.clock, list(state["peer_clocks"])
        self._post_receives(self.peers)

    def close(self) -> None:
        """Cancel the receives posted ahead; sends not yet delivered are left to MPI (their buffers kept)."""
        if self._closed:
            return
        self._cancel_receives()
        pending = [(requests, buffer) for requests, buffer in self.sends
                   if not all(r.Test() for r in requests)]
        abandoned.extend(pending)
        self.sends = []
        super().close()

    # -- messages -------------------------------------------------------------------------------------------------

    def _post_receives(self, peers: list[int]) -> None:
        """Keep receives posted for each of `peers`' clocks next_of .. next_of + window - 1."""
        for peer in peers:
            for clock in range(self.next_of[peer], self.next_of[peer] + self.window):
                if clock not in self.posted[peer]:
                    buffer = torch.empty(self.size)
                    request = self.comm.Irecv(buffer.numpy(), source=peer, tag=clock % self.tags)
                    self.posted[peer][clock] = (request, buffer)

    def _cancel_receives(self) -> None:
        for peer in self.peers:
            for request, buffer in self.posted[peer].values():
                if not request.Test():
                    request.Cancel()
                    request.Free()
            self.posted[peer] = {}

    def _send(self, update: torch.Tensor) -> None:
        buffer = update.clone()  # MPI reads it until the sends complete
        requests = [self.comm.Isend(buffer.numpy(), dest=peer, tag=self.clock % self.tags) for peer in self.peers]
        self.sends.append((requests, buffer))

    def _reap_sends(self) -> None:
        """Drop the sends that completed (testing them also drives MPI's progress)."""
        self.sends = [(requests, buffer) for requests, buffer in self.sends if not all(r.Test() for r in requests)]

    def _apply(self, peer: int) -> int:
        """Apply peer's oldest unapplied update (its receive completed); its staleness."""
        clock = self.next_of[peer]
        _, buffer = self.posted[peer].pop(clock)
        add(buffer, self.params)
        self.next_of[peer] = clock + 1
        self._post_receives([peer])
        return self.clock - 1 - clock

    def _apply_arrived(self) -> list[int]:
        """Apply, in each peer's clock order, every update of a clock this replica has completed that has arrived;
        their staleness."""
        staleness = []
        for peer in self.peers:
            while self.next_of[peer] < self.clock and self.posted[peer][self.next_of[peer]][0].Test():
                staleness.append(self._apply(peer))
        return staleness

    def _await_clocks(self, last: int, staleness: list[int]) -> float:
        """Wait until every peer's updates up to clock `last` are applied (SSP's bound); seconds waited."""
        return sum(self._await_clocks_of(peer, last, staleness) for peer in self.peers)

    def _await_clocks_of(self, peer: int, last: int, staleness: list[int]) -> float:
        waited = 0.0
        while self.next_of[peer] <= last:
            request, buffer = self.posted[peer][self.next_of[peer]]
            waited += self.wait([request], f"waiting for rank {peer}'s clock {self.next_of[peer]}", (buffer,))
            staleness.append(self._apply(peer))
        return waited

"""MPI kept moving while an engine waits for its next cell (runs ON the engines).

Why: MPICH moves data only inside MPI calls, and some of what a rank sends is still its own to move after its
request has completed. Over shared memory a message goes into a queue of the receiver's (64 cells of 8 KiB); when
that queue is full, the message waits in the sender's postponed queue, and only the sender's later MPI calls move
it, one cell as the receiver frees one. A rank that arrives late finds its queues full of the others' messages; the
others complete their calls, finish their cell and call MPI no more, and the late rank waits for good in a call every
other rank has completed. Seen in CI with ZeRO's parameter broadcasts (posted together, then waited on): rank 0
waited in a broadcast for minutes while the other ranks were idle. Reproduced with mpi4py alone (figures:
benchmarks/README.md): a late rank waited exactly as long as its peers stayed out of MPI, and never with a larger
queue; one MPI call now and then from the idle peers did not free it (each moves one postponed message), a burst
of calls on a tick did.

So between cells the engine's event loop calls MPI's progress (`Iprobe`, BURST times) on a tick: every FIRST_TICK
after a cell has ended, doubling up to LAST_TICK while the engine stays idle. A cell holds the event loop, so a tick
that comes late says a cell ran and starts the ticks over. Idle, it costs 20 ticks a second, each a burst of BURST
`Iprobe` calls (microseconds; figures: benchmarks/README.md) besides the event loop's wake-up.
During a cell nothing ticks: a rank that computes for a while delays a late peer by as long (as MPI does everywhere
without a progress thread), but never for good.
"""
from __future__ import annotations

import asyncio

FIRST_TICK = 0.002  # seconds from a cell's end to the first tick
LAST_TICK = 0.05  # the longest gap between ticks while idle: the most a late peer waits on this rank
BURST = 64  # progress calls per tick: each moves at most one postponed message
BUSY = 0.005  # a tick this late (beyond its gap) means a cell held the event loop

_ticker: _Ticker | None = None


class _Ticker:
    """The tick on one event loop: a burst of progress calls, then the next tick, further off while idle."""

    def __init__(self, loop: asyncio.AbstractEventLoop, mpi):
        self.loop, self.mpi = loop, mpi
        self.gap = FIRST_TICK
        self.ticks = 0  # how many ticks so far (a test reads it)
        self.due = loop.time() + self.gap
        loop.call_at(self.due, self.tick)

    def tick(self) -> None:
        now = self.loop.time()
        ran_a_cell = now - self.due > BUSY
        self.gap = FIRST_TICK if ran_a_cell else min(2 * self.gap, LAST_TICK)
        if self.mpi.Is_finalized():
            return
        self.ticks += 1
        probe = self.mpi.COMM_WORLD.Iprobe
        for _ in range(BURST):
            probe()
        self.due = now + self.gap
        self.loop.call_at(self.due, self.tick)


def start() -> bool:
    """Tick on the running event loop (an engine's, when called from a cell); False where no loop runs (a script
    under mpiexec: it calls MPI itself until it ends). Idempotent."""
    global _ticker
    if _ticker is not None:
        return True
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    from mpi4py import MPI

    _ticker = _Ticker(loop, MPI)
    return True

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
after a cell or call has ended, doubling up to LAST_TICK; then, while the engine stays idle, each gap is IDLE_SHARE of
the time it has been idle (at most SLOWEST_TICK), so that a peer that comes t seconds late to what this rank posted
waits at most max(LAST_TICK, t * IDLE_SHARE) more per tick, and an engine idle for minutes ticks once a second. The
engine's calls and cells start the ticks over when they end (runtime/ranks/cells.py: its do_apply and IPython's
post_run_cell); a tick that comes later than its gap (a cell held the event loop) does too, for cells that run
another way. Why the ticks slow down: each costs the engine a wake-up of its event loop besides the burst (about
0.2 ms of CPU in all), and 20 a second were most of what an idle engine used (figures: benchmarks/README.md).
During a cell nothing ticks: a rank that computes for a while delays a late peer by as long (as MPI does everywhere
without a progress thread), but never for good.
"""
from __future__ import annotations

import asyncio

FIRST_TICK = 0.002  # seconds from a cell's end to the first tick
LAST_TICK = 0.05  # the longest gap between ticks in the first 0.5 s after a cell (LAST_TICK / IDLE_SHARE)...
IDLE_SHARE = 0.1  # ... then a gap is this share of the time since the last cell ended...
SLOWEST_TICK = 1.0  # ... up to this
BURST = 64  # progress calls per tick: each moves at most one postponed message
BUSY = 0.005  # a tick later than this (and than its own gap) means a cell held the event loop

_ticker: _Ticker | None = None


class _Ticker:
    """The tick on one event loop: a burst of progress calls, then the next tick, further off while idle."""

    def __init__(self, loop: asyncio.AbstractEventLoop, mpi):
        self.loop, self.mpi = loop, mpi
        self.ticks = 0  # how many ticks so far (a test reads it)
        self.handle: asyncio.TimerHandle | None = None
        self.start_over()

    def start_over(self) -> None:
        """A cell or call has just ended: tick soon, then less and less often."""
        if self.handle is not None:
            self.handle.cancel()
        self.idle_since = self.loop.time()
        self.gap = FIRST_TICK
        self.due = self.idle_since + self.gap
        self.handle = self.loop.call_at(self.due, self.tick)

    def tick(self) -> None:
        now = self.loop.time()
        if now - self.due > max(BUSY, self.gap):  # a cell held the event loop (a cell that ran another way than
            # the engine's calls and cells; a loaded machine's late wake-up is not one)
            self.idle_since, self.gap = now, FIRST_TICK
        else:
            self.gap = min(max(min(2 * self.gap, LAST_TICK), IDLE_SHARE * (now - self.idle_since)), SLOWEST_TICK)
        if self.mpi.Is_finalized():
            self.handle = None
            return
        self.ticks += 1
        probe = self.mpi.COMM_WORLD.Iprobe
        for _ in range(BURST):
            probe()
        self.due = now + self.gap
        self.handle = self.loop.call_at(self.due, self.tick)


def start() -> bool:
    """Tick on the running event loop (an engine's, when called from a cell), started over as each of the engine's
    calls and cells ends; False where no loop runs (a script under mpiexec: it calls MPI itself until it ends).
    Idempotent."""
    global _ticker
    if _ticker is not None:
        return True
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    from mpi4py import MPI

    from nbdist.runtime.ranks import cells

    _ticker = _Ticker(loop, MPI)
    cells.after_each(_cell_ended)
    return True


def _cell_ended() -> None:
    if _ticker is None:
        return
    try:
        here = asyncio.get_running_loop() is _ticker.loop
    except RuntimeError:
        here = False
    if here:
        _ticker.start_over()
    else:  # not on the engine's loop (its own thread is the one to touch its timers)
        _ticker.loop.call_soon_threadsafe(_ticker.start_over)


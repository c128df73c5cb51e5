"""Waiting for MPI requests so that an interrupt frees the waiting rank (runs ON the engines).

Every wait of nbdist's MPI traffic, the torch process group's operations (mpi_work.py) as its own messages (the
pipeline's transport, the Trainer's step boundary, the synchronisers), completes non-blocking requests here. They are
completed by polling `Test` from Python instead of blocking in `MPI_Wait`, for one reason: Python
runs signal handlers between bytecodes, so a rank waiting in a collective whose peer failed is freed by SIGINT
(nbdist's interrupt) and keeps its engine and variables. A rank blocked in gloo or MPI_Wait cannot be freed that
way; nbdist has to restart the engines.

The loop spins first (MPICH's shared memory answers within microseconds, and `Test` is what drives its progress),
then yields the core (`sched_yield`: engines often share cores, and a peer may need this one to get to the
collective), then sleeps briefly (a long wait should not burn a core that a computing peer needs). A small `Iallreduce`
completed this way costs the same as a blocking `Allreduce`. With more ranks on a host than cores it yields after
every test from the start: polled without yielding, an oversubscribed `Iallreduce` took a hundred times as long as
with a yield after each test, which is as fast as blocking (figures: benchmarks/README.md).

Two refinements, both measured (figures: benchmarks/README.md): the all-reduce hot path (mpi_backend._sum_now)
first spins on its two requests for QUICK_TESTS tests with no clock read (calls of up to about a MiB between ready
ranks end there, and each full poll costs a call more); and a wait known to be a transfer (the operation's
agreement came back, so every rank is in it) never naps for TRANSFER_SECONDS, because MPICH moves shared-memory
data only inside a test (a large all-reduce that napped ran well below raw MPI, and DDP's buckets slower).

A request that is abandoned (interrupted or timed out) cannot be cancelled: MPI has no way to cancel a
collective. Its buffers are kept alive for good (MPI may still write into them) and its process group is marked
broken: its ranks are out of step, so any later operation on it raises until `mpi_backend.renew()` has given
every group a fresh communicator on every rank.
"""
from __future__ import annotations

import os
import time

from nbdist.backend.ranks import roll_call
from nbdist.cost.waiting import NAP_SECONDS, SPIN_SECONDS, YIELD_SECONDS  # one rule, the predictor's too

abandoned: list = []  # (requests, buffers) of interrupted or timed-out operations: MPI may still write into them

TRANSFER_SECONDS = 1.0  # how long a transfer (every rank known to be in the operation) is tested without naps
CHECK_EVERY = 64  # clock reads (and deadline checks) every this many tests while spinning


def _oversubscribed() -> bool:
    """More ranks on this host (MPICH's Hydra says how many, MPI_LOCALNRANKS) than cores this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return int(os.environ.get("MPI_LOCALNRANKS", "1")) > cores


SPIN_TESTS = 1024  # the hot path's spin before the full poll where each rank has a core (up to ~1 ms, no clock)
OVERSUBSCRIBED = False  # then every spin yields: a spinning rank holds the core its peer needs
QUICK_TESTS = SPIN_TESTS  # the hot path's spin: SPIN_TESTS, or 1 where oversubscribed (read_environment)


def read_environment() -> None:
    """Set OVERSUBSCRIBED and QUICK_TESTS from this rank's environment: at import, and again in a rank forked from a
    kernel that had imported this module (cluster/launching/ranks/zygote.py), whose copy was read without Hydra's variables."""
    global OVERSUBSCRIBED, QUICK_TESTS
    OVERSUBSCRIBED = _oversubscribed()
    QUICK_TESTS = 1 if OVERSUBSCRIBED else SPIN_TESTS


read_environment()


def quickly_complete(first, second) -> bool:
    """Whether two requests complete within QUICK_TESTS tests of each, with no clock read and no bookkeeping: the
    hot path's spin (an all-reduce and its agreement), before the full poll. A completed request's Test is True
    at once. Where ranks outnumber cores it tests once: spinning would hold the core that a peer needs."""
    for _ in range(QUICK_TESTS):
        if first.Test() and second.Test():
            return True
    return False


def test_all(requests: list) -> bool:
    """Whether every request is complete (one `Test` call drives MPI's progress once)."""
    if len(requests) == 1:
        return requests[0].Test()
    from mpi4py import MPI

    return MPI.Request.Testall(requests)


def poll(requests: list, seconds: float, where: str | None = None, transfer: bool = False) -> bool:
    """Test `requests` until complete (True) or until `seconds` have passed (False). Interruptible: a
    KeyboardInterrupt raised by a signal handler between tests leaves this loop like any exception. `where`: what
    this rank waits in, said to a roll call (roll_call.py) that arrives while the wait is long.

    `transfer`: every rank of the operation is known to be in it (its agreement came back), so what is left is
    moving the data, and MPICH moves shared-memory data only inside a test: a nap between tests would stall every
    rank's copy (see the module's docstring; figures: benchmarks/README.md). So no naps for
    TRANSFER_SECONDS (yields only); naps after that (a peer that died mid-transfer is left to the death watch)."""
    previous = roll_call.waiting_in
    roll_call.waiting_in = where or previous
    try:
        return _poll(requests, seconds, TRANSFER_SECONDS if transfer else YIELD_SECONDS)
    finally:
        roll_call.waiting_in = previous


def _poll(requests: list, seconds: float, busy: float) -> bool:
    if len(requests) == 1:
        test = requests[0].Test
    else:
        from mpi4py import MPI

        def test() -> bool:
            return MPI.Request.Testall(requests)
    if test():
        return True
    start = time.monotonic()
    deadline = start + seconds
    answer_at = start + YIELD_SECONDS
    spins = 0
    while not test():
        spins += 1
        if OVERSUBSCRIBED:
            os.sched_yield()
        if spins % CHECK_EVERY:
            continue
        now = time.monotonic()
        if now > deadline:
            return False
        waited = now - start
        if now >= answer_at:  # a long wait: whoever timed out may be asking where this rank is
            roll_call.answer_pending()
            answer_at = now + roll_call.ANSWER_EVERY
        if waited > busy:
            time.sleep(NAP_SECONDS)
        elif waited > SPIN_SECONDS:
            os.sched_yield()
    return True


def complete_or_abandon(requests: list, buffers: tuple, seconds: float, late: str,
                        abandon: list | None = None) -> None:
    """Complete `requests` by polling (interruptible), for nbdist's own MPI traffic outside process groups (the
    Trainer's step boundary, a synchroniser's exchange). Interrupted, or still pending after `seconds`, they are given
    up for good (with `abandon`, others in flight beside them; their buffers kept alive: MPI may still write into
    them) and the interrupt, or a TimeoutError saying `late`, is raised."""
    try:
        done = poll(requests, seconds)
    except BaseException:
        abandoned.append((abandon or requests, buffers))
        raise
    if not done:
        abandoned.append((abandon or requests, buffers))
        raise TimeoutError(late)

"""Completing the mpi4py process group's operations: the poll loop, Work objects, futures (runs ON the engines).

Every operation of the mpi4py backend (nbdist/backend/ranks/mpi_backend.py) is one or more non-blocking MPI requests.
They are completed by polling (backend/ranks/waiting.py), so that an interrupt frees a waiting rank; an
operation given up is marked on its process group, which then raises until `mpi_backend.renew()`.

Futures: gloo's Work objects hand out a future that completes by itself. MPI progresses only inside MPI calls, so
a future needs someone to poll: `get_future()` hands the work to one progress thread (started on first use; made
for DDP's reducer and comm hooks, which wait on futures from C++). Works whose future nobody asks for never touch
it, so a plain `dist.all_reduce` pays no thread, lock or future.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from nbdist.backend.ranks import waiting
from nbdist.backend.ranks.waiting import NAP_SECONDS, TRANSFER_SECONDS, poll, test_all
from nbdist.debugging.ranks import recorder
from nbdist.errors import DistUsageError

_in_flight: set = set()  # works not yet complete: torch's C++ side may hold a work whose Python object would
# otherwise be collected (and its buffers, the agreement's among them, freed while MPI still writes into them)
CALLBACK_THREADS = 32  # futures' callbacks run on up to this many threads: a callback may wait on another future


def complete_now(group, op: str, requests: list, finish: Callable | None, buffers: tuple,
                 seconds: float | None = None, also: list = (), transfer: bool = False) -> MpiWork:
    """Complete an operation before returning, for callers that only wait on the Work they get back (torch's
    `dist.*` functions without `async_op`, which say so in `opts.asyncOp`): no Work is made for it, which saves a
    third of the backend's own time per small call. Returns one shared, completed Work. `transfer`: every rank is
    known to be in the operation (waiting.poll)."""
    seconds = group.timeout_seconds if seconds is None else seconds
    try:
        ok = poll(requests, seconds, group.where(op), transfer)
    except BaseException:  # interrupted: the operation is given up (with `also`, posted beside it), out of step
        group.abandon(op, requests + list(also), buffers)
        raise
    if not ok:
        group.abandon(op, requests + list(also), buffers)
        raise group.timeout_error(op, seconds)
    if finish is not None:
        finish()
    return done()


class MpiWork(dist.Work):
    """One operation in flight: its MPI requests, what to do when they complete (copy out of temporaries, divide
    for AVG, cast back from float32), the tensors it returns, and the buffers MPI uses until then.

    `wait`, `is_completed`, `get_future` and `result` behave as gloo's do: `wait` returns True or raises (naming
    the operation), `get_future().value()` is the list of output tensors."""

    def __init__(self, group, op: str, requests: list, outputs: list[torch.Tensor], finish: Callable | None,
                 buffers: tuple, seconds: float | None = None, agreement: tuple | None = None,
                 slot: int | None = None):
        """`agreement`: (Agreement, plan) of a collective, posted just before its data: looked at first. `slot`:
        the operation's entry in the flight recorder, marked when it completes or fails."""
        super().__init__()
        self._slot = slot
        self._agreement = agreement
        self._agreed_at: float | None = None  # when its agreement came back: every rank is in it from then on
        if requests:
            _in_flight.add(self)  # alive until complete, whoever holds it: MPI writes into its buffers until then
        self._seconds = seconds if seconds is not None else (group.timeout_seconds if group is not None else 0.0)
        self._source = requests[0] if len(requests) == 1 and hasattr(requests[0], "source") else None
        self._group, self._op, self._requests, self._outputs = group, op, requests, outputs
        self._finish, self._buffers = finish, buffers
        self._generation = group.generation if group is not None else 0
        self._done = False
        self._future: torch.futures.Future | None = None
        self._error: BaseException | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """True once complete; raises if it failed, was interrupted, or outlasted `timeout` (default, or zero as
        C++ callers pass it: the call's timeout, else the group's)."""
        if self._done:
            return self._raise_if_failed()
        seconds = timeout.total_seconds() if timeout else 0.0
        seconds = seconds if seconds > 0 else self._seconds
        if self._agreement is not None and self._future is None:
            started = time.monotonic()
            self._wait_for_agreement(seconds)
            seconds = max(seconds - (time.monotonic() - started), 1e-3)
        if self._future is not None:  # the progress thread owns the requests now
            if not _wait_interruptibly(self._future, seconds):
                raise self._group.timeout_error(self._op, seconds)
            return self._raise_if_failed()
        try:
            ok = poll(self._requests, seconds, self._group.where(self._op), self._agreed_at is not None)
        except BaseException:  # an interrupt (or any error) between tests: this operation is given up
            self._fail(RuntimeError(f"mpi4py {self._op} was interrupted before it completed"))
            raise
        if not ok:
            self._fail(self._group.timeout_error(self._op, seconds))
            raise self._error
        self._complete(True)
        return True

    def is_completed(self) -> bool:
        if self._agreement is not None and self._future is None:
            if not self._agreement[0].request.Test():
                return False
            try:
                self._check_agreement()
            except DistUsageError:
                return True
        if not self._done and self._future is None and test_all(self._requests):
            self._complete(True)
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def _source_rank(self) -> int:
        """The group rank a completed receive came from (torch's `dist.recv` without `src` asks for it)."""
        if self._source is None:
            raise ValueError(f"mpi4py {self._op}: only a receive knows its source rank")
        self.wait()
        return self._source.source()

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            if self._done:
                self._future.set_result(self._outputs)
            else:
                _progress().add(self)
        return self._future

    # -- agreement first (collectives) --------------------------------------------------------------------------

    def _wait_for_agreement(self, seconds: float) -> None:
        """Wait (interruptibly) for the agreement posted before this work's data, and look at it."""
        agreement = self._agreement[0]
        try:
            ok = poll([agreement.request], seconds, self._group.where(self._op))
        except BaseException:
            self._with_agreement_given_up()
            self._fail(RuntimeError(f"mpi4py {self._op} was interrupted before it completed"))
            raise
        if not ok:
            self._with_agreement_given_up()
            self._fail(self._group.timeout_error(self._op, seconds))
            raise self._error
        self._check_agreement()

    def _with_agreement_given_up(self) -> None:
        """The agreement's request and buffers go with the data's when the work is given up."""
        agreement = self._agreement[0]
        self._requests = self._requests + [agreement.request]
        self._buffers = self._buffers + agreement.buffers()
        self._agreement = None

    def _check_agreement(self, settle: Callable[[Callable], None] | None = None) -> None:
        """The agreement is in: a disagreement fails the work (every rank raises the same line)."""
        agreement, plan = self._agreement
        self._agreement, self._agreed_at = None, time.monotonic()
        try:
            self._group.refuse_disagreement(agreement, plan, self._requests)
        except DistUsageError as error:
            self._error = error
            self._complete(False, settle)
            raise

    # -- completion ---------------------------------------------------------------------------------------------

    def _complete(self, ok: bool, settle: Callable[[Callable], None] | None = None) -> None:
        """Finish the operation (ok) or record that it was abandoned; then settle the future if one exists, through
        `settle` when given (the progress thread hands it to a callback thread: see _Progress)."""
        if ok and self._finish is not None:
            self._finish()
        if self._slot is not None:
            (recorder.end if ok and self._error is None else recorder.failed)(self._slot)
            self._slot = None
        self._done, self._requests, self._finish, self._buffers = True, [], None, ()
        _in_flight.discard(self)
        if self._future is not None and not self._future.done():
            (settle or _call)(self._settle_future)

    def _settle_future(self) -> None:
        if self._future.done():
            return
        if self._error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(self._error)

    def _fail(self, error: BaseException, settle: Callable[[Callable], None] | None = None) -> None:
        self._error = error
        self._group.abandon(self._op, self._requests, self._buffers, self._generation)
        self._complete(False, settle)

    def _raise_if_failed(self) -> bool:
        if self._error is not None:
            raise self._error
        return True


def _wait_interruptibly(future: torch.futures.Future, seconds: float) -> bool:
    """Wait for a future the progress thread settles, in short sleeps, so that SIGINT still frees this rank;
    False if it is not settled within `seconds` (the progress thread still owns it, and times it out itself)."""
    deadline = time.monotonic() + seconds
    while not future.done():
        if time.monotonic() > deadline:
            return False
        time.sleep(NAP_SECONDS)
    return True


def _call(fn: Callable) -> None:
    fn()


class _Progress:
    """One daemon thread that completes the works whose futures were asked for, and times them out.

    It never runs a future's callbacks itself: setting a future's result runs the callbacks chained on it, and a
    callback may wait on another of this backend's futures (torch's PowerSGD hook waits on its second all-reduce
    inside the first one's callback), which only this thread can complete: run inline, that wait would never end
    (seen: both ranks stuck in backward). So results are set on a pool of callback threads, a new one started
    whenever all are busy, and this thread goes on polling."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pending: list[tuple[MpiWork, float]] = []
        self._lock = threading.Condition()
        self._callbacks = ThreadPoolExecutor(max_workers=CALLBACK_THREADS, thread_name_prefix="nbdist-mpi-callback")
        threading.Thread(target=self._run, name="nbdist-mpi-progress", daemon=True).start()

    def _settle_elsewhere(self, fn: Callable) -> None:
        self._callbacks.submit(fn)

    def add(self, work: MpiWork) -> None:
        with self._lock:
            self._pending.append((work, time.monotonic() + work._seconds))
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._lock.wait()
                pending = list(self._pending)
            finished = [entry for entry in pending if self._settle(*entry)]
            with self._lock:
                self._pending = [entry for entry in self._pending if entry not in finished]
            if len(finished) < len(pending):
                self._pause(entry[0] for entry in pending if entry not in finished)

    @staticmethod
    def _pause(unfinished) -> None:
        """Between passes: a yield while a transfer is under way (an agreed work younger than TRANSFER_SECONDS:
        MPICH moves shared-memory data only inside a test, so a nap stalls every rank's copy; seen as DDP's
        buckets completing slower than the same all-reduce waited for in the hook), else a short nap. Where ranks
        outnumber cores, always the nap: the yielding thread took the core from its own rank's backward, and DDP's
        steps were slower yielding than napping (figures: benchmarks/README.md)."""
        now = time.monotonic()
        transferring = any(work._agreed_at is not None and now - work._agreed_at < TRANSFER_SECONDS
                           for work in unfinished)
        if transferring and not waiting.OVERSUBSCRIBED:
            os.sched_yield()
        else:
            time.sleep(NAP_SECONDS / 4)

    def _settle(self, work: MpiWork, deadline: float) -> bool:
        try:
            if work._agreement is not None:  # looked at first
                if not work._agreement[0].request.Test():
                    return self._late(work, deadline)
                try:
                    work._check_agreement(self._settle_elsewhere)
                except DistUsageError:
                    return True
            if test_all(work._requests):
                work._complete(True, self._settle_elsewhere)
            else:
                return self._late(work, deadline)
        except Exception as error:  # noqa: BLE001 - a finish step that failed: the waiter gets it, the thread lives
            work._error = error
            work._complete(False, self._settle_elsewhere)
        return True

    def _late(self, work: MpiWork, deadline: float) -> bool:
        """False while the work may still complete; past its deadline it fails (True: settled)."""
        if time.monotonic() <= deadline:
            return False
        if work._agreement is not None:
            work._with_agreement_given_up()
        work._fail(work._group.timeout_error(work._op, work._seconds), self._settle_elsewhere)
        return True


_progress_thread: _Progress | None = None
_progress_lock = threading.Lock()


def _progress() -> _Progress:
    global _progress_thread
    with _progress_lock:
        if _progress_thread is None:
            _progress_thread = _Progress()
        return _progress_thread


_DONE: list[MpiWork] = []


def done() -> MpiWork:
    """The one completed Work that synchronous calls return (torch's dist.* functions only wait on it)."""
    if not _DONE:
        work = MpiWork(None, "done", [], [], None, ())
        work._done = True
        _DONE.append(work)
    return _DONE[0]

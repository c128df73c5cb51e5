"""The flight recorder: every communication call of this rank in a bounded ring (runs ON the engines).

Why: when a cell hangs, the question is "which rank, waiting on what?". MPI cannot say who has not arrived in a
collective, and a stuck rank cannot be asked through its own busy thread. So each call is written down as it starts
(group, its sequence number on that group, call, peer, elements, dtype, start time) and marked when it ends; the
rank's inspector thread (cluster/waiting/ranks/inspector.py) reads the ring's tail and the main thread's Python stack on
request, without the main thread's help, and the notebook compares the ranks (debugging/hang.py).

Always on, so it must cost almost nothing: one tuple into a preallocated list, one clock read (the start: what a
hang's "waited 8 s" and the order of calls need; when a call ended is never asked, only whether) and one mark per
call, no formatting (names, bytes and text are made only when someone reads the ring).

Runs: the backend's hot path (a waited-for all_reduce SUM, most calls of a training loop) writes one entry for a run
of such calls on one group with one size, not one per call. A small call is short enough that every Python
operation added to it shows (benchmarks/bench_flight_recorder.py; figures: benchmarks/README.md). A run's entry is
its first call (start, size, dtype); its last is its group's count of calls when the next entry is written, or when
the ring is read while the run goes on. A call that does not complete within the hot path's spin marks the run in
flight, since when (`waiting`), and done once it completes, so a hang shows the very call it waits in, and how
long; a call that fails leaves the run for an entry of its own.

Recorded: nbdist's MPI backend for torch.distributed (every collective and point-to-point call), the pipeline's MPI
transport (waits on sends and receives), and what the pipeline executor runs (`doing`: tick and action). torch's own
backends (gloo, NCCL) are recorded by torch's flight recorder, which the inspector reads beside this one.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import traceback

SIZE = 512  # calls kept (a power of two: the slot is the call's number masked)
MASK = SIZE - 1
TAIL = 12  # calls a report carries
STACK_LIMIT = 40  # frames of the main thread a report carries (innermost)

clock = time.perf_counter  # one clock for every process of a host, as the pipeline's spans use
entries: list = [None] * SIZE  # (group, seq, call, peer, numel, dtype, start); group: (name, ranks[, generation])
ends: list = [None] * SIZE  # None while in flight, DONE once completed, FAILED once given up or raised
DONE = True
FAILED = False
lasts: list = [None] * SIZE  # a closed run's last call number (seq); None for an entry of one call
since: list = [None] * SIZE  # when a run's newest call began to wait, while that run is in flight
numbers = itertools.count()  # counts the entries (never reset: an entry's slot is its number masked)
on = True  # whether the call sites record (False: what the recorder's benchmark compares against; see recording)
run_key = None  # what the open run is keyed on (the hot path's: an object per group and size), None when none is
open_run: tuple | None = None  # (slot, process group) of the open run: its group's `calls` count the run's calls
doing = None  # what this rank's code is doing now, set by long-running walkers: (format, *values), formatted only
# when read, e.g. ("pipeline tick {}: {}", 7, action)


def begin(group, seq, call: str, peer, numel: int, dtype) -> int | None:
    """Write down a call as it starts; returns its slot for `end` (None when not recording). `group`: (name,
    global ranks) of its group; `seq`: the call's number on that group (collectives), `peer`: a global rank."""
    if not on:
        return None
    close_run(group, seq)
    slot = next(numbers) & MASK
    entries[slot] = (group, seq, call, peer, numel, dtype, clock())
    ends[slot], lasts[slot] = None, None
    return slot


def start_run(process_group, key, call: str, numel: int, dtype) -> None:
    """Open a run of equal sums for `process_group` (it has `recorded_as` and `calls`, the number of the call now
    starting), keyed on `key` (the caller compares it with run_key before each call: another key, another run)."""
    global run_key, open_run
    slot = begin(process_group.recorded_as, process_group.calls, call, None, numel, dtype)
    if slot is None:  # not recording
        return
    ends[slot] = DONE
    run_key, open_run = key, (slot, process_group)


def close_run(group=None, seq=None) -> None:
    """End the open run, before an entry for call `seq` of `group` is written (None: of no group, or a point-to-point
    call that numbers nothing): its last call is its group's latest, or the one before `seq` on its own group. A run
    left without calls (its first call left it at once) is removed."""
    global run_key, open_run
    if open_run is None:
        return
    slot, process_group = open_run
    last = process_group.calls
    if seq is not None and group is process_group.recorded_as:
        last = seq - 1
    if last < entries[slot][1]:
        entries[slot] = None
    else:
        lasts[slot] = last
    run_key, open_run = None, None


def waiting() -> int | None:
    """The open run's newest call did not complete within the hot path's spin: mark the run in flight, since now.
    Returns its slot for `end` (None when there is no run: recording is off)."""
    run = open_run
    if run is None or not on:  # `on` set False directly (not through recording()) leaves a run open
        return None
    slot = run[0]
    since[slot] = clock()
    ends[slot] = None
    return slot


def run_failed(slot: int | None, process_group, call: str, numel: int, dtype) -> None:
    """The open run's newest call (in flight in `slot`) raised or was given up: it leaves the run (whose calls
    before it completed) for a failed entry of its own."""
    if slot is None:
        return
    ends[slot] = DONE
    failed(begin(process_group.recorded_as, process_group.calls, call, None, numel, dtype))


def recording(flag: bool) -> None:
    """Turn recording on or off (the open run ends: the calls made while off are not its)."""
    global on
    close_run()
    on = flag


def end(slot: int | None) -> None:
    """The call in `slot` completed."""
    if slot is not None:
        ends[slot] = DONE


def failed(slot: int | None) -> None:
    """The call in `slot` raised, was interrupted or given up."""
    if slot is not None:
        ends[slot] = FAILED


def clear() -> None:
    """Forget every call (tests; a user who wants a clean record). In place: call sites hold these lists."""
    global run_key, open_run
    entries[:] = [None] * SIZE
    ends[:] = [None] * SIZE
    lasts[:] = [None] * SIZE
    since[:] = [None] * SIZE
    run_key, open_run = None, None


# -- reading (the inspector thread, on request) ---------------------------------------------------------------------


def tail(n: int = TAIL) -> list[dict]:
    """The last `n` calls, oldest first, as plain data: what the notebook is sent."""
    run = open_run
    recorded = sorted(((entry, ends[slot], _last(slot, run), slot) for slot, entry in enumerate(list(entries))
                       if entry is not None), key=lambda row: row[0][-1])  # in the order they started
    return [_as_data(entry, ended, last, since[slot] if ended is None and last is not None else None)
            for entry, ended, last, slot in recorded[-n:]]


def _last(slot: int, run: tuple | None):
    """The last call of the run in `slot` (the open run's: its group's latest); None for an entry of one call."""
    if run is not None and run[0] == slot:
        return run[1].calls
    return lasts[slot]


def _as_data(entry: tuple, ended, last=None, waits_since=None) -> dict:
    """An entry as plain data; a run's "seq" is its last call, "first" its first, "calls" how many; a run in flight
    (its last call waits) starts when that call began to wait."""
    group, first, call, peer, numel, dtype, start = entry
    seq = first if last is None else last
    start = start if waits_since is None else waits_since
    itemsize = getattr(dtype, "itemsize", None)
    return {
        "group": None if group is None else group[0], "ranks": None if group is None else list(group[1]),
        "generation": group[2] if group is not None and len(group) > 2 else 0,  # renewals of its communicator
        "seq": seq, "first": first, "calls": 1 if last is None else last - first + 1, "call": call, "peer": peer,
        "numel": numel,
        "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "bytes": None if itemsize is None or numel is None else numel * itemsize, "start": start,
        "done": ended is DONE, "failed": ended is FAILED,
    }


def main_stack(limit: int = STACK_LIMIT) -> list[list]:
    """The main thread's Python stack now, outermost first: [file, line, function, source line] per frame. Read
    from another thread: sys._current_frames() needs no help from the thread it looks at."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    frames = _from_rank_entry(traceback.extract_stack(frame))[-limit:]
    return [[f.filename, f.lineno, f.name, (f.line or "").strip()] for f in frames]


RANK_ENTRY = os.path.join("nbdist", "cluster", "launching", "ranks", "main.py")


def _from_rank_entry(frames: traceback.StackSummary) -> list:
    """The frames from the rank's entry (cluster/launching/ranks/main.py's main) inward: a rank forked from the kernel
    (cluster/launching/warm.py) still has the kernel's frames above it, which it is not running."""
    for index, frame in enumerate(frames):
        if frame.name == "main" and frame.filename.endswith(RANK_ENTRY):
            return list(frames[index:])
    return list(frames)


def report() -> dict:
    """What the inspector sends when asked: the recorder's tail, what the rank is doing and its main stack."""
    what = doing
    return {"now": clock(), "calls": tail(), "doing": None if what is None else str(what[0]).format(*what[1:]),
            "stack": main_stack()}

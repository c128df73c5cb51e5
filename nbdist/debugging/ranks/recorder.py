"""The flight recorder: every communication call of this rank in a bounded ring (runs ON the engines).

Why: when a cell hangs, the question is "which rank, waiting on what?". MPI cannot say who has not arrived in a
collective, and a stuck rank cannot be asked through its own busy thread. So each call is written down as it starts
(group, its sequence number on that group, call, peer, elements, dtype, start time) and marked when it ends; the
rank's inspector thread (cluster/ranks/inspector.py) reads the ring's tail and the main thread's Python stack on
request, without the main thread's help, and the notebook compares the ranks (debugging/hang.py).

Always on, so it must cost almost nothing: one tuple into a preallocated list, one clock read (the start: what a
hang's "waited 8 s" and the order of calls need; when a call ended is never asked, only whether) and one mark per
call, no formatting (names, bytes and text are made only when someone reads the ring). Recorded: nbdist's MPI
backend for torch.distributed (every collective and point-to-point call), the pipeline's MPI transport (waits on
sends and receives), and what the pipeline executor runs (`doing`: tick and action). torch's own backends (gloo,
NCCL) are recorded by torch's flight recorder, which the inspector reads beside this one.
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
numbers = itertools.count()  # counts the calls (never reset: a call's slot is its number masked)
on = True  # whether the call sites record (False: what the recorder's benchmark compares against)
doing = None  # what this rank's code is doing now, set by long-running walkers: (format, *values), formatted only
# when read, e.g. ("pipeline tick {}: {}", 7, action)


def begin(group, seq, call: str, peer, numel: int, dtype) -> int | None:
    """Write down a call as it starts; returns its slot for `end` (None when not recording). `group`: (name,
    global ranks) of its group; `seq`: the call's number on that group (collectives), `peer`: a global rank."""
    if not on:
        return None
    slot = next(numbers) & MASK
    entries[slot] = (group, seq, call, peer, numel, dtype, clock())
    ends[slot] = None
    return slot


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
    entries[:] = [None] * SIZE
    ends[:] = [None] * SIZE


# -- reading (the inspector thread, on request) ---------------------------------------------------------------------


def tail(n: int = TAIL) -> list[dict]:
    """The last `n` calls, oldest first, as plain data: what the notebook is sent."""
    recorded = sorted(((entry, ends[slot]) for slot, entry in enumerate(list(entries)) if entry is not None),
                      key=lambda pair: pair[0][-1])  # in the order they started
    return [_as_data(entry, ended) for entry, ended in recorded[-n:]]


def _as_data(entry: tuple, ended) -> dict:
    group, seq, call, peer, numel, dtype, start = entry
    itemsize = getattr(dtype, "itemsize", None)
    return {
        "group": None if group is None else group[0], "ranks": None if group is None else list(group[1]),
        "generation": group[2] if group is not None and len(group) > 2 else 0,  # renewals of its communicator
        "seq": seq, "call": call, "peer": peer, "numel": numel,
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


RANK_ENTRY = os.path.join("nbdist", "cluster", "ranks", "main.py")


def _from_rank_entry(frames: traceback.StackSummary) -> list:
    """The frames from the rank's entry (ranks/main.py's main) inward: a rank forked from the kernel
    (cluster/warm.py) still has the kernel's frames above it, which it is not running."""
    for index, frame in enumerate(frames):
        if frame.name == "main" and frame.filename.endswith(RANK_ENTRY):
            return list(frames[index:])
    return list(frames)


def report() -> dict:
    """What the inspector sends when asked: the recorder's tail, what the rank is doing and its main stack."""
    what = doing
    return {"now": clock(), "calls": tail(), "doing": None if what is None else str(what[0]).format(*what[1:]),
            "stack": main_stack()}

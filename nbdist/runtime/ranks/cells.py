"""What every rank does around each cell and call, so that one cell cannot break the cells after it (this code runs
ON the engines; the kernel's Cluster.start installs it once per engine process).

Why: a rank's sys.stdout and sys.stderr are its way to the notebook (ipykernel's streams over ipyparallel's iopub).
A cell that sets one to None left the engine unable to answer: ipyparallel flushes both after every call, and the
AttributeError there lost the reply, so every later cell waited until its timeout. A cell that closed one left every
later print failing with "I/O operation on closed file", with no word of why nor what to do. After each cell
(IPython's post_run_cell) and each call (the engine's do_apply), a stream that is None or closed is replaced by a
working one and one line on the rank's stderr says so. Within the cell itself Python's own rules stay (a print to a
closed stream raises): only what comes after is repaired.

IPython's "To exit: use 'exit', 'quit', or Ctrl-D." warning after sys.exit() in a cell is quietened too: it points
at IPython's own file in site-packages and at keys a rank has not got; the notebook says in one line what happened
(cluster/waiting/tracebacks.py).

Other rank code that must know when a cell or call has ended asks to be called then (`after_each`): MPI's progress
between cells starts its ticks over (backend/ranks/idle_progress.py).
"""
from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

STREAMS = ("stdout", "stderr")
EXIT_WARNING = r"To exit: use 'exit', 'quit', or Ctrl-D\."  # IPython's, after a SystemExit in a cell
_installed: dict[str, Any] = {}  # "pid": the process it was installed in (a forked rank must install its own)
_originals: dict[str, Any] = {}  # name -> the engine's stream, as installed: its session and topic
_iopub: dict[str, Any] = {}  # name -> its iopub thread (a closed stream lets go of its own)
_after_each: list[Callable[[], None]] = []  # run after each cell and call, once the streams are repaired


def install() -> None:
    """Watch this engine's cells and calls (idempotent per process; a no-op outside an IPython engine)."""
    if _installed.get("pid") == os.getpid():
        return
    warnings.filterwarnings("ignore", message=EXIT_WARNING, category=UserWarning)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if shell is None or kernel is None:
        return
    _originals.clear()
    _originals.update({name: getattr(sys, name) for name in STREAMS})
    _iopub.clear()
    _iopub.update({name: getattr(stream, "pub_thread", None) for name, stream in _originals.items()})
    shell.events.register("post_run_cell", _after_cell)
    kernel.do_apply = functools.partial(_applied, kernel.do_apply)
    _installed["pid"] = os.getpid()


def after_each(callback: Callable[[], None]) -> None:
    """Call `callback()` after each of this engine's cells and calls, from the time `install` has run (before or
    after this): backend/ranks/idle_progress.py starts MPI's progress ticks over."""
    if callback not in _after_each:
        _after_each.append(callback)


def _after_cell(_result=None) -> None:
    repair()
    _ended()


def _applied(do_apply, *args, **kwargs):
    """The engine's do_apply, then the streams repaired (ipyparallel flushes them before it replies)."""
    try:
        return do_apply(*args, **kwargs)
    finally:
        repair()
        _ended()


def _ended() -> None:
    for callback in _after_each:
        callback()


def repair() -> list[str]:
    """Give back a working sys.stdout or sys.stderr where the code just run left None or a closed stream; say so on
    the rank's stderr. The names repaired."""
    broken = {name: getattr(sys, name, None) for name in STREAMS}
    broken = {name: stream for name, stream in broken.items() if stream is None or _closed(stream)}
    for name in broken:
        setattr(sys, name, _working(name))
    for name, stream in broken.items():
        how = "set to None" if stream is None else "closed"
        sys.stderr.write(f"nbdist: sys.{name} was {how} by this code; nbdist gave the rank a new one (its output "
                         "reaches the notebook through it)\n")
    if broken:
        sys.stderr.flush()
    return list(broken)


def _closed(stream: Any) -> bool:
    try:
        return bool(stream.closed)
    except Exception:  # an object without `closed` (a user's writer): theirs, and not ours to judge
        return False


def _working(name: str):
    """The engine's own stream again, or, where it was closed, a new one on the same iopub thread and topic (C-level
    writes to the descriptor then go to mpiexec's output, as the closed stream's capture was undone)."""
    original = _originals.get(name)
    if original is None:
        return getattr(sys, f"__{name}__")
    if not _closed(original):
        return original
    from ipykernel.iostream import OutStream

    stream = OutStream(original.session, _iopub[name], name, watchfd=False)
    stream.topic = original.topic
    stream.set_parent(original.parent_header)
    _originals[name] = stream
    return stream

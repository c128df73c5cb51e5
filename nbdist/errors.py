"""nbdist's kinds of failure, and how a notebook shows them: as one line, not as nbdist's own traceback.

Why one line: when a rank fails, the ranks' own tracebacks (printed just before, labelled by rank) are the story;
the path through nbdist's waiting loop and ipyparallel's threads is noise to the person debugging *their* code.
`NBDIST_DEBUG=1` (in the environment, or `%env NBDIST_DEBUG=1` in the notebook) shows everything instead, for
debugging nbdist itself.
"""
from __future__ import annotations

import os
import sys

DEBUG_ENV = "NBDIST_DEBUG"


class DistUsageError(ValueError):
    """Bad input: the message names the problem in one line. Magics show it as an IPython UsageError."""


class DistError(RuntimeError):
    """A failure on the cluster (a rank raised, timed out or died); the message says which rank and what we did."""


class DistInterrupt(KeyboardInterrupt):
    """The kernel was interrupted while ranks were working; the message says what nbdist did to stop them.

    A KeyboardInterrupt, so that `except KeyboardInterrupt` in the user's loop and "stop Run All" keep working;
    shown as `KeyboardInterrupt: ...`."""


ONE_LINE_ERRORS = (DistError, DistUsageError, DistInterrupt)


def debugging() -> bool:
    """True when the user asked for nbdist's full tracebacks (NBDIST_DEBUG=1), read at each error."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _shown_type(etype: type) -> type:
    return KeyboardInterrupt if issubclass(etype, DistInterrupt) else etype


def _show_one_line(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython's custom-exception hook for nbdist's errors. It must display the error itself (run_code ignores
    the traceback it returns)."""
    if debugging():
        stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    else:
        stb = [f"\x1b[31m{_shown_type(etype).__name__}\x1b[0m: {value}"]
    shell._showtraceback(_shown_type(etype), value, stb)
    return stb


def show_errors_in_ipython(shell=None) -> None:
    """Show nbdist's errors as one line in this IPython session (called by `%load_ext nbdist` and at start).

    Another extension's custom-exception handler keeps working: its exceptions still go to it."""
    if shell is None:
        if "IPython" not in sys.modules:  # a plain Python process: nothing to install, and no IPython to import
            return
        shell = sys.modules["IPython"].get_ipython()
    if shell is None or DistInterrupt in shell.custom_exceptions:  # none here, or already installed
        return
    others = tuple(e for e in shell.custom_exceptions if e not in ONE_LINE_ERRORS)
    previous = shell.CustomTB if others else None

    def handler(shell, etype, value, tb, tb_offset=None):
        if previous is not None and not issubclass(etype, ONE_LINE_ERRORS):
            return previous(etype, value, tb, tb_offset=tb_offset)
        return _show_one_line(shell, etype, value, tb, tb_offset)

    shell.set_custom_exc(ONE_LINE_ERRORS + others, handler)

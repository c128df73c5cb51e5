"""Tie a process's life to another one: when the watched process dies, this one exits.

Why: a notebook kernel killed with SIGKILL runs no cleanup, so the controller and the engines it started would
live on. Each of them runs a lifeline thread that watches the kernel's pid and ends its own process the moment
the kernel is gone. On Linux a pidfd makes that instant; elsewhere we poll.
"""
from __future__ import annotations

import os
import runpy
import select
import signal
import sys
import threading
import time

WATCH_ENV = "NBDIST_KERNEL_PID"


def _wait_for_exit(pid: int, poll_seconds: float = 0.25) -> None:
    """Block until process `pid` has exited."""
    try:
        fd = os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
        os.close(fd)
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(poll_seconds)


def _exit_when_gone(pid: int) -> None:
    _wait_for_exit(pid)
    if os.getpgid(0) == os.getpid():  # a group leader (the controller) takes its helpers with it
        os.killpg(0, signal.SIGKILL)
    os._exit(3)


def start(pid: int | None = None) -> None:
    """Exit this process (hard) as soon as `pid` (default: $NBDIST_KERNEL_PID) is gone."""
    if pid is None:
        value = os.environ.get(WATCH_ENV)
        if not value:
            return
        pid = int(value)
    threading.Thread(target=_exit_when_gone, args=(pid,), daemon=True, name="nbdist-lifeline").start()


def main() -> None:
    """`python -m nbdist.lifeline PID MODULE ARGS...`: run MODULE as __main__, ending when PID ends."""
    pid, module = int(sys.argv[1]), sys.argv[2]
    sys.argv = [module] + sys.argv[3:]
    start(pid)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

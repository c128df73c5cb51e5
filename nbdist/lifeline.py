"""Tie a process's life to another one: when the watched process dies, this one exits.

Why: a notebook kernel killed with SIGKILL runs no cleanup, so the controller and the engines it started would
live on. Each of them runs a lifeline thread that watches the kernel's pid and ends its own process the moment
the kernel is gone. On Linux a pidfd makes that instant; elsewhere we poll. Before it ends its process, the
lifeline also removes the cluster's own profile directory (connection files, logs), which a SIGKILLed kernel
cannot remove itself: a directory is removed only if its owner file names the kernel that died.

Standard library only: this module runs first in every process nbdist starts.
"""
from __future__ import annotations

import os
import runpy
import select
import shutil
import signal
import sys
import threading
import time

WATCH_ENV = "NBDIST_KERNEL_PID"
PROFILE_ENV = "IPP_PROFILE_DIR"  # ipyparallel tells the controller and the engines their profile directory here
OWNER_FILE = "nbdist-kernel"  # in a cluster's profile directory: "<kernel pid> <kernel start time>"


def owner_of(profile_dir: str) -> tuple[int, float] | None:
    """(pid, start time) of the kernel that owns this nbdist profile directory; None if it is not nbdist's."""
    try:
        with open(os.path.join(profile_dir, OWNER_FILE)) as f:
            pid, started = f.read().split()
        return int(pid), float(started)
    except (OSError, ValueError):
        return None


def remove_if_owned_by(profile_dir: str | None, pid: int) -> None:
    """Remove `profile_dir` if nbdist made it for kernel `pid` (never a directory nbdist did not make)."""
    owner = owner_of(profile_dir) if profile_dir else None
    if owner is not None and owner[0] == pid:
        shutil.rmtree(profile_dir, ignore_errors=True)


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
    remove_if_owned_by(os.environ.get(PROFILE_ENV), pid)
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

"""What a launcher's process (the controller, mpiexec) said, read while a start waits: its output's tail, and
the one line of it that says why it ended.

Why apart from launch.py: a start that fails says so in one line with the process's own first complaint, which
takes reading ipyparallel's launchers in a few careful ways (below)."""
from __future__ import annotations

import re
import time

import ipyparallel as ipp

from nbdist.cluster.hosts import token_launcher
from nbdist.cluster.waiting import deaths
from nbdist.errors import DistError


def tail(launcher, lines: int = 15) -> str:
    try:
        with open(launcher.output_file) as f:
            text = f.read()
    except (OSError, TypeError):
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def check_alive(cluster: ipp.Cluster) -> None:
    """Raise, in one line with the process's own first complaint, if the controller or mpiexec has exited. Asked
    of the process itself: ipyparallel's own state changes only when its event loop runs, which a start waiting
    here does not (an mpiexec that could not reach a host was noticed only when the whole timeout ran out)."""
    parts = [("controller", cluster.controller)] + [("engines' mpiexec", es) for es in cluster.engines.values()]
    for name, launcher in parts:
        if launcher is not None and (launcher.state == "after" or _ended(launcher)):
            raise DistError(f"the {name} exited during start-up: {_complaint(_last_words(launcher))}")
    for launcher in cluster.engines.values():  # a node that cannot read the token: its proxy never starts, and the
        unread = [line for line in tail(launcher, 40).splitlines()  # others (and srun, and mpiexec) would wait
                  if line.startswith("nbdist: node ") and token_launcher.UNREAD in line]
        if unread:
            raise DistError(unread[0].removeprefix("nbdist: "))


def _last_words(launcher, wait: float = 1.0) -> str:
    """An ended launcher's output: once ipyparallel has seen its process end it may have read and removed the
    output file (get_output keeps what it read; "(no output)" was said once in four starts with a bad mpiexec
    flag), and a process seen exiting may not have written its last words yet."""
    deadline = time.monotonic() + wait
    while not (text := tail(launcher) or _kept_output(launcher)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return text


def _kept_output(launcher, lines: int = 15) -> str:
    """What ipyparallel read of an ended launcher's output before removing its file, if it did."""
    try:
        text = launcher.get_output() if launcher.state == "after" else ""
    except Exception:  # noqa: BLE001 - a launcher without output of its own
        return ""
    return "\n".join((text or "").strip().splitlines()[-lines:])


def _ended(launcher) -> bool:
    """Whether the launcher's process (a child of this kernel) has exited, or is exiting (deaths.alive)."""
    pid = getattr(launcher, "pid", None)
    return bool(pid) and not deaths.alive(pid)


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(: |$)")  # a Python traceback's last line


def _complaint(output: str) -> str:
    """The line of a launcher's output that says what went wrong: a rank's Python error (the last line of its
    traceback, e.g. "DistUsageError: ..."), else the first line that is not Hydra's own trace ("[mpiexec@host] ...",
    "[proxy:...] ..."), e.g. ssh's "connect to host ... No route to host"."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    raised = [line for line in lines if _RAISED.match(line)]
    if raised:
        return raised[-1]
    own = [line for line in lines if not line.startswith(("[mpiexec@", "[proxy:"))]
    return (own or lines or ["(no output)"])[0].removeprefix("nbdist: ")  # the token launcher's own word

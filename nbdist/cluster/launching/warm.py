"""Ranks forked from the kernel, as accelerate's notebook_launcher forks its workers: the start of a one-host
cluster without each rank importing torch again.

At start the kernel forks one warm process (cluster/launching/ranks/zygote.py), which has everything the kernel imported
(torch, usually), loads what ranks need besides (torch._dynamo, which DDP's constructor imports; the engine), and
forks a rank for each stand-in mpiexec starts (cluster/launching/ranks/warm_stub.py). The MPI job, its launcher and every
promise of a launched cluster stay as they are; only where a rank's interpreter comes from changes.

Used when every engine runs on the kernel's host, on Linux, and while the kernel has initialised neither CUDA (a
forked CUDA context is unusable; the kernel never touches CUDA, but a user's cell may), nor MPI (a kernel's MPI is a
world of one), nor holds NVML open (nbdist's kernel side opens it only to count GPUs, and closes it).
`fork=False` (`%dist_start --no-fork`) or `NBDIST_WARM=0` launches fresh ranks instead. The warm process listens on
a Unix socket in a folder only this user can open, forks only for processes of this user, and dies with the kernel.

The kernel, meanwhile, would only wait: it loads the modules a first training needs (`loader`).
"""
from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import psutil

from nbdist.errors import DistError

WARM_ENV = "NBDIST_WARM"  # "0": launch fresh ranks even where they could be forked
STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranks", "warm_stub.py")

# What a notebook's next cells need in the kernel (a Trainer, a plan, its dashboard in a kernel): imported while the
# start waits for the engines, one module between two looks, instead of after it; only in a kernel that has torch
# already (they import it, which takes seconds: not for a kernel that may never need it; figures:
# benchmarks/README.md)
LOADED_WHILE_STARTING = ("nbdist.training.trainer", "nbdist.sharding.plan")
LOADED_IN_A_KERNEL = ("nbdist.training.dashboard",)  # its widgets and plotly: only where it can be shown
FORK_SECONDS = 10.0  # the longest the fork itself may take (a fork's handlers waiting on a lock): then fresh ranks
STOP_SECONDS = 5.0  # the longest a stop waits for the killed warm process to end (one in the D state never does)
NOT_STARTED = "the warm process that forks the ranks"


@dataclass
class WarmProcess:
    """The kernel's warm process: its pid, the socket its ranks' stand-ins connect to, and the pipe on which it says
    how far its start-up got ("at <step>" lines), until "ready" or "failed <why>"; it closes the pipe then."""

    pid: int
    path: str
    forker: threading.Event  # set at stop: the thread that forked it may end (its end would end the warm process)
    report: int = -1  # the pipe's end, non-blocking; -1 once it is closed
    heard: str = ""
    ended: str | None = None  # in one line, how it ended before it was ready
    reaped: bool = False  # its pid may be another process's now

    def engine_command(self) -> list[str]:
        """What mpiexec runs per rank: the stand-in (no site packages: it starts in milliseconds)."""
        return [sys.executable, "-S", STUB, self.path]

    def processes(self) -> list[psutil.Process]:
        """The warm process and the ranks it forked."""
        try:
            me = psutil.Process(self.pid)
            return [] if self.reaped else [me] + me.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def ranks(self) -> list[psutil.Process]:
        return self.processes()[1:]

    def check(self) -> None:
        """Raise, in one line, if it ended before it was ready (its ranks' stand-ins would only say that it does
        not answer); never waits on it beyond a second."""
        if why := self.failure():
            raise DistError(why)

    def failure(self) -> str | None:
        self._listen()
        return self.ended

    def late(self, seconds: float) -> str | None:
        """Why a start that ran out of time waited, where the warm process never said it was ready."""
        self._listen()
        if self.report < 0:
            return self.ended
        steps = [line[3:] for line in self.heard.splitlines() if line.startswith("at ")]
        return (f"{NOT_STARTED} was not ready within {seconds:g} s (still {steps[-1] if steps else 'starting'}); "
                f"the ranks did not start (raise --timeout, or {WARM_ENV}=0 launches fresh ranks)")

    def _listen(self) -> None:
        if self.report < 0:
            return
        try:
            while chunk := os.read(self.report, 4096):
                self.heard += chunk.decode(errors="replace")
        except BlockingIOError:
            return  # still starting
        os.close(self.report)
        self.report = -1
        lines = self.heard.splitlines()
        if "ready" not in lines:
            self.ended = self._how_it_ended(lines)

    def _how_it_ended(self, lines: list[str]) -> str:
        failed = [line[7:] for line in lines if line.startswith("failed ")]
        steps = [line[3:] for line in lines if line.startswith("at ")]
        status = self._reap(1.0)  # it closed the pipe as it ended: its exit follows at once
        if failed:
            how = f"failed before it was ready ({failed[-1]})"
        elif status is not None and os.WIFSIGNALED(status):
            how = f"was killed by {signal.Signals(os.WTERMSIG(status)).name} before it was ready"
        elif status is not None and os.WIFEXITED(status):
            how = f"exited with code {os.WEXITSTATUS(status)} before it was ready"
        else:
            how = "stopped answering before it was ready"
        where = f" (at {steps[-1]})" if steps and not failed else ""
        return f"{NOT_STARTED} {how}{where}; the ranks did not start ({WARM_ENV}=0 launches fresh ranks instead)"

    def _reap(self, seconds: float) -> int | None:
        """Its wait status, once it has ended within `seconds` (None otherwise, or where it was reaped before)."""
        deadline = time.monotonic() + seconds
        while not self.reaped:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, None
            if pid:
                self.reaped = True
                return status
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return None

    def stop(self) -> None:
        """Kill it (its ranks are killed before, by the cluster's stop) and remove its socket's folder; within
        STOP_SECONDS, however far its start-up got: before its setsid its pid is no process group's."""
        self.forker.set()
        if self.report >= 0:
            os.close(self.report)
            self.report = -1
        if not self.reaped:
            for kill in (os.killpg, os.kill):  # its session and group, with every rank it forked; and itself
                try:
                    kill(self.pid, signal.SIGKILL)
                except OSError:
                    pass
            if self._reap(STOP_SECONDS) is None and not self.reaped:  # unkillable for now: reaped when it ends
                threading.Thread(target=os.waitpid, args=(self.pid, 0), name="nbdist-warm-reap", daemon=True).start()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def usable(multi_host: bool) -> str | None:
    """Why ranks cannot be forked here (None when they can)."""
    if os.environ.get(WARM_ENV, "1") == "0":
        return f"{WARM_ENV}=0"
    if multi_host:
        return "engines on other hosts"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "not Linux"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "this kernel has initialised CUDA"
    if "mpi4py.MPI" in sys.modules:  # a kernel's MPI is a world of one: its forks would inherit it
        return "this kernel has loaded MPI"
    if getattr(sys.modules.get("pynvml"), "_nvmlLib_refcount", 0) > 0:  # NVML's open devices are not a fork's
        return "this kernel holds NVML open"
    return None


def start(private: bool = False) -> WarmProcess:
    """Fork the warm process; it serves from the moment this returns (requests wait while it loads). `private`:
    it enters a network of its own first, as mpiexec does (cluster/launching/privacy.py)."""
    folder = tempfile.mkdtemp(prefix="nbdist-warm-")  # 0700: only this user reaches the socket
    path = os.path.join(folder, "ranks.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    report, told = os.pipe()  # both ends close-on-exec: none of the kernel's other children holds them
    try:
        listener.bind(path)
        listener.listen(256)
        forker = threading.Event()
        pid = _fork_from_a_fresh_thread(listener, forker, private, told)
    except BaseException:
        os.close(report)
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.close(told)  # the warm process's end: the pipe ends with the warm process, or when it is ready
    listener.close()
    os.set_blocking(report, False)
    return WarmProcess(pid=pid, path=path, forker=forker, report=report)


def _fork_from_a_fresh_thread(listener: socket.socket, forker: threading.Event, private: bool, told: int) -> int:
    """Fork from a thread that has never run torch's parallel loops: GNU OpenMP keeps its worker threads per thread
    that started them, and a fork of a thread that has some (the kernel's main thread, once a cell ran a large
    tensor operation) hangs at its first parallel loop; a fork of a fresh thread starts OpenMP afresh (tried:
    the first hangs, the second runs). The forking thread becomes the warm process's main thread. It then waits
    for `forker` (the cluster's stop): Linux's parent-death signal, which ends the warm process with the kernel,
    follows the thread that forked, not the whole kernel. A fork that has not returned within FORK_SECONDS is given
    up (OSError: fresh ranks); should it return later, its child is killed at once."""
    kernel_pid = os.getpid()
    forked: list = []
    given_up: list = []
    lock = threading.Lock()
    for stream in (sys.stdout, sys.stderr):  # a fork copies what they hold: flushed there, it would show twice
        if stream is not None:
            stream.flush()

    def fork() -> None:
        try:
            pid = os.fork()
        except BaseException as e:  # noqa: BLE001 - said in the kernel's thread
            pid = e
        if pid == 0:
            try:
                from nbdist.cluster.launching.ranks import zygote

                zygote.serve(listener, kernel_pid, private, told)  # never returns
            except BaseException as e:  # noqa: BLE001 - e.g. an import failing: said to the kernel, never returns
                os.write(told, f"failed {type(e).__name__}: {e}\n".encode(errors="replace"))
            finally:
                os._exit(1)
        with lock:
            forked.append(pid)
            ready.set()
        if given_up and isinstance(pid, int):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        forker.wait()

    ready = threading.Event()
    thread = threading.Thread(target=fork, name="nbdist-warm-fork", daemon=True)
    thread.start()
    ready.wait(FORK_SECONDS)
    with lock:
        if not forked:
            given_up.append(True)
            forker.set()
            raise OSError(f"the fork of the warm process did not return within {FORK_SECONDS:g} s")
    if isinstance(forked[0], BaseException):
        raise forked[0]
    return forked[0]


def loader(names: Sequence[str]) -> Callable[[], bool]:
    """A step at a time, import the next of `names` (and, in an IPython kernel, of LOADED_IN_A_KERNEL) not yet
    imported, where torch is; False once none is left. A module that fails to import is left for its real import
    to report."""
    wanted = (*names, *(LOADED_IN_A_KERNEL if "ipykernel" in sys.modules else ())) if "torch" in sys.modules else ()
    pending = [name for name in wanted if name not in sys.modules]

    def load_next() -> bool:
        if not pending:
            return False
        try:
            importlib.import_module(pending.pop(0))
        except Exception:  # noqa: BLE001 - said where the module is used, if it is
            pass
        return True

    return load_next

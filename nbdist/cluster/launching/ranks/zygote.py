"""The warm process: forked from the kernel at start (cluster/launching/warm.py), it loads what every rank needs once, then
forks one rank per stand-in that mpiexec started (cluster/launching/ranks/warm_stub.py), each with the descriptors,
environment, folder and arguments Hydra gave that stand-in. A forked rank then runs exactly what a launched rank
runs (`nbdist.cluster.launching.ranks.main`).

A fork of a notebook kernel carries the kernel's state; a rank must not act on any of it:
- the kernel's open descriptors (its ZeroMQ sockets, listening ports, event loops' epoll sets) are pointed at
  /dev/null in the warm process at once: a rank can neither disturb the kernel's event loop nor keep its ports;
- the kernel's Python objects are kept alive, never closed or collected (closing a copied event loop would edit
  the kernel's epoll set), and the singletons that would make the rank's engine reuse them (the kernel's IPython
  shell and application) are cleared;
- its exit handlers are dropped (the kernel's would stop the cluster), its signal handlers reset.

Linux only (fork, /proc, prctl); the kernel falls back to launching fresh ranks elsewhere.
"""
from __future__ import annotations

import array
import asyncio
import atexit
import ctypes
import gc
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import threading

from nbdist.cluster.launching import mpi_segments
from nbdist.cluster.launching.ranks.boot import STAND_IN_ENV

PRELOADED = ("torch", "torch.distributed", "torch.nn.parallel", "ipyparallel.engine.app", "nbdist.cluster.launching.ranks.boot",
             "mpi4py.MPI")  # MPI's library loaded, not initialised: each rank initialises it (_join_mpi)
WITH_TORCH = ("torch._dynamo", "nbdist.data_parallel.ranks.ddp")  # preloaded when the kernel had torch (_preload)
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
MAX_FDS = 253  # SCM_RIGHTS' limit per message
_kept_from_kernel: list[object] = []  # the kernel's objects a rank must never close or collect
_report: list[int] = []  # the pipe to the kernel (cluster/launching/warm.py), until this process is ready


def serve(listener: socket.socket, kernel_pid: int, private: bool = False, report: int = -1) -> None:
    """The warm process's life (never returns): detach from the kernel's state, load, fork ranks on request.
    `private`: first into a network of its own (its ranks say, in their status, if the OS refused it). On `report`
    it tells the kernel each step of its start-up, then "ready" (and closes it), or "failed <why>"."""
    _report[:] = [report] if report >= 0 else []
    try:
        _die_with(kernel_pid)
        if private:  # while this process has one thread, as a new user namespace requires
            from nbdist.cluster.launching.ranks import private_net

            _tell("at entering a network of its own")
            private_net.enter()
        _tell("at leaving the kernel's process group")
        _name_process(f"{sys.executable} -m nbdist.cluster.launching.ranks.zygote {kernel_pid}")
        _detach_from_kernel(keep={listener.fileno(), *_report})
        _preload()
        gc.freeze()  # the kernel's objects are never collected in a rank: its GC need not touch (and copy) them
        _tell("ready")
        if _report:
            os.close(_report.pop())  # before any rank is forked: none holds it
        _loop(listener)
    except BaseException as e:  # noqa: BLE001 - a warm process must never return into the kernel's code
        if not _tell(f"failed {type(e).__name__}: {e}"):
            sys.stderr.write(f"nbdist warm process: {type(e).__name__}: {e}\n")
    os._exit(1)


def _tell(line: str) -> bool:
    """One line to the kernel, while it listens (False after "ready")."""
    try:
        return bool(_report) and os.write(_report[0], (" ".join(line.split()) + "\n").encode(errors="replace")) > 0
    except OSError:
        return False


def _die_with(kernel_pid: int) -> None:
    """The kernel's death (even SIGKILL) ends the warm process: nothing forks ranks for a kernel that is gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != kernel_pid:  # it died before the line above
        os._exit(1)


def _detach_from_kernel(keep: set[int]) -> None:
    os.setsid()  # out of the kernel's process group: Jupyter interrupts a kernel by signalling its whole group
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                   signal.SIGCHLD, signal.SIGPIPE, signal.SIGALRM):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it
    atexit._clear()
    _null_inherited_descriptors(keep)
    _keep_kernel_loop()
    _clear_singletons()
    for name in ("displayhook", "excepthook"):
        setattr(sys, name, getattr(sys, f"__{name}__"))
    _kept_from_kernel.extend([sys.stdin, sys.stdout, sys.stderr, sys.modules.get("__main__")])
    _new_standard_streams()  # a notebook kernel's streams send to its notebook: not this process's to use


def _null_inherited_descriptors(keep: set[int]) -> None:
    """Point every descriptor the kernel had (bar stdout/stderr and `keep`) at /dev/null: the numbers stay taken,
    so a stale object that closes one later closes nothing of ours."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in _listed_descriptors():
        if fd not in keep and fd not in (1, 2, null):
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:
                pass
    os.close(null)


def _listed_descriptors() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def _keep_kernel_loop() -> None:
    """A new asyncio policy for the ranks; the kernel's loops are kept, unclosed (see the module's docstring)."""
    _kept_from_kernel.append(asyncio.get_event_loop_policy())
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())


def _clear_singletons() -> None:
    """The kernel's IPython shell, kernel and application are traitlets singletons: a rank's engine asking for
    its own would get the kernel's (or be refused), so forget them (keeping the objects)."""
    try:
        from traitlets.config import SingletonConfigurable
    except ImportError:
        return
    pending = [SingletonConfigurable]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__dict__.get("_instance") is not None:
            _kept_from_kernel.append(cls._instance)
            cls._instance = None


def _preload() -> None:
    """Import what every rank imports (torch, the engine) once, here, before any fork. And torch._dynamo, which
    DDP's constructor imports (slowly; figures: benchmarks/README.md), when the kernel had torch already: then it
    fits in the time fresh ranks would have spent importing torch, and the first training step finds it loaded; in
    a kernel without torch, torch itself takes that time, and the ranks import torch._dynamo if and when they need
    it.

    MPI is not initialised here (a module importing mpi4py's MPI would make this process a world of one, and every
    rank with it): each rank initialises it, with the PMI socket Hydra gave its stand-in (_join_mpi)."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False
    except ImportError:
        pass
    names = PRELOADED + (WITH_TORCH if "torch" in sys.modules else ())
    for name in names:
        _tell(f"at importing {name}")
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        _one_thread()


def _one_thread() -> None:
    """No parallel loop here may start OpenMP's worker threads: the ranks forked from this thread would hang at
    their first (cluster/launching/warm.py). Each rank sets its own thread count (_threads_as_launched)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _loop(listener: socket.socket) -> None:
    """Fork a rank per request; tell each stand-in its rank's pid, and how it ended."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stand_ins: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 512)
            _reap(stand_ins)
        if listener in ready:
            conn, _ = listener.accept()
            stand_in, uid = _peer(conn)
            if uid != os.getuid():  # only this user's processes get a fork of this user's kernel
                conn.close()
                continue
            others = tuple(sock.fileno() for sock in stand_ins.values())
            pid = _fork_rank(conn, stand_in, closing=(listener.fileno(), wake_read, wake_write, *others))
            if pid:
                stand_ins[pid] = conn


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of `conn`, as the kernel of the OS vouches."""
    import struct

    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _reap(stand_ins: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = stand_ins.pop(pid, None)
        if conn is not None:
            _say(conn, f"exit {status}")
            conn.close()


def _say(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass


def _fork_rank(conn: socket.socket, stand_in: int, closing: tuple[int, ...]) -> int:
    """Read a stand-in's request and fork its rank; the rank's pid (0 if the request was unreadable)."""
    try:
        request, fds = _receive(conn)
        request["env"][STAND_IN_ENV] = str(stand_in)  # Hydra knows the rank by this pid (cluster/waiting/deaths.py)
    except (OSError, ValueError) as e:
        _say(conn, f"error the warm process could not read the rank's request ({e})")
        conn.close()
        return 0
    pid = os.fork()
    if pid == 0:
        _become_rank(conn, request, fds, closing)
    for fd in fds:
        os.close(fd)
    _say(conn, f"pid {pid}")
    return pid


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize))
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(data) < 4:
        raise ValueError("too short")
    size = int.from_bytes(data[:4], "big")
    body = data[4:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ValueError("cut short")
        body += more
    return json.loads(body), list(fds)


def _become_rank(conn: socket.socket, request: dict, fds: list[int], closing: tuple[int, ...]) -> None:
    """In the forked child: take the stand-in's place (descriptors, environment, folder, arguments), then run the
    engine as a launched rank would; never returns."""
    code = 1
    try:
        # before the environment changes (the title takes the space it had), as a launched rank's command line:
        _name_process(" ".join([sys.executable, "-m", "nbdist.cluster.launching.ranks.main", *request["argv"]]))
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        conn = _take_descriptors(fds, request["fds"], conn)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _new_standard_streams()
        _threads_as_launched()
        _settings_as_launched()
        sys.argv = ["ipengine", *request["argv"]]
        _watch_stand_in(conn)
        _join_mpi()
        code = _run_engine()
    except BaseException as e:  # noqa: BLE001
        try:
            sys.stderr.write(f"nbdist rank (forked): {type(e).__name__}: {e}\n")
        except Exception:  # noqa: BLE001
            pass
    _leave(code)


def _take_descriptors(received: list[int], numbers: list[int], conn: socket.socket) -> socket.socket:
    """Put each received descriptor at the number it had in the stand-in (Hydra's PMI_FD names one), after moving
    them and the stand-in's connection out of the way; the connection, at its new number."""
    floor = max(numbers + received + [conn.fileno()]) + 1
    moved = socket.socket(fileno=_dup_above(conn.fileno(), floor))
    conn.close()
    high = [_dup_above(fd, floor) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(high, numbers):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)
    return moved


def _dup_above(fd: int, floor: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


def _new_standard_streams() -> None:
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _threads_as_launched() -> None:
    """A launched rank's torch reads OMP_NUM_THREADS when it is imported; a forked one imported it in the kernel."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _settings_as_launched() -> None:
    """Modules the kernel had imported read their settings from its environment, not Hydra's: read them again (the
    MPI backend's wait spins without yielding where ranks outnumber cores otherwise, and a small all-reduce takes
    several times as long; figures: benchmarks/README.md)."""
    waiting = sys.modules.get("nbdist.backend.ranks.waiting")
    if waiting is not None:
        waiting.read_environment()


def _name_process(title: str) -> None:
    """Show as what this process is, to ps, psutil and tests (a fork shows its kernel's command line otherwise);
    its short name stays the interpreter's."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)
    name = os.path.basename(sys.executable)[:15].encode()  # the title's first 15 bytes otherwise
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def _watch_stand_in(conn: socket.socket) -> None:
    """The stand-in's end closing (Hydra killed it, or its job ended) ends this rank at once."""
    def watch() -> None:
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        mpi_segments.unlink_mapped()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="nbdist-stand-in", daemon=True).start()


def _join_mpi() -> None:
    """Initialise MPI as importing mpi4py's MPI does in a launched rank (thread level, finalised at exit): at that
    import, or now if a preloaded module imported it uninitialised."""
    mpi4py = sys.modules.get("mpi4py")
    if mpi4py is None:
        return
    mpi4py.rc.initialize = True
    if "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI

    levels = {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED, "serialized": MPI.THREAD_SERIALIZED,
              "multiple": MPI.THREAD_MULTIPLE}
    if not MPI.Is_initialized():
        MPI.Init_thread(levels.get(str(mpi4py.rc.thread_level), MPI.THREAD_MULTIPLE))
        atexit.register(lambda: MPI.Is_finalized() or MPI.Finalize())


def _run_engine() -> int:
    from nbdist.cluster.launching.ranks.main import main

    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else _said(e.code))
    return 0


def _said(message: object) -> int:
    sys.stderr.write(f"{message}\n")
    return 1


def _leave(code: int) -> None:
    """Exit as a launched rank would (its exit handlers run, e.g. MPI's finalize), never into the kernel's code."""
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)

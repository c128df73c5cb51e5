"""Tie a process's life to the notebook kernel's: when the kernel dies, this process exits.

Why: a notebook kernel killed with SIGKILL runs no cleanup, so the controller and the engines it started would
live on. Each of them runs a lifeline thread that ends its own process the moment the kernel is gone.

Two ways to notice, chosen by host name (the kernel's travels in the environment, next to its pid):
- on the kernel's host, watch its pid: a pidfd makes that instant (elsewhere we poll);
- on another host that pid means nothing, so hold a TCP connection to the kernel's lifeline server
  (cluster/hosts/lifeline_server.py) instead: the OS closes the kernel's sockets when it dies, even by SIGKILL, and the
  connection's end is the signal. A random token tells a lifeline from a stray connection. The same connection
  brings the kernel's signals to a process on another host (a signal number per line).

Across hosts the connection is TLS: the kernel's certificate, made for the cluster, is pinned by its SHA-256 (public,
in the environment), and the token and what comes back (the controller's connection info and keys) are never in
clear on the wire. The token itself does not travel in the engines' environment there (mpiexec hands that to its
proxies in clear): ssh brings it, or under Slurm a MUNGE credential (cluster/hosts/token_launcher.py); on the
kernel's host it is a file of the cluster's 0700 folder.

Before it ends its process, a lifeline on the kernel's host also removes the cluster's own profile directory
(connection files, logs), which a SIGKILLed kernel cannot remove itself: a directory is removed only if its owner
file names the kernel that died.

Standard library only: this module runs first in every process nbdist starts.
"""
from __future__ import annotations

import os
import runpy
import select
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Iterator, NoReturn

WATCH_ENV = "NBDIST_KERNEL_PID"
HOST_ENV = "NBDIST_KERNEL_HOST"  # the kernel's host name (socket.gethostname())
ADDRESS_ENV = "NBDIST_LIFELINE_ADDR"  # "host:port" of the kernel's lifeline server
TOKEN_ENV = "NBDIST_LIFELINE_TOKEN"  # what a lifeline says first, so the server can tell it from a stray connection
TOKEN_FILE_ENV = "NBDIST_LIFELINE_TOKEN_FILE"  # where the token is on the kernel's host (a path: no secret)
TLS_ENV = "NBDIST_LIFELINE_TLS"  # SHA-256 of the lifeline server's certificate (public): the server speaks TLS
PROFILE_ENV = "IPP_PROFILE_DIR"  # ipyparallel tells the controller and the engines their profile directory here
OWNER_FILE = "nbdist-kernel"  # in a cluster's profile directory: "<kernel pid> <kernel start time>"

ACCEPTED = b"ok\n"  # the server's answer to a good token
CONNECT_SECONDS = 10.0  # how long a lifeline keeps trying to reach the server before its process gives up
HANDSHAKE_SECONDS = 5.0  # how long either side waits for the other's first words
EXIT_CODE = 3

_engine_connection: list[str] = []  # the JSON line the server sent, once it has (engines on other hosts)
_engine_connection_came = threading.Event()


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


UNIX_PREFIX = "unix:"  # an address of a server on the kernel's host: its socket file, in the cluster's 0700 folder


def token() -> str:
    """The cluster's lifeline token: from the environment (one host; ssh put it there on other hosts), else from
    its file on the kernel's host (engines there, in a cluster over several hosts)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    try:
        with open(os.environ.get(TOKEN_FILE_ENV) or os.devnull) as f:
            return f.read().strip()
    except OSError:
        return ""


def open_connection(address: str, timeout: float) -> socket.socket:
    """A connection to the lifeline server at `address`: "host:port" (over TLS where the server's certificate is
    pinned in the environment), or "unix:PATH" for a cluster on one host (a file only this user reaches, and
    reached by path whatever network namespace the ranks are in)."""
    if not address.startswith(UNIX_PREFIX):
        sock = socket.create_connection(split_address(address), timeout=timeout)
        pinned = os.environ.get(TLS_ENV)
        return _over_tls(sock, pinned) if pinned else sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address[len(UNIX_PREFIX):])
    except BaseException:
        sock.close()
        raise
    return sock


def _over_tls(sock: socket.socket, pinned: str) -> socket.socket:
    """`sock` wrapped in TLS 1.3, once the server has shown the certificate whose SHA-256 is `pinned` (the kernel
    made it for this cluster: no certificate authority is asked, and no other server is believed)."""
    import hashlib
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # checked below, against the pin, which is stronger than a CA's word
    try:
        wrapped = context.wrap_socket(sock)
    except BaseException:
        sock.close()
        raise
    shown = hashlib.sha256(wrapped.getpeercert(binary_form=True) or b"").hexdigest()
    if shown != pinned:
        wrapped.close()
        raise ssl.SSLError(f"the server's certificate is not the kernel's (SHA-256 {shown[:16]}...)")
    return wrapped


def split_address(address: str) -> tuple[str, int]:
    """"host:port" (or "[v6 address]:port") -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


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


def _end(pid: int | None, on_kernel_host: bool) -> NoReturn:
    """The one way out: tidy what only the kernel's host can tidy, take our helpers along, exit hard."""
    if on_kernel_host and pid is not None:
        remove_if_owned_by(os.environ.get(PROFILE_ENV), pid)
    from nbdist.cluster.launching import mpi_segments

    mpi_segments.unlink_mapped()  # a rank's MPICH files: MPI_Finalize, which would remove them, never comes
    if os.getpgid(0) == os.getpid():  # a group leader (the controller) takes its helpers with it
        os.killpg(0, signal.SIGKILL)
    os._exit(EXIT_CODE)


def _give_up(address: str, why: str) -> NoReturn:
    """A process that cannot hold its lifeline must not run unwatched: say why in one line, then end."""
    sys.stderr.write(f"nbdist lifeline: {why} (kernel's lifeline server at {address}); this process exits\n")
    sys.stderr.flush()
    _end(None, on_kernel_host=False)


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive, so a kernel host that vanishes without closing anything (power, network) is noticed too,
    within about half a minute. A busy or stopped kernel still answers: its OS does, not its Python. (A Unix
    socket needs none: the kernel's own host closes it.)"""
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _first_words(sock: socket.socket) -> bytes:
    """The server's answer to our token (what it sent before it stopped or closed), or why there was none."""
    answer = b""
    try:
        while len(answer) < len(ACCEPTED):
            part = sock.recv(len(ACCEPTED) - len(answer))
            if not part:
                break
            answer += part
    except OSError as e:
        return f"{type(e).__name__}: {e}".encode()
    return answer


def _connect(address: str, token: str) -> socket.socket:
    """A connection the server has accepted as a lifeline (retrying a refused one briefly: a server that is not
    listening yet), else the process ends in `_give_up`."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            sock = open_connection(address, HANDSHAKE_SECONDS)
            break
        except OSError as e:  # refused (not listening yet or any more), unreachable, timed out
            if time.monotonic() > deadline:
                _give_up(address, f"cannot connect for {CONNECT_SECONDS:g} s: {type(e).__name__}: {e}; "
                         f"is NBDIST_MASTER_ADDR, in the kernel, an address this host can reach?")
            time.sleep(0.2)
    try:
        sock.sendall(f"{token} {socket.gethostname()} {os.getpid()}\n".encode())  # whose line this is
    except OSError:
        pass  # the answer (none) says what happened
    answer = _first_words(sock)
    if answer != ACCEPTED:
        sock.close()
        _give_up(address, "the server closed the connection: it did not accept this process's token" if not answer
                 else f"no acceptance of this process's token from the server ({answer.decode(errors='replace')})")
    sock.settimeout(None)
    keep_alive(sock)
    return sock


def _exit_when_closed(address: str, token: str, pid: int | None) -> None:
    """Hold the lifeline until the server closes it; each line the server sends is a signal's number, raised in
    this process (the kernel interrupting a rank on another host, or asking it to stop)."""
    sock = _connect(address, token)
    for line in lines_from(sock):
        if line.startswith(b"{"):
            _engine_connection.append(line.decode())
            _engine_connection_came.set()
        elif line.strip().isdigit():
            os.kill(os.getpid(), int(line))
    _end(pid, on_kernel_host=False)


def lines_from(sock: socket.socket) -> Iterator[bytes]:
    """Each line the other end sends, until it closes the connection (or the connection fails)."""
    pending = b""
    try:
        while data := sock.recv(4096):
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                yield line
    except OSError:
        return


def engine_connection_info(timeout: float) -> str | None:
    """The controller's connection info for engines (JSON, as ipyparallel writes it to its engine connection file),
    sent down this process's lifeline by the kernel, which is the one host that has the file; None if it did not
    come within `timeout` seconds or this process holds no lifeline to a server."""
    _engine_connection_came.wait(timeout)
    return _engine_connection[-1] if _engine_connection else None


def _exit_when_gone(pid: int) -> None:
    _wait_for_exit(pid)
    _end(pid, on_kernel_host=True)


def on_kernel_host() -> bool:
    """Whether this process runs on the notebook kernel's host (true when the kernel did not say where it is)."""
    kernel_host = os.environ.get(HOST_ENV)
    return not kernel_host or kernel_host == socket.gethostname()


def start(pid: int | None = None) -> None:
    """Exit this process (hard) as soon as the kernel is gone: kernel `pid` (default $NBDIST_KERNEL_PID) on its
    own host, the kernel's lifeline server ($NBDIST_LIFELINE_ADDR) from any other host."""
    if pid is None and os.environ.get(WATCH_ENV):
        pid = int(os.environ[WATCH_ENV])
    address = os.environ.get(ADDRESS_ENV)
    if address and not on_kernel_host():
        target, args = _exit_when_closed, (address, token(), pid)
    elif pid is not None:
        target, args = _exit_when_gone, (pid,)
    else:
        return
    threading.Thread(target=target, args=args, daemon=True, name="nbdist-lifeline").start()


def main() -> None:
    """`python -m nbdist.cluster.hosts.lifeline PID MODULE ARGS...`: run MODULE as __main__, ending when the kernel PID ends."""
    pid, module = int(sys.argv[1]), sys.argv[2]
    sys.argv = [module] + sys.argv[3:]
    start(pid)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

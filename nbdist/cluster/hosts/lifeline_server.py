"""The kernel's end of the engines' lifelines across hosts: a TCP server that holds one connection per engine.

Why: an engine on another host cannot watch the kernel's pid (cluster/hosts/lifeline.py). It holds a connection to this server
instead, and exits when that connection ends, which happens the moment the kernel process dies, however it dies:
the OS closes a dead process's sockets. So the server does nothing but accept, check the token and hold on; it runs
in a daemon thread of the kernel, one per cluster, from just before the engines start until after they are stopped.

The server runs for every cluster, single-host ones too: `--mpi-args` is not the only way mpiexec spreads ranks
over hosts (a hostfile in Hydra's environment, a batch allocation), so only the engines know where they run, and
each chooses by comparing host names. On one host it costs a thread that waits and a socket nobody connects to.

The line back to an engine carries signals too: the kernel cannot signal a process on another host, so to
interrupt a rank there (a failed peer left it waiting; the user pressed stop) `signal(host, pid, number)` writes the
signal's number down that rank's lifeline, and the lifeline thread raises it in its own process, as a local
`kill` would. Each lifeline says its host and pid after the token, so the server knows whose line is whose.
The same line carries the controller's connection info to engines on other hosts (`publish_engine_connection`):
they cannot read it from the kernel's files, and nothing of the cluster is written on their hosts.

Connections that do not say the cluster's token within a few seconds are closed: a port scanner or a stray client
is never taken for a lifeline. At most MAX_PENDING connections wait to say it: a flood of them (each holds one of
the kernel's files open) makes the server drop the oldest waiting one for each new one, so the kernel's open
files stay bounded and an engine, which says its token as soon as it connects, still gets through. Sockets made in
Python are not inherited by child processes (PEP 446), so mpiexec and the controller never hold the kernel's end
open after the kernel has died.

Across hosts the server speaks TLS 1.3 only, with a certificate and key made for the cluster (`openssl`, the
command; the key never touches the disk for longer than it takes to load it): the token, the signals and the
controller's connection info and keys are never in clear on the wire. The engines pin the certificate by its SHA-256,
which travels in their environment (public), while the token does not: mpiexec hands that environment to its
proxies in clear, so `secret_environment()` is for a private channel only (cluster/hosts/token_launcher.py: ssh).
On one host the socket file in the cluster's 0700 folder needs neither.

Kernel side; standard library only (and the `openssl` command across hosts), besides nbdist's error type.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import selectors
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time

from nbdist.cluster.hosts.lifeline import (
    ACCEPTED,
    ADDRESS_ENV,
    HANDSHAKE_SECONDS,
    HOST_ENV,
    TLS_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    WATCH_ENV,
    UNIX_PREFIX,
    keep_alive,
)
from nbdist.cluster.hosts.ranks.addresses import MASTER_ADDR_ENV
from nbdist.errors import DistUsageError

THREAD_NAME = "nbdist-lifeline-server"
_TOKEN_LINE_LIMIT = 256  # a client that says more than this before a newline is not one of ours
MAX_PENDING = 64  # connections not yet past the token at once; beyond, the oldest is dropped for each new one


class LifelineServer:
    """Holds the engines' lifeline connections for one cluster; `close()` ends them all and the thread."""

    def __init__(self, host: str = "127.0.0.1", handshake_seconds: float = HANDSHAKE_SECONDS, path: str | None = None,
                 token_file: str | None = None, tls: bool = False):
        self.token = secrets.token_hex(16)
        self.handshake_seconds = handshake_seconds
        self.token_file = token_file
        self._tls: ssl.SSLContext | None = None
        self.fingerprint = ""  # SHA-256 of the TLS certificate, where the server speaks TLS
        if path is not None:  # a cluster on one host: a socket file in its 0700 folder, not a port every user reaches
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(path)
            self._listener.listen(128)
            self.address = f"{UNIX_PREFIX}{path}"
        else:
            if tls:  # toward other hosts: nothing it carries is read on the way
                self._tls, self.fingerprint = _tls_context()
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, 0), family=family, backlog=128)
            self.address = f"[{host}]:{self.port}" if family == socket.AF_INET6 else f"{host}:{self.port}"
        if token_file is not None:  # for the engines on the kernel's host, and the launcher that brings it elsewhere
            descriptor = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as f:
                f.write(self.token)
        self._io = threading.Lock()  # a TLS connection is not to be read and written from two threads at once
        self._wake_read, self._wake_write = socket.socketpair()
        self._pending: dict[socket.socket, tuple[float, bytes]] = {}  # no token yet: (deadline, what it said so far)
        self._held: set[socket.socket] = set()
        self._by_process: dict[tuple[str, int], socket.socket] = {}  # (host, pid) -> that process's lifeline
        self._lost: set[tuple[str, int]] = set()  # processes whose lifeline ended while the server ran
        self._inspectors: dict[tuple[str, int], socket.socket] = {}  # (host, pid) -> that engine's inspector line
        self._heard_from: dict[socket.socket, tuple[tuple[str, int], bytes]] = {}  # an inspector line -> its
        # process and what it sent that is not yet a whole line
        self._reports: dict[tuple[str, int], bytes] = {}  # (host, pid) -> its last report (a JSON line)
        self._engine_connection = b""  # the line every lifeline gets, once published: the controller's JSON
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)
        self._closing = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name=THREAD_NAME)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def environment(self) -> dict[str, str]:
        """What an engine needs to hold its lifeline: the kernel's pid and host name, this server, and the token on
        one host. Across hosts the token stays out (mpiexec sends this environment to its proxies in clear): the
        certificate's SHA-256 and the token file's path on the kernel's host go instead, neither of them a secret."""
        env = {
            WATCH_ENV: str(os.getpid()),
            HOST_ENV: socket.gethostname(),
            ADDRESS_ENV: self.address,
        }
        if self._tls is None:
            env[TOKEN_ENV] = self.token
        else:
            env[TLS_ENV] = self.fingerprint
        if self.token_file is not None:
            env[TOKEN_FILE_ENV] = self.token_file
        return env

    def secret_environment(self) -> dict[str, str]:
        """The token, for a channel that is itself private (ssh: cluster/hosts/token_launcher.py); never for
        mpiexec's environment across hosts."""
        return {TOKEN_ENV: self.token}

    def held(self) -> int:
        """How many lifelines (connections that said the token) are held now."""
        with self._lock:
            return len(self._held)

    def pending(self) -> int:
        """How many connections are waiting to say the token now (at most MAX_PENDING)."""
        with self._lock:
            return len(self._pending)

    def signal(self, host: str, pid: int, number: int) -> bool:
        """Ask process `pid` on `host` (one that holds a lifeline) to raise signal `number` in itself; False when no
        such lifeline is held (the process is on the kernel's host, or gone)."""
        with self._lock:
            conn = self._by_process.get((host, pid))
        if conn is None:
            return False
        try:
            with self._io:
                conn.send(f"{number}\n".encode())  # a few bytes into a nearly empty send buffer: never blocks
        except OSError:
            return False
        return True

    def publish_engine_connection(self, info: dict) -> None:
        """Send the controller's connection info for engines down every lifeline held now or accepted later: an
        engine on another host registers with it (lifeline.engine_connection_info)."""
        line = json.dumps(info, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            self._engine_connection = line
            held = list(self._held)
        for conn in held:
            self._send(conn, line)

    def lost(self) -> set[tuple[str, int]]:
        """(host, pid) of every process whose lifeline ended while the cluster ran: it exited, or its host died or
        became unreachable (TCP keepalive notices that within 10 + 3 × 5 = 25 s: lifeline.py's settings)."""
        with self._lock:
            return set(self._lost)

    def inspect(self, processes: list[tuple[str, int]], timeout: float) -> dict[tuple[str, int], dict | None]:
        """Ask each engine (host, pid) what it is doing (cluster/waiting/ranks/inspector.py answers from a thread of its
        own); its report as a dict, or None when it has no inspector line or did not answer within `timeout`."""
        with self._lock:
            lines = {process: self._inspectors.get(process) for process in processes}
            for process in processes:
                self._reports.pop(process, None)
        for conn in lines.values():
            if conn is not None:
                self._send(conn, b"why\n")
        deadline = time.monotonic() + timeout
        asked = [process for process, conn in lines.items() if conn is not None]
        with self._reported:
            while any(p not in self._reports for p in asked) and (left := deadline - time.monotonic()) > 0:
                self._reported.wait(left)
            reports = {process: self._reports.pop(process, None) for process in processes}
        return {process: _parsed(line) for process, line in reports.items()}

    @property
    def serving(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving: every held lifeline ends (their processes exit), the listening socket and the thread go."""
        self._closing = True
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        if self.token_file is not None:
            try:
                os.remove(self.token_file)
            except OSError:
                pass

    def _send(self, conn: socket.socket, line: bytes) -> None:
        """A line (under a kilobyte) into a lifeline's nearly empty send buffer; a lifeline that has gone is the
        server thread's to drop."""
        try:
            with self._io:
                conn.sendall(line)
        except OSError:
            pass

    # -- the thread ---------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._closing:
                for key, _ in selector.select(timeout=self._next_deadline()):
                    self._on_readable(selector, key.fileobj)
                self._drop_late(selector)
        finally:
            self._close_all(selector)

    def _next_deadline(self) -> float | None:
        with self._lock:
            deadlines = [deadline for deadline, _ in self._pending.values()]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _on_readable(self, selector: selectors.BaseSelector, sock) -> None:
        if sock is self._wake_read:
            return  # close() woke us; the loop sees _closing
        if sock is self._listener:
            self._accept(selector)
            return
        if isinstance(sock, ssl.SSLSocket) and sock in self._pending and not self._handshaken(selector, sock):
            return
        try:
            with self._io:
                data = sock.recv(4096)
                while isinstance(sock, ssl.SSLSocket) and sock.pending():  # TLS keeps what the record held
                    data += sock.recv(sock.pending())
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return  # part of a TLS record: the rest is on its way
        except OSError:
            data = b""
        if not data:  # the other end has gone (an engine exited, or a stray client hung up)
            self._drop(selector, sock)
        elif sock in self._pending:
            self._heard(selector, sock, data)
        elif sock in self._heard_from:
            self._reading_report(sock, data)
        # a held lifeline has nothing to say; anything it sends is ignored

    def _reading_report(self, conn: socket.socket, data: bytes) -> None:
        """An inspector's answer arrives, possibly in parts; a whole line is its report."""
        with self._reported:
            process, said = self._heard_from[conn]
            *lines, rest = (said + data).split(b"\n")
            self._heard_from[conn] = (process, rest)
            if lines:
                self._reports[process] = lines[-1]
                self._reported.notify_all()

    def _handshaken(self, selector: selectors.BaseSelector, conn: ssl.SSLSocket) -> bool:
        """Advance a TLS handshake (non-blocking); True once it is done. A peer that fails it is dropped."""
        try:
            with self._io:
                conn.do_handshake()
            return True
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        except OSError:  # not TLS, or not TLS 1.3: a scanner, a stray client
            self._drop(selector, conn)
            return False

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        if self._tls is not None:
            conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            oldest = next(iter(self._pending)) if len(self._pending) >= MAX_PENDING else None
            self._pending[conn] = (time.monotonic() + self.handshake_seconds, b"")
        if oldest is not None:  # dicts keep their order of insertion: the first is the longest waiting
            self._drop(selector, oldest)
        selector.register(conn, selectors.EVENT_READ)

    def _heard(self, selector: selectors.BaseSelector, conn: socket.socket, data: bytes) -> None:
        """A pending connection said something: the token and a newline makes it a lifeline; anything else ends it."""
        deadline, said = self._pending[conn]
        said += data
        if b"\n" not in said:
            if len(said) > _TOKEN_LINE_LIMIT:
                self._drop(selector, conn)
            else:
                with self._lock:
                    self._pending[conn] = (deadline, said)
            return
        token, _, who = said.split(b"\n", 1)[0].partition(b" ")
        if not hmac.compare_digest(token, self.token.encode()):
            self._drop(selector, conn)
            return
        try:
            with self._io:
                conn.send(ACCEPTED)  # three bytes into an empty send buffer: never blocks
        except OSError:
            self._drop(selector, conn)
            return
        host, pid, *what = who.decode(errors="replace").split(" ") + [""]  # "host pid" or "host pid inspect rank"
        with self._lock:
            del self._pending[conn]
            if what[:1] == ["inspect"] and pid.isdigit():  # an engine's inspector (cluster/waiting/ranks/inspector.py)
                self._inspectors[(host, int(pid))] = conn
                self._heard_from[conn] = ((host, int(pid)), b"")
                return
            self._held.add(conn)
            if pid.isdigit():
                self._by_process[(host, int(pid))] = conn
            published = self._engine_connection
        keep_alive(conn)  # a host that vanishes without closing anything is noticed here too
        if published:
            self._send(conn, published)

    def _drop_late(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, (deadline, _) in self._pending.items() if deadline <= now]
        for conn in late:
            self._drop(selector, conn)

    def _drop(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            self._held.discard(conn)
            self._heard_from.pop(conn, None)
            for key in [k for k, held in self._inspectors.items() if held is conn]:
                del self._inspectors[key]
            for key in [k for k, held in self._by_process.items() if held is conn]:
                del self._by_process[key]
                if not self._closing:
                    self._lost.add(key)
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _close_all(self, selector: selectors.BaseSelector) -> None:
        with self._lock:
            conns = list(self._pending) + list(self._held) + list(self._heard_from)
            self._pending.clear()
            self._held.clear()
            self._heard_from.clear()
            self._inspectors.clear()
            self._by_process.clear()
        for sock in conns + [self._listener, self._wake_read, self._wake_write]:
            sock.close()
        selector.close()


def _tls_context() -> tuple[ssl.SSLContext, str]:
    """A TLS 1.3 server context with a certificate and key made now for this cluster (EC P-256, self-signed: the
    engines pin it), and the certificate's SHA-256. The key is loaded and its file removed at once."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise DistUsageError("engines on other hosts need the openssl command on PATH here: it makes the TLS "
                             "certificate of the kernel's lifeline server (apt-get install openssl)")
    with tempfile.TemporaryDirectory(prefix="nbdist-tls-") as folder:  # 0700
        key, cert = os.path.join(folder, "key.pem"), os.path.join(folder, "cert.pem")
        made = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                               "-nodes", "-days", "30", "-subj", "/CN=nbdist-lifeline", "-keyout", key, "-out", cert],
                              capture_output=True, text=True, timeout=30)
        if made.returncode != 0:
            raise DistUsageError(f"openssl could not make the lifeline's TLS certificate: {made.stderr.strip()[-200:]}")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(cert, key)
        with open(cert) as f:
            fingerprint = hashlib.sha256(ssl.PEM_cert_to_DER_cert(f.read())).hexdigest()
    return context, fingerprint


def _parsed(line: bytes | None) -> dict | None:
    try:
        return json.loads(line) if line else None
    except ValueError:
        return None


def serve(host: str, path: str | None = None, token_file: str | None = None) -> LifelineServer:
    """A lifeline server for one cluster, listening on `host`, the address the cluster's engines reach the kernel
    by (ClusterOptions.kernel_address), or on socket file `path` where every engine is on the kernel's host.
    `token_file` (a cluster over several hosts): where the engines on the kernel's host find the token, in the
    cluster's folder; the server then speaks TLS."""
    try:
        return LifelineServer(host, path=path, token_file=token_file, tls=path is None and token_file is not None)
    except OSError as e:
        raise DistUsageError(
            f"cannot serve the engines' lifeline on {host!r} ({e}): set {MASTER_ADDR_ENV} to an address of this host"
        ) from None

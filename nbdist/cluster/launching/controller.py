"""The controller process: ipyparallel's controller, whose heart monitor beats fast until the engines have registered.

Why: ipyparallel's hub counts an engine only once its heart has answered a beat, and answers are read at the beat
after; with the 1 s beat the running cluster wants (each beat wakes this process and every engine: cheap while
idle) that is 1-2 s added to every start, after the engines are otherwise ready. A 10 ms beat costs a large share of
a core, too much to keep (figures: benchmarks/README.md), so the monitor beats every FAST_MS until as many hearts
beat as engines were asked for, then settles to its configured period (tornado's PeriodicCallback reads its period
at each beat).

Across hosts it also admits only the cluster's own peers (`admit_only`): ipyparallel's CurveZMQ encrypts, but a
CURVE server with no ZAP handler accepts every client that knows its public key, and that key is in every
connection file. So each ZeroMQ context of this process gets a ZAP handler that allows the kernel's client and the
engines (the public keys the kernel made and names here), and the keypairs this process makes for its own inner
connections; any other peer's handshake is refused, and it reads nothing.

    python -m nbdist.cluster.hosts.lifeline KERNEL_PID nbdist.cluster.launching.controller ENGINES [--admit=KEY,KEY]
        [ipcontroller arguments]
"""
from __future__ import annotations

import os
import sys
import threading

ADMIT_FLAG = "--admit="  # the public CURVE keys of the kernel's client and of the engines (public: no secret here)

FAST_MS = 10


def beat_fast_until(engines: int) -> None:
    """Make every HeartMonitor made from now on (the controller forks it) beat every FAST_MS until `engines` hearts
    beat. Wraps ipyparallel's own start and beat; the monitor's logic is unchanged."""
    from ipyparallel.controller import heartmonitor

    start, beat = heartmonitor.HeartMonitor.start, heartmonitor.HeartMonitor.beat

    def start_fast(monitor) -> None:
        start(monitor)
        if len(monitor.hearts) < engines:  # tornado set the first beat one whole period away: FAST_MS from now
            monitor.caller.stop()
            monitor.caller.callback_time = min(FAST_MS, monitor.period)
            monitor.caller.start()

    def beat_then_settle(monitor) -> None:
        beat(monitor)
        if len(monitor.hearts) >= engines:
            monitor.caller.callback_time = monitor.period

    heartmonitor.HeartMonitor.start = start_fast
    heartmonitor.HeartMonitor.beat = beat_then_settle


def ipc_urls_as_engines_join_them() -> None:
    """ipyparallel's controller joins an IPC address and its port with "-" (ipc:///folder/zmq-PORT), but its
    client and engines join every address with ":" and would knock on files that do not exist (the client's
    "Hub connection request timed out"): the controller joins with ":" too, a name as good for a socket file."""
    from ipyparallel.controller.app import IPController

    construct_url = IPController.construct_url

    def joined_with_colon(controller, kind: str, channel: str, index=None) -> str:
        url = construct_url(controller, kind, channel, index)
        if url.startswith("ipc://"):
            address, _, port = url.rpartition("-")
            url = f"{address}:{port}"
        return url

    IPController.construct_url = joined_with_colon


def admit_only(allowed: set[bytes]) -> None:
    """Give every ZeroMQ context that binds a CURVE server socket a ZAP handler that admits the `allowed` public
    keys (Z85) and those this process makes itself (zmq.curve_keypair: ipyparallel's own connections between its
    schedulers, hub and heart monitor), before that socket binds. Wraps pyzmq's bind and keypair; the sockets are
    ipyparallel's, unchanged."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    allowed = set(allowed)
    guards: dict[tuple[int, int], ThreadAuthenticator] = {}  # (pid, context id): the heart monitor is a fork
    lock = threading.Lock()
    make_keypair, bind = zmq.curve_keypair, zmq.Socket.bind

    class Admitted:
        def callback(self, domain: str, key: bytes) -> bool:
            return key in allowed

    def own_keypair() -> tuple[bytes, bytes]:
        public, secret = make_keypair()
        allowed.add(public)
        return public, secret

    def guarded_bind(socket, address: str):
        if socket.getsockopt(zmq.CURVE_SERVER):
            with lock:
                where = (os.getpid(), id(socket.context))
                if where not in guards:
                    guard = guards[where] = ThreadAuthenticator(socket.context)
                    guard.start()
                    guard.configure_curve_callback("*", credentials_provider=Admitted())
        return bind(socket, address)

    zmq.curve_keypair = own_keypair
    zmq.Socket.bind = guarded_bind


def main() -> None:
    engines = int(sys.argv.pop(1))
    if sys.argv[1:2] and sys.argv[1].startswith(ADMIT_FLAG):
        admit_only({key.encode("ascii") for key in sys.argv.pop(1)[len(ADMIT_FLAG):].split(",")})
    beat_fast_until(engines)
    ipc_urls_as_engines_join_them()
    from ipyparallel.controller.app import main as ipcontroller_main

    ipcontroller_main()


if __name__ == "__main__":
    main()

"""The controller process: ipyparallel's controller, whose heart monitor beats fast until the engines have registered.

Why: ipyparallel's hub counts an engine only once its heart has answered a beat, and answers are read at the beat
after; with the 100 ms beat the running cluster wants (cheap while idle) that is 100-200 ms added to every start,
after the engines are otherwise ready. A 10 ms beat costs several times as much of a core, too much to keep
(figures: benchmarks/README.md), so the monitor beats every FAST_MS until as many hearts beat as engines were
asked for, then settles to its configured period (tornado's PeriodicCallback reads its period at each beat).

    python -m nbdist.cluster.hosts.lifeline KERNEL_PID nbdist.cluster.launching.controller ENGINES [ipcontroller arguments]
"""
from __future__ import annotations

import sys

FAST_MS = 10


def beat_fast_until(engines: int) -> None:
    """Make every HeartMonitor made from now on (the controller forks it) beat every FAST_MS until `engines` hearts
    beat. Wraps ipyparallel's own start and beat; the monitor's logic is unchanged."""
    from ipyparallel.controller import heartmonitor

    start, beat = heartmonitor.HeartMonitor.start, heartmonitor.HeartMonitor.beat

    def start_fast(monitor) -> None:
        start(monitor)
        if len(monitor.hearts) < engines:
            monitor.caller.callback_time = min(FAST_MS, monitor.period)

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


def main() -> None:
    engines = int(sys.argv.pop(1))
    beat_fast_until(engines)
    ipc_urls_as_engines_join_them()
    from ipyparallel.controller.app import main as ipcontroller_main

    ipcontroller_main()


if __name__ == "__main__":
    main()

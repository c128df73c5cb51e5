"""Whether the other hosts of a start still answer, asked while the start waits for their engines.

Why: a host that drops off the network after ssh has reached it leaves nothing to notice: its engines never
register, mpiexec's connection to its proxy just stalls, and the start waited its whole timeout to say "only 1 of 2
engines registered (raise --timeout?)", naming no host. A host that answers a TCP connection (accepted or refused,
on any port) is on the network; one that answered once and then answers neither within a few seconds has dropped off (one that never
answered may only filter the port asked, so it is not named).
"""
from __future__ import annotations

import socket
import threading
import time

PORT = 22  # any port does: a refusal answers as well as an accept
ANSWER_SECONDS = 3.0  # a host on the cluster's network answers within milliseconds
EVERY_SECONDS = 2.0


def answers(host: str, timeout: float = ANSWER_SECONDS) -> bool:
    """Whether `host` answers a TCP connection (accepted or refused) within `timeout` seconds."""
    try:
        with socket.create_connection((host, PORT), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return True
    except socket.gaierror:  # a name this host cannot resolve: nothing to tell
        return True
    except OSError:  # timed out, no route, network unreachable
        return False


class HostWatch:
    """Asks the hosts in the background, every few seconds while a start waits; `silent()` lists those that answered
    before and not the last time they were asked."""

    def __init__(self, hosts: list[str]) -> None:
        self.hosts = list(dict.fromkeys(hosts))
        self._silent: list[str] = []
        self._answered: set[str] = set()
        self._next = time.monotonic()
        self._asking: threading.Thread | None = None

    def silent(self) -> list[str]:
        if self.hosts and time.monotonic() > self._next and (self._asking is None or not self._asking.is_alive()):
            self._asking = threading.Thread(target=self._ask, daemon=True, name="nbdist-host-watch")
            self._asking.start()
            self._next = time.monotonic() + EVERY_SECONDS
        return list(self._silent)

    def _ask(self) -> None:
        results: dict[str, bool] = {}
        threads = [threading.Thread(target=lambda h=h: results.__setitem__(h, answers(h)), daemon=True)
                   for h in self.hosts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._silent = [h for h in self.hosts if h in self._answered and not results.get(h, True)]
        self._answered |= {h for h in self.hosts if results.get(h, True)}


def ranks_on(hosts: tuple[str, ...], n: int) -> dict[str, list[int]]:
    """Which ranks Hydra places on each of `hosts` ("a:2,b:1" form: filled in order, one slot where none is said),
    when the slots hold every rank; {} where they do not (Hydra then wraps around)."""
    placed: dict[str, list[int]] = {}
    rank = 0
    for entry in hosts:
        name, _, slots = entry.partition(":")
        count = int(slots) if slots.isdigit() else 1
        placed.setdefault(name, []).extend(range(rank, rank + count))
        rank += count
    return placed if rank == n else {}


def silent_line(silent: list[str], placed: dict[str, list[int]]) -> str:
    """One line naming the hosts that stopped answering during a start, with the ranks each was to run."""
    parts = []
    for host in silent:
        ranks = placed.get(host, [])
        held = (f" (rank {ranks[0]})" if len(ranks) == 1 else f" (ranks {', '.join(map(str, ranks))})") if ranks else ""
        parts.append(f"host {host}{held}")
    return (f"{', '.join(parts)} stopped answering during the start (no answer within {ANSWER_SECONDS:g} s): its "
            "engines cannot register; the start was stopped")

"""torch.distributed's key-value store carried over MPI: the rendezvous without a listening socket.

torch's TCPStore answers whoever connects (no authentication: keys can be read, set and deleted from another host,
and gloo's and NCCL's peer addresses and ids travel through it). The ranks already share a channel only they
reach, MPI's world, so across hosts the store rides on it: rank 0 keeps the keys in a thread that answers requests
on its own duplicate of the world communicator; every rank (rank 0 too) asks by message. Waiting for a key that is
not there yet is answered when the key is set, or with a timeout. Both sides poll (MPI's blocking receive would
spin a core for the cluster's life): every 0.2 ms while requests come, every 20 ms after a quiet second.

torch calls the store at process-group creation (init_process_group, new_group, NCCL's unique id), not per
collective: a few milliseconds per call are nothing there.
"""
from __future__ import annotations

import datetime
import itertools
import threading
import time

import torch.distributed as dist

REQUEST = 31000  # MPI tag of a request to rank 0; replies use tags below it, one per pending request of a rank
QUICK, IDLE, QUIET_AFTER = 0.0002, 0.02, 1.0  # poll intervals (s), and how long after a request polling stays quick
SERVER_GRACE = 5.0  # seconds past a call's timeout before a rank gives up on rank 0's answer


class MPIStore(dist.Store):
    """The rank-side view: each call is one request to rank 0's StoreServer and one reply."""

    def __init__(self, comm, timeout: datetime.timedelta, server: StoreServer | None = None):
        super().__init__()
        self._comm = comm
        self._server = server  # rank 0's: closed with the store
        self._timeout = timeout
        self._tags = itertools.count()
        self._lock = threading.Lock()

    # -- torch's Store interface ---------------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._ask("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._ask("get", key, None, waits=True)

    def add(self, key: str, amount: int) -> int:
        return self._ask("add", key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._ask("compare_set", key, (_bytes(expected), _bytes(desired)))

    def append(self, key: str, value) -> None:
        self._ask("append", key, _bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._ask("multi_get", list(keys), None, waits=True)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._ask("multi_set", list(keys), [_bytes(v) for v in values])

    def delete_key(self, key: str) -> bool:
        return self._ask("delete_key", key, None)

    def num_keys(self) -> int:
        return self._ask("num_keys", None, None)

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", list(keys), None)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._ask("wait", list(keys), None, waits=True, timeout=timeout)

    def has_extended_api(self) -> bool:
        return True

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def close(self) -> None:
        """Stop serving (rank 0) and free the communicator; the default store lives as long as the engine."""
        if self._server is not None:
            self._server.stop()
        self._comm.Free()

    # -- the message exchange -----------------------------------------------------------------------------------
    def _ask(self, op: str, key, value, waits: bool = False, timeout: datetime.timedelta | None = None):
        seconds = (timeout or self._timeout).total_seconds()
        with self._lock:
            tag = next(self._tags) % REQUEST
        self._comm.send((op, key, value, tag, seconds if waits else 0.0), dest=0, tag=REQUEST)
        deadline = time.monotonic() + seconds + SERVER_GRACE
        while (message := self._comm.improbe(source=0, tag=tag)) is None:
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"the rendezvous store (rank 0, over MPI) did not answer {op}({key!r}) "
                                          f"within {seconds:.0f} s")
            time.sleep(QUICK)
        ok, answer = message.recv()
        if not ok:
            raise dist.DistStoreError(answer)
        return answer


class StoreServer:
    """Rank 0's keys, and the requests waiting for keys not yet set; served by one daemon thread."""

    def __init__(self, comm):
        self._comm = comm
        self._keys: dict[str, bytes] = {}
        self._waiting: list[tuple[int, tuple]] = []  # (source, request) whose keys are not all there yet
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nbdist-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from mpi4py import MPI

        last, status = time.monotonic(), MPI.Status()
        while not self._stopping.is_set():
            message = self._comm.improbe(source=MPI.ANY_SOURCE, tag=REQUEST, status=status)
            if message is None:
                self._expire()
                time.sleep(QUICK if time.monotonic() - last < QUIET_AFTER else IDLE)
                continue
            source, request = status.Get_source(), message.recv()
            last = time.monotonic()
            self._handle(source, request)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _handle(self, source: int, request: tuple) -> None:
        op, key, value, tag, wait_seconds = request
        try:
            answer = self._answer(op, key, value)
        except _NotYet:
            self._waiting.append((source, (op, key, value, tag, time.monotonic() + wait_seconds)))
            return
        except Exception as error:  # a request torch should not make: said on the asking rank, rank 0 serves on
            self._reply(source, tag, False, f"the rendezvous store cannot {op}({key!r}): {error}")
            return
        self._reply(source, tag, True, answer)
        if op in _WRITES:
            self._retry_waiting()

    def _answer(self, op: str, key, value):
        keys = self._keys
        if op == "set":
            keys[key] = value
        elif op in ("get", "multi_get", "wait"):
            wanted = [key] if op == "get" else key
            if any(k not in keys for k in wanted):
                raise _NotYet
            return keys[key] if op == "get" else ([keys[k] for k in wanted] if op == "multi_get" else None)
        elif op == "add":
            total = int(keys.get(key, b"0")) + value
            keys[key] = str(total).encode()
            return total
        elif op == "compare_set":
            expected, desired = value
            current = keys.get(key)
            if (current is None and expected == b"") or current == expected:
                keys[key] = desired
                return desired
            return expected if current is None else current
        elif op == "append":
            keys[key] = keys.get(key, b"") + value
        elif op == "multi_set":
            keys.update(zip(key, value))
        elif op == "delete_key":
            return keys.pop(key, None) is not None
        elif op == "num_keys":
            return len(keys)
        elif op == "check":
            return all(k in keys for k in key)
        else:
            raise ValueError("not an operation of this store")
        return None

    def _retry_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for source, (op, key, value, tag, deadline) in waiting:
            try:
                answer = self._answer(op, key, value)
            except _NotYet:
                self._waiting.append((source, (op, key, value, tag, deadline)))
                continue
            self._reply(source, tag, True, answer)

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [w for w in self._waiting if w[1][4] <= now]
        for source, (op, key, _, tag, _) in expired:
            self._reply(source, tag, False, f"the rendezvous store timed out: {op}({key!r}) waited for keys no rank "
                                            "set (a rank that did not reach the same step?)")
        self._waiting = [w for w in self._waiting if w[1][4] > now]

    def _reply(self, dest: int, tag: int, ok: bool, answer) -> None:
        self._comm.send((ok, answer), dest=dest, tag=tag)  # small: MPI sends it eagerly, the asker polls for it


class _NotYet(Exception):
    """A key asked for is not set yet: the request waits."""


_WRITES = {"set", "add", "compare_set", "append", "multi_set"}


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, list):  # torch hands some values over as lists of byte values
        return bytes(value)
    raise TypeError(f"store values are bytes or text, got {type(value).__name__}")


def over_mpi(world, timeout: datetime.timedelta) -> MPIStore:
    """Every rank's store over MPI (a collective: call it on every rank); rank 0 also starts the server."""
    comm = world.Dup()  # its own message space: the store's tags meet nothing else's
    return MPIStore(comm, timeout, StoreServer(comm) if comm.rank == 0 else None)


"""A rank's answer to "what are you doing?", given by a thread of its own (runs ON the engines).

Why a thread: the question matters most when the rank's main thread is stuck (in a collective that will never
complete, in a loop of the user's), and then it cannot answer. A daemon thread can, whenever the main thread lets
go of the GIL: every MPI, gloo and NCCL wait does, and a pure-Python loop does every few milliseconds. It reads the
flight recorder (debugging/ranks/recorder.py) and the main thread's stack, and sends them as one JSON line.

The line to the notebook is a connection to the cluster's lifeline server (cluster/hosts/lifeline_server.py), the one
endpoint every engine can already reach, on one host or many, with the same token: the first line says
"<token> <host> <pid> inspect"; then each "why" line from the kernel is answered with one JSON line. An engine
started without that server (a process group made outside nbdist) has no inspector.
"""
from __future__ import annotations

import json
import math
import os
import socket
import threading
import time

from nbdist.cluster.hosts.lifeline import ACCEPTED, ADDRESS_ENV, HANDSHAKE_SECONDS, lines_from, open_connection, token
from nbdist.debugging.ranks import recorder

ASK = b"why"
REPORT_LIMIT = 256 * 1024  # bytes of one report at most (the stack's source lines are cut first)
THREAD_NAME = "nbdist-inspector"


def start(rank: int) -> bool:
    """Start this rank's inspector thread; False where there is no lifeline server to answer to."""
    address, secret = os.environ.get(ADDRESS_ENV), token()
    if not address or not secret:
        return False
    threading.Thread(target=_serve, args=(address, secret, rank), daemon=True, name=THREAD_NAME).start()
    return True


def _serve(address: str, token: str, rank: int) -> None:
    sock = _connect(address, token, rank)
    if sock is None:
        return
    try:
        for line in lines_from(sock):  # until the kernel closes the line (the cluster stops)
            if line.strip() == ASK:
                sock.sendall(answer(rank))
    except OSError:
        pass  # the line broke while answering: nothing more to answer
    finally:
        sock.close()


def _connect(address: str, token: str, rank: int) -> socket.socket | None:
    try:
        sock = open_connection(address, HANDSHAKE_SECONDS)
        sock.sendall(f"{token} {socket.gethostname()} {os.getpid()} inspect {rank}\n".encode())
        said = sock.recv(len(ACCEPTED))
    except OSError:
        return None
    if said != ACCEPTED:
        sock.close()
        return None
    sock.settimeout(None)
    return sock


def _cell_names() -> dict[str, str]:
    """The engine's cells by the file names IPython compiled them under: {file: "cell In[3]"} (what its tracebacks
    call them), so that a stack reads as the notebook's cells do."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        numbers = dict(getattr(shell.compile, "_filename_map", {})) if shell is not None else {}
    except Exception:  # no IPython here, or a version without the map: file names stay
        return {}
    return {name: f"cell In[{number}]" for name, number in numbers.items()}


def torch_recorded(now: float, n: int = recorder.TAIL) -> list[dict]:
    """The last `n` calls torch's own flight recorder holds (gloo's and NCCL's groups: boot turns it on), in the
    recorder's form (recorder.tail). torch marks when a call was made, not (on gloo) when it completed, so these
    carry no end: the hang view takes a rank's last one as the call it waits in when its stack waits in torch."""
    try:
        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace_json

        if not dist.is_initialized():
            return []
        entries = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False)).get("entries", [])
        names = dist.distributed_c10d._world.pg_names
        ranks_of = {name: dist.get_process_group_ranks(group) for group, name in names.items()}
    except Exception:  # a torch without it, or a recorder turned off
        return []
    wall = time.time_ns()
    return [_as_call(e, ranks_of, now - (wall - e.get("time_created_ns", wall)) / 1e9) for e in entries[-n:]]


def _as_call(entry: dict, ranks_of: dict, start: float) -> dict:
    name = (entry.get("process_group") or [None])[0]
    sizes, dtypes = entry.get("input_sizes") or [[]], entry.get("input_dtypes") or [None]
    numel = math.prod(sizes[0]) if sizes and sizes[0] is not None else None
    return {"group": name, "ranks": ranks_of.get(name), "seq": None if entry.get("is_p2p") else
            entry.get("collective_seq_id"), "call": str(entry.get("profiling_name", "")).rpartition(":")[2],
            "peer": None, "numel": numel, "dtype": None if dtypes[0] is None else str(dtypes[0]).lower(),
            "bytes": None, "start": start, "done": False, "failed": False, "torch": True}


def answer(rank: int) -> bytes:
    """One JSON line: the recorder's report with the rank's identity, within REPORT_LIMIT."""
    report = recorder.report()
    report.update(rank=rank, host=socket.gethostname(), pid=os.getpid())
    cells = _cell_names()
    report["stack"] = [[cells.get(f, f), *rest] for f, *rest in report["stack"]]
    report["torch_calls"] = torch_recorded(report["now"])
    line = json.dumps(report, default=str).encode()
    if len(line) > REPORT_LIMIT:
        report["stack"] = [[f, n, fn, ""] for f, n, fn, _ in report["stack"][-10:]]
        line = json.dumps(report, default=str).encode()
    return line + b"\n"

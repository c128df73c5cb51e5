"""A rank's PMI connection to Hydra, relayed, so that a rank calling MPI_Abort is recorded before Hydra hears of it.

Why: MPI_Abort on a rank writes MPICH's line ("application called MPI_Abort(MPI_COMM_WORLD, 3) - process 1") to
its fd 2, then sends "cmd=abort exitcode=3" down its PMI socket (the descriptor Hydra names in PMI_FD). mpiexec
exits the moment it reads that command, and its proxy then kills every rank (the aborting one too: it waits in
MPI_Abort to be killed, it never exits by itself). So the line reaches mpiexec's output only when the proxy happened
to forward the rank's stderr before the command, and the rank's own capture of its fd 2 (ipykernel's pipe and
thread) makes it later still (measured with strace and in clusters: cluster/waiting/deaths.py). Here the rank's
PMI socket is one end of a socket pair; this relay holds Hydra's, copies both ways, and on the abort command first
writes the line to a file in the cluster's folder (the kernel's DeathWatch reads it), then passes the command on.

Run in a forked rank's stand-in (a thread of cluster/launching/ranks/warm_stub.py, which holds Hydra's descriptors
anyway), or for a launched rank as a process of its own started by the rank (`start`), since a thread of the rank
would need its interpreter lock, which the code calling MPI_Abort may hold. Standard library only (the stand-in
runs with `python -S`).
    python -S pmi_relay.py <Hydra's PMI fd> <the rank's end> <rank> <rank pid> [<cluster folder>]
"""
from __future__ import annotations

import os
import re
import select
import socket
import stat
import sys
import time

PMI_FD_ENV = "PMI_FD"  # Hydra's PMI socket, inherited by the process it starts
PMI_RANK_ENV = "PMI_RANK"
RECORD_PREFIX = "mpi-abort-"  # + the rank's pid: the record's file in the cluster's folder (cluster/waiting/deaths.py)
RECORD = "nbdist: rank pid {pid} application called MPI_Abort(MPI_COMM_WORLD, {code}) - process {rank}\n"
_ABORT = re.compile(rb"cmd=abort[ ;](?:[^\n]*?[ ;])?exitcode=(-?\d+)[ ;\n]")
STDERR_HEAD_START = 0.2  # s the command waits where no folder is here: the line goes to mpiexec's output first
_relay_process: list = []  # a launched rank's relay (kept: it ends when the rank's end of the pair closes)


def start(folder: str | None) -> None:
    """In a launched rank, before MPI starts: put a socket pair's end at Hydra's PMI descriptor and start the relay
    process with Hydra's socket and the other end. Nothing changes where Hydra gave no PMI_FD (other launchers)."""
    number = os.environ.get(PMI_FD_ENV, "")
    if not number.isdigit() or not _is_socket(int(number)):
        return
    import subprocess

    hydra = int(number)
    ours, theirs = socket.socketpair()
    relayed = os.dup(hydra)  # Hydra's socket, for the relay; the rank's number then becomes our end
    command = [sys.executable, "-S", os.path.abspath(__file__), str(relayed), str(theirs.fileno()),
               os.environ.get(PMI_RANK_ENV, "?"), str(os.getpid()), folder or ""]
    try:
        _relay_process[:] = [subprocess.Popen(command, pass_fds=(relayed, theirs.fileno()),
                                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)]
    except OSError:  # no relay: MPI as Hydra gave it
        ours.close()
        return
    finally:
        os.close(relayed)
        theirs.close()
    os.dup2(ours.fileno(), hydra, inheritable=True)
    ours.close()


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False


def private_folder(path: str | None) -> str | None:
    """`path` if it is a folder of this user's alone (the cluster's own, 0700), else None."""
    try:
        found = os.stat(path) if path else None
    except OSError:
        return None
    mine = found is not None and stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid()
    return path if mine and not found.st_mode & 0o077 else None


def recorder(rank: str, pid, folder: str | None):
    """What to do with an abort's exit code: write MPICH's words (with the rank's pid, `pid()`) to the cluster's
    folder where it is here; elsewhere to stderr (mpiexec's output), giving them a head start over the command."""
    def record(code: str) -> None:
        line = RECORD.format(pid=pid(), code=code, rank=rank).encode()
        if folder:
            try:
                fd = os.open(os.path.join(folder, f"{RECORD_PREFIX}{pid()}"),
                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
                return
            except OSError:
                pass
        try:
            os.write(2, line)
        except OSError:
            return
        time.sleep(STDERR_HEAD_START)

    return record


def relay(hydra: int, rank_end: int, record) -> None:
    """Copy bytes between Hydra's socket and the rank's until either closes; an abort command is recorded before it
    is passed on. Hydra's socket is left open (the stand-in holds it until it ends); the rank's end is shut."""
    seen = b""  # the rank's words since its last complete line
    try:
        while True:
            ready, _, _ = select.select([hydra, rank_end], [], [])
            if hydra in ready:
                data = os.read(hydra, 65536)
                if not data:
                    return
                _write_all(rank_end, data)
            if rank_end in ready:
                data = os.read(rank_end, 65536)
                if not data:
                    return
                seen = (seen + data)[-8192:]
                found = _ABORT.search(seen)
                if found is not None:
                    record(found.group(1).decode())
                    seen = b""
                elif b"\n" in seen:
                    seen = seen.rsplit(b"\n", 1)[1]
                _write_all(hydra, data)
    except OSError:
        return
    finally:
        try:
            socket.socket(fileno=os.dup(rank_end)).shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def main() -> None:
    import signal

    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):  # the rank's (Hydra signals its
        signal.signal(getattr(signal, name), signal.SIG_IGN)  # process group): this relay ends with its rank's end
    hydra, rank_end, rank, pid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    folder = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None
    relay(hydra, rank_end, recorder(rank, lambda: pid, folder))


if __name__ == "__main__":
    main()

"""What mpiexec starts for a rank when the kernel keeps a warm process (cluster/launching/warm.py): a stand-in that hands its
place in the MPI job to a rank forked from that warm process, then lives and dies with it.

Why: a fresh rank spends seconds importing torch (and torch._dynamo, which DDP's constructor imports), two of them
at once on two cores; a rank forked from a process that has them loaded starts in milliseconds, as accelerate's
notebook_launcher does by forking the kernel. MPI still needs its ranks started by its own launcher (Hydra gives
each process a PMI socket, its rank and its world), so this stand-in, started by Hydra in the rank's place, passes
everything Hydra gave it (open descriptors, environment, folder, arguments) to the warm process, which forks the
rank with them (cluster/launching/ranks/zygote.py). Then, for Hydra, this process is the rank:
- a signal Hydra (or anyone) sends it goes on to the rank;
- when the rank ends, it ends the same way (exit code, or the same signal);
- if it is killed, the rank notices at once (the connection it holds closes) and ends too;
- it relays the rank's PMI socket to Hydra's, recording an MPI_Abort before Hydra ends the job (pmi_relay.py).

Run by path with `python -S`, standard library only: it must start in milliseconds.
    python -S warm_stub.py <warm process's socket> <the rank's arguments...>
"""
from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGTSTP")
LAUNCHER_NET_ENV = "NBDIST_LAUNCHER_NET"  # the network namespace Hydra (and its control port) is in
_rank_pid: list[int] = []
_pending: list[int] = []
_relay_ends: list[socket.socket] = []  # the stand-in's end of the rank's PMI relay, kept open


def _own_network() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    for name in FORWARDED:
        signal.signal(getattr(signal, name), _forward)
    fds = _open_descriptors()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        sys.exit(f"nbdist: the kernel's warm process does not answer at {path} ({e.strerror}); the rank did not start")
    env = {**os.environ, LAUNCHER_NET_ENV: _own_network()}  # the rank is forked elsewhere: where Hydra is
    request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "fds": fds}).encode()
    sent = _relay_pmi(fds)
    sock.sendmsg([len(request).to_bytes(4, "big") + request],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sent))])
    for fd in set(sent) - set(fds):
        os.close(fd)  # the rank's end of the relay: the rank holds it now
    # Every descriptor stays open here too, until this process ends as its rank did: Hydra takes a PMI socket
    # closing for its process's end, and would report the wrong one of several ranks it then ends.
    _follow(sock.makefile("r"))


def _open_descriptors() -> list[int]:
    """Every descriptor Hydra gave this process (its PMI socket, control socket, stdin/stdout/stderr...)."""
    listed = [int(name) for name in os.listdir("/proc/self/fd")]
    return [fd for fd in listed if _is_open(fd)]  # the listing's own descriptor is closed by now


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _relay_pmi(fds: list[int]) -> list[int]:
    """The descriptors to send the rank: `fds`, but in place of Hydra's PMI socket one end of a socket pair, whose
    other end a thread here relays to Hydra's (an MPI_Abort is recorded before Hydra hears of it: pmi_relay.py)."""
    import threading

    import pmi_relay  # beside this file, which runs by path

    number = os.environ.get(pmi_relay.PMI_FD_ENV, "")
    if not number.isdigit() or int(number) not in fds:
        return fds
    ours, theirs = socket.socketpair()
    _relay_ends.append(ours)
    folder = pmi_relay.private_folder(os.environ.get("IPP_PROFILE_DIR"))  # forked ranks: on the kernel's host
    record = pmi_relay.recorder(os.environ.get(pmi_relay.PMI_RANK_ENV, "?"),
                                lambda: _rank_pid[0] if _rank_pid else os.getpid(), folder)
    threading.Thread(target=pmi_relay.relay, args=(int(number), ours.fileno(), record), daemon=True).start()
    return [theirs.detach() if fd == int(number) else fd for fd in fds]


def _forward(number: int, _frame) -> None:
    if _rank_pid:
        _send(_rank_pid[0], number)
    else:
        _pending.append(number)


def _send(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _follow(lines) -> None:
    """Read the warm process's words: "pid N" once the rank is forked, "exit STATUS" when it has ended."""
    for line in lines:
        word, _, value = line.strip().partition(" ")
        if word == "pid":
            _rank_pid.append(int(value))
            for number in _pending:
                _send(_rank_pid[0], number)
        elif word == "exit":
            _end_like(int(value))
        elif word == "error":
            sys.exit(f"nbdist: {value}")
    if _rank_pid:  # the warm process died before its rank: take the rank along, so nothing runs unwatched
        _send(_rank_pid[0], signal.SIGKILL)
    sys.exit("nbdist: the kernel's warm process ended before the rank did")


ENDED = "nbdist stand-in: rank pid {pid} ended {how}"  # read by cluster/waiting/deaths.py


def _end_like(status: int) -> None:
    """Exit as the rank did: with its exit code, or killed by the same signal. An abnormal end is said first, on
    the rank's stderr (mpiexec's output): Hydra then ends the other ranks by killing their stand-ins, and its own
    report may name any of them."""
    how = (f"by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"with exit code {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else "")
    if how and how != "with exit code 0":
        sys.stderr.write(ENDED.format(pid=_rank_pid[0] if _rank_pid else "?", how=how) + "\n")
        sys.stderr.flush()
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose handler cannot be set (nor was)
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()

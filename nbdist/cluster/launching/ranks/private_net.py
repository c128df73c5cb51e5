"""A cluster on one host in a network of its own: mpiexec and the warm process enter a new user and network
namespace, whose loopback only they and the processes they start can reach.

Why: on one host every port the ranks listen on is reachable by every local user. Hydra's control port, on every
interface, ends the job on 12 bytes from anyone (`HYD\\0`, pgid 0, proxy 0); gloo's and torch's ports, and MPICH's
abstract sockets, answer whoever connects. Linux lets an ordinary user make a network namespace inside a user
namespace of their own (no privilege; the uid is mapped to itself, so files and signals work as before): the
ports then live on a loopback no other user has. What must cross between the kernel and the ranks goes through
files in the cluster's 0700 folder instead (ipyparallel's IPC transport, the lifeline server's Unix socket), and a
path-named Unix socket is reached by path, whatever the network namespace.

Where the OS refuses (user namespaces turned off: sysctl user.max_user_namespaces=0, some distributions' AppArmor
rules, a container's seccomp profile), the cluster starts as before on the host's loopback and `%dist_status` says
what stays open. Standard library only, run by path with `python -S` as mpiexec's wrapper:

    python -S private_net.py mpiexec ARGS...     enter, then exec mpiexec
    python -S private_net.py --probe             exit 0 where the OS allows it, else print why and exit 1
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
KERNEL_NET_ENV = "NBDIST_KERNEL_NET"  # given to the ranks: the kernel's network namespace, to compare theirs with
REFUSED_ENV = "NBDIST_PRIVATE_NET_REFUSED"  # given to the ranks where the OS refused: why, for their status line


REFUSALS = {  # what unshare's errors mean here
    errno.ENOSPC: "user namespaces are turned off or used up (sysctl user.max_user_namespaces)",
    errno.EPERM: "user namespaces are not permitted here (kernel.unprivileged_userns_clone, AppArmor or seccomp)",
    errno.EINVAL: "this kernel has no user or network namespaces",
}


class SetUpFailed(OSError):
    """Namespaces made, but not usable: the process that made them must not go on in them (it ends)."""


def enter() -> str | None:
    """Move this process (it must be single-threaded: the kernel refuses a new user namespace to a threaded one)
    into a new user and network namespace, its uid and gid mapped to themselves, its loopback up. None, or why the
    OS refused (then nothing changed); SetUpFailed where it made them but cannot use them."""
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        number = ctypes.get_errno()
        return f"the OS refuses a private network namespace: {REFUSALS.get(number, os.strerror(number))}"
    try:
        _write("/proc/self/setgroups", "deny")  # what an unprivileged gid_map asks first
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _loopback_up()
    except OSError as e:  # said by the caller: the warm process tells the kernel (cluster/launching/warm.py)
        raise SetUpFailed(f"a private network namespace was made but cannot be set up ({e})") from None
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    """`ip link set lo up`, by ioctl: a new network namespace's loopback starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def namespace_of(pid: int | str = "self") -> str | None:
    """The network namespace process `pid` is in ("net:[4026531840]"), or None where it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def main() -> None:
    try:
        refused = enter()
    except SetUpFailed as e:
        sys.exit(f"nbdist: {e}; stopping")
    if sys.argv[1:] == ["--probe"]:
        if refused:
            print(refused)
        sys.exit(1 if refused else 0)
    if refused:  # the probe said it could: say so rather than run in the open without a word
        sys.exit(f"nbdist: {refused}; the kernel's probe had found it allowed")
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()

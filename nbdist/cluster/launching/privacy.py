"""What keeps a cluster on one host to its user (the kernel's side): no port another local user can reach.

- ipyparallel's controller speaks over IPC, Unix sockets in the cluster's 0700 folder, not TCP ports on loopback
  (which any local user could subscribe to: every cell's source and every rank's output went to whoever asked);
- the lifeline server listens on a socket file there too (cluster/hosts/lifeline_server.py);
- mpiexec and the warm process run in a network namespace of their own (cluster/launching/ranks/private_net.py):
  Hydra's control port, gloo's ports and MPICH's abstract sockets live on a loopback no other user has.

Several hosts keep TCP (cluster/launching/launch.py says how it is protected there). Where the OS refuses the
namespace, the cluster starts on the host's loopback and the ranks say, in `%dist_status`, what is then open.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

from nbdist.cluster.launching.ranks.private_net import KERNEL_NET_ENV, REFUSED_ENV, namespace_of

PRIVATE_NET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranks", "private_net.py")
PRIVATE_NET_ENV = "NBDIST_PRIVATE_NET"  # "0": no private network namespace (a site where one breaks something)
SOCKET_PATH_MAX = 107  # the longest path of a Unix socket on Linux (sun_path's 108 bytes, less the final NUL)


def private_net_refused(root: str) -> str | None:
    """Why a one-host cluster whose folder will be made in `root` cannot have a network of its own here, or None
    where it can. Its ranks then reach the kernel through socket files in that folder, whose path must fit."""
    if os.environ.get(PRIVATE_NET_ENV) == "0":
        return f"{PRIVATE_NET_ENV}=0 turns it off"
    longest = len(_socket_path(os.path.join(root, "cluster-XXXXXXXX")))
    if longest > SOCKET_PATH_MAX:
        return (f"the cluster's folder {root} is too long a path for its socket files ({longest} > "
                f"{SOCKET_PATH_MAX} bytes): set NBDIST_CLUSTER_DIR to a shorter one")
    return _probe()


def _socket_path(profile_dir: str) -> str:
    """The longest socket file of a cluster's folder: ZeroMQ's IPC address and a port (controller.py; the
    lifeline server's, "lifeline", is shorter)."""
    return os.path.join(profile_dir, "zmq") + ":65535"


@functools.lru_cache(maxsize=1)
def _probe() -> str | None:
    """Asked once per kernel, of a child process (a threaded kernel cannot enter a user namespace itself)."""
    try:
        done = subprocess.run([sys.executable, "-S", PRIVATE_NET, "--probe"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the probe for a private network namespace failed ({e})"
    return None if done.returncode == 0 else (done.stdout.strip() or done.stderr.strip() or "refused")


def wrapped(mpiexec: str, private: bool) -> list[str]:
    """The command that runs mpiexec: in a network of its own where `private`."""
    return [sys.executable, "-S", PRIVATE_NET, mpiexec] if private else [mpiexec]


def controller_address(profile_dir: str, one_host: bool, kernel_address: str) -> tuple[str, str]:
    """(transport, address) of the controller's sockets: IPC files in the cluster's folder on one host (where the
    path fits a Unix socket's), else TCP on `kernel_address`."""
    if one_host and len(_socket_path(profile_dir)) <= SOCKET_PATH_MAX:
        return "ipc", os.path.join(profile_dir, "zmq")
    return "tcp", kernel_address


def lifeline_path(profile_dir: str, one_host: bool) -> str | None:
    path = os.path.join(profile_dir, "lifeline")
    return path if one_host and len(path) <= SOCKET_PATH_MAX else None


def environment(refused: str | None) -> dict[str, str]:
    """What the ranks need to tell whether they got their own network, and why not."""
    env = {KERNEL_NET_ENV: namespace_of() or ""}
    if refused:
        env[REFUSED_ENV] = refused
    return env


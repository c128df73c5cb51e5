"""What a cluster listens on, and who can reach it (issue 22), on real clusters: no mocks.

The claims, on one host (every rank on the kernel's host): every TCP port a process of the cluster listens on is on
loopback, with one exception nbdist cannot move, Hydra's control port (mpiexec binds it to every interface and has
no setting to bind it elsewhere), which carries a socket filter that drops every packet not arriving on loopback;
torch's rendezvous store is a FileStore in the cluster's own folder (no socket, readable by this user alone);
MPICH's own transport listens on no port, and gloo on loopback. From another network namespace (another host, as
tests/hosts.py makes them) no port of the cluster answers at this host's address, while a plain listener there
does. Over several hosts, the store is carried over MPI: no socket is opened for it.

The namespace tests need root and network namespaces: where those cannot be made they skip saying why, unless
NBDIST_REQUIRE_HOSTS=1 (CI), where that is a failure.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import psutil
import pytest
from hosts import SshHosts, made_or_skip

import nbdist
from nbdist.cluster.hosts.lifeline import ADDRESS_ENV
from nbdist.cluster.options import ClusterOptions

_PIDFD_GETFD = 438  # the same number on every Linux architecture
_SO_GET_FILTER = 26


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str
    fd: int
    address: str
    port: int

    def on_loopback(self) -> bool:
        found = ipaddress.ip_address(self.address)
        found = getattr(found, "ipv4_mapped", None) or found
        return found.is_loopback


def _listeners(procs: list[psutil.Process]) -> list[Listener]:
    """Every listening TCP socket and every bound, unconnected UDP socket the processes hold."""
    found = []
    for proc in procs:
        try:
            name, connections = proc.name(), proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                found.append(Listener(proc.pid, name, c.fd, c.laddr.ip, c.laddr.port))
    return found


def _cluster_listeners(cluster: nbdist.Cluster) -> list[Listener]:
    """The cluster's processes' listeners, and the kernel's lifeline server (a thread of this process)."""
    server = cluster._launched.lifeline  # a forked rank's /proc environ is its kernel's
    lifeline_port = int(server.environment()[ADDRESS_ENV].rpartition(":")[2])
    own = [listener for listener in _listeners([psutil.Process()]) if listener.port == lifeline_port]
    assert own, "the lifeline server is not listening"
    return _listeners(cluster.processes()) + own


def _filter_length(pid: int, fd: int) -> int:
    """The number of socket-filter instructions on process `pid`'s socket `fd` (0: none), read through a copy of its
    descriptor (pidfd_getfd: Linux >= 5.6, and the right to trace `pid`, which a parent has)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        copy = libc.syscall(_PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            pytest.skip(f"cannot copy mpiexec's socket here (pidfd_getfd: {os.strerror(ctypes.get_errno())})")
        try:
            length = ctypes.c_uint(0)
            assert libc.getsockopt(copy, socket.SOL_SOCKET, _SO_GET_FILTER, None, ctypes.byref(length)) == 0
            return length.value
        finally:
            os.close(copy)
    finally:
        os.close(pidfd)


def _check_one_host(cluster: nbdist.Cluster) -> list[Listener]:
    """Everything on loopback but Hydra's control port, which is mpiexec's (shared with its children) and filtered."""
    found = _cluster_listeners(cluster)
    elsewhere = [listener for listener in found if not listener.on_loopback()]
    mpiexec = [listener for listener in elsewhere if listener.name == "mpiexec"]
    assert len(mpiexec) == 1, found
    control = mpiexec[0]
    assert {(listener.address, listener.port) for listener in elsewhere} == {(control.address, control.port)}, found
    assert _filter_length(control.pid, control.fd) == 4  # addresses.only_from_this_host's program
    return found


def _on_rank() -> dict:
    import os

    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store = getattr(store, "underlying_store", store)
    group = dist.new_group([0, 1])  # a sub-group: its own rendezvous through the store
    total = torch.ones(2)
    dist.all_reduce(total, group=group)
    dist.destroy_process_group(group)
    path = getattr(store, "path", None)
    return {"store": type(store).__name__, "mode": oct(os.stat(path).st_mode & 0o777) if path else None,
            "sum": total.tolist(), "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME")}


@pytest.fixture(scope="module")
def gloo_cluster():
    cluster = nbdist.Cluster(ClusterOptions(n=2, backend="gloo")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["default", "gloo"])
def one_host(request, cluster, gloo_cluster):
    return cluster if request.param == "default" else gloo_cluster


def test_on_one_host_everything_listens_on_loopback_but_hydras_port_which_answers_this_host_alone(one_host):
    got = one_host.run(_on_rank)
    assert all(g["store"] == "FileStore" and g["mode"] == "0o600" and g["sum"] == [2.0, 2.0] for g in got), got
    assert all(g["gloo_interface"] == "lo" for g in got), got
    transports = one_host.run(lambda: __import__("os").environ.get("UCX_TLS"))
    assert set(transports) == {os.environ.get("UCX_TLS", "self,sm")}
    _check_one_host(one_host)


def _connect_from(namespace: str, address: str, ports: list[int]) -> dict[int, str]:
    """Try a TCP connection to every port of `address` from network namespace `namespace` (1 s each)."""
    script = ("import socket, sys\n"
              "for port in map(int, sys.argv[2:]):\n"
              "    s = socket.socket(); s.settimeout(1.0)\n"
              "    try:\n"
              "        s.connect((sys.argv[1], port)); print(port, 'connected')\n"
              "    except OSError as e:\n"
              "        print(port, type(e).__name__)\n"
              "    s.close()\n")
    done = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", script, address, *map(str, ports)],
                          capture_output=True, text=True, timeout=30 + 2 * len(ports))
    assert done.returncode == 0, done.stderr
    return {int(port): said for port, said in (line.split() for line in done.stdout.splitlines())}


@pytest.fixture(scope="module")
def one_namespace():
    made = made_or_skip(lambda: SshHosts(1))
    yield made
    made.close()


@pytest.mark.multihost
def test_from_another_host_no_port_of_a_one_host_cluster_answers(one_host, one_namespace):
    """Every TCP port the cluster listens on, tried at this host's address on the namespaces' bridge: none answers;
    a plain socket listening on every interface does (so the namespace does reach this host)."""
    ports = sorted({listener.port for listener in _check_one_host(one_host)})
    with socket.socket() as control:
        control.bind(("0.0.0.0", 0))
        control.listen()
        reached = control.getsockname()[1]
        said = _connect_from(one_namespace.hosts[0].namespace, one_namespace.gateway, [reached, *ports])
    assert said.pop(reached) == "connected"
    assert len(said) == len(ports) and "connected" not in said.values(), said


@pytest.fixture(scope="module")
def two_hosts():
    made = made_or_skip(lambda: SshHosts(2))
    yield made
    made.close()


def _default_store() -> tuple[str, bool]:
    """On a rank: the kind of store its default process group was formed through (a store written in Python, as
    nbdist's over MPI, shows as torch's base class 'Store'), and whether this rank serves the keys (rank 0's
    thread of cluster/hosts/ranks/mpi_store.py)."""
    import threading

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    kind = type(getattr(store, "underlying_store", store)).__name__
    return kind, any(t.name == "nbdist-store" for t in threading.enumerate())


def _sum_of_ranks() -> float:
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return x.item()


@pytest.mark.multihost
def test_over_two_hosts_the_rendezvous_is_carried_over_mpi_and_opens_no_socket(two_hosts):
    """torch's TCPStore would answer whoever reaches its port; across hosts the rendezvous rides on MPI's world."""
    options = ClusterOptions(n=2, hosts=two_hosts.names(1), mpi_args=two_hosts.mpi_args, cpu=True, timeout=120.0)
    with nbdist.Cluster(options).start() as cluster:
        assert cluster.run(_default_store) == [("Store", True), ("Store", False)]
        assert cluster.run(_sum_of_ranks) == [1.0, 1.0]

"""What a cluster listens on, and who can reach it (issue 22), on real clusters: no mocks.

The claims, on one host (every rank on the kernel's host): no TCP or UDP port a process of the cluster listens on is
on this host's network: they are all in the cluster's own network namespace (Hydra's control port too, which
mpiexec binds to every interface), and the controller and the lifeline server listen on socket files in the
cluster's 0700 folder (tests/test_one_host_privacy.py runs another user's probes against them); torch's
rendezvous store is a FileStore in the cluster's own folder (no socket, readable by this user alone);
MPICH's own transport listens on no port, and gloo on loopback. From another network namespace (another host, as
tests/hosts.py makes them) no port of the cluster answers at this host's address, while a plain listener there
does. Over several hosts, the store is carried over MPI: no socket is opened for it.

The namespace tests need root and network namespaces: where those cannot be made they skip saying why, unless
NBDIST_REQUIRE_HOSTS=1 (CI), where that is a failure.
"""
from __future__ import annotations

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
    """Every listening TCP socket and every bound, unconnected UDP socket the processes hold, in whichever network
    namespace each is (read from /proc/<pid>/net: psutil reads this process's own network only)."""
    found = []
    for proc in procs:
        try:
            name = proc.name()
            sockets = {}
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                if target.startswith("socket:["):
                    sockets[target[len("socket:["):-1]] = int(fd)
            tables = {kind: open(f"/proc/{proc.pid}/net/{kind}").read().splitlines()[1:]
                      for kind in ("tcp", "tcp6", "udp", "udp6")}
        except (OSError, psutil.Error):
            continue
        for kind, lines in tables.items():
            for line in lines:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                listening = state == "0A" if kind.startswith("tcp") else set(remote.split(":")[1]) == {"0"}
                if listening and inode in sockets:
                    address, port = local.split(":")
                    raw = bytes.fromhex(address)
                    ip = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6,
                                          b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                    found.append(Listener(proc.pid, name, sockets[inode], ip, int(port, 16)))
    return found


def _cluster_listeners(cluster: nbdist.Cluster) -> list[Listener]:
    """The cluster's processes' TCP and UDP listeners; the kernel's lifeline server (a thread of this process)
    listens on a socket file in the cluster's folder, not a port."""
    address = cluster._launched.lifeline.environment()[ADDRESS_ENV]
    assert address.startswith("unix:") and os.path.dirname(address[len("unix:"):]) == cluster._launched.cluster.profile_dir
    return _listeners(cluster.processes())


def _network(pid: int | str = "self") -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _check_one_host(cluster: nbdist.Cluster) -> list[Listener]:
    """No port of the cluster is on this host's network: every TCP and UDP listener its processes hold (Hydra's
    control port, gloo's) is in the cluster's own network namespace (cluster/launching/privacy.py)."""
    found = _cluster_listeners(cluster)
    assert [listener for listener in found if listener.name == "mpiexec"], found  # Hydra's port is among them
    assert not [listener for listener in found if _network(listener.pid) == _network()], found
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


def test_on_one_host_no_port_is_on_this_hosts_network(one_host):
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

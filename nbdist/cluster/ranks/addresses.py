"""Which address of this host another host reaches it by (pure socket logic; the kernel and the ranks both use it).

Why: a host name is not an address others can use. `socket.getfqdn()` may name an interface the other hosts have no
route to, or resolve only here; a node with several networks reaches each peer through one of them. The reliable
answer is the kernel's own: the address a packet to that peer would leave from (a UDP "connect" sends nothing, it
only asks the routing table). The kernel finds its address toward the engines' hosts (controller, lifeline, Hydra's
`-localhost`); rank 0 finds its address toward the kernel and serves the process-group rendezvous there, so no
variable has to be passed by hand. `NBDIST_MASTER_ADDR` (the kernel's address) and a named interface still override.
"""
from __future__ import annotations

import os
import socket

from nbdist.errors import DistUsageError

KERNEL_ADDRESS_ENV = "NBDIST_KERNEL_ADDR"  # given to the engines: the kernel's address, which rank 0 routes toward
MASTER_ADDR_ENV = "NBDIST_MASTER_ADDR"  # set by a user: the address other hosts reach the kernel's host by
IFACE_ENV = "NBDIST_IFACE"  # a network interface to use on every host (its first IPv4 address)
LOOPBACK = "127.0.0.1"


def resolve(host: str) -> str:
    """`host`'s IPv4 address, or one line naming the host that cannot be resolved."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (socket.gaierror, UnicodeError) as e:
        raise DistUsageError(f"host {host!r} cannot be resolved ({e.args[-1] if e.args else e}): check the name, "
                             f"or give its address") from None


def route_toward(peer: str) -> str:
    """This host's address that packets to `peer` leave from (the routing table's answer; nothing is sent)."""
    address = resolve(peer)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError as e:
            raise DistUsageError(f"host {peer!r} ({address}) is unreachable from {socket.gethostname()}: "
                                 f"{e.strerror or e}") from None
        return probe.getsockname()[0]


def interface_address(name: str) -> str:
    """The first IPv4 address of network interface `name`, or one line listing the interfaces there are."""
    import psutil

    interfaces = psutil.net_if_addrs()
    found = [a.address for a in interfaces.get(name, []) if a.family == socket.AF_INET]
    if not found:
        raise DistUsageError(f"no IPv4 address on network interface {name!r} of {socket.gethostname()}; "
                             f"interfaces: {', '.join(sorted(interfaces))}")
    return found[0]


def is_local(address: str) -> bool:
    """Whether `address` is one of this host's own (loopback included)."""
    import psutil

    if address.startswith("127."):
        return True
    return any(a.address == address for addrs in psutil.net_if_addrs().values() for a in addrs)


def address_toward(peers: list[str], iface: str | None = None) -> str:
    """The address of this host that `peers` reach it by: $NBDIST_MASTER_ADDR, else the named interface's, else the
    route toward the first peer that is not this host (loopback when every peer is this host)."""
    if os.environ.get(MASTER_ADDR_ENV):
        return os.environ[MASTER_ADDR_ENV]
    iface = iface or os.environ.get(IFACE_ENV)
    if iface:
        return interface_address(iface)
    for peer in peers:
        address = resolve(peer)
        if not is_local(address):
            return route_toward(address)
    return LOOPBACK

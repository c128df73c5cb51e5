"""Which address of this host another host reaches it by (pure socket logic; the kernel and the ranks both use it).

Why: a host name is not an address others can use. `socket.getfqdn()` may name an interface the other hosts have no
route to, or resolve only here; a node with several networks reaches each peer through one of them. The reliable
answer is the kernel's own: the address a packet to that peer would leave from (a UDP "connect" sends nothing, it
only asks the routing table). The kernel finds its address toward the engines' hosts (controller, lifeline, Hydra's
`-localhost`); rank 0 finds its address toward the kernel and serves the process-group rendezvous there, so no
variable has to be passed by hand. `NBDIST_MASTER_ADDR` (the kernel's address) and a named interface still override.

On one host the reverse question: how to keep what the cluster listens on to this host. The transports' settings
for that are here (`ONE_HOST_TRANSPORTS`, `loopback_interface`), and so is the guard on the one socket no setting
moves, Hydra's control port (`inherited_listeners`, `only_from_this_host`).
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys

from nbdist.errors import DistUsageError

KERNEL_ADDRESS_ENV = "NBDIST_KERNEL_ADDR"  # given to the engines: the kernel's address, which rank 0 routes toward
MASTER_ADDR_ENV = "NBDIST_MASTER_ADDR"  # set by a user: the address other hosts reach the kernel's host by
IFACE_ENV = "NBDIST_IFACE"  # a network interface to use on every host (its first IPv4 address)
LOOPBACK = "127.0.0.1"
# On one host MPICH's network module listens on no TCP port: UCX (the mpich wheel's default netmod) with its own and
# shared-memory transports only, or libfabric's shared-memory provider where MPICH runs over libfabric (its ranks
# on one host talk through MPICH's shared memory either way). A value the user set wins.
ONE_HOST_TRANSPORTS = {"UCX_TLS": "self,sm", "FI_PROVIDER": "shm"}


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


def loopback_interface() -> str:
    """The name of this host's loopback interface ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    return "lo"


def inherited_listeners() -> list[int]:
    """This process's listening TCP sockets bound to every interface (0.0.0.0 or ::). Asked by an engine before it
    opens any, these are what it inherited: Hydra's control port, which mpiexec binds to every interface (MPICH's
    Hydra has no setting to bind it elsewhere) and leaves open in the proxies and ranks it starts."""
    found = []
    folder = f"/proc/{os.getpid()}/fd"
    for name in os.listdir(folder) if sys.platform == "linux" else []:
        try:
            if not os.readlink(os.path.join(folder, name)).startswith("socket:"):
                continue
            copy = os.dup(int(name))
        except OSError:  # gone (the listing's own descriptor)
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue
        with sock:
            try:
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                inet = sock.family in (socket.AF_INET, socket.AF_INET6)
                wildcard = inet and sock.getsockname()[0] in ("0.0.0.0", "::")
            except OSError:
                continue
            if listening and wildcard and sock.type == socket.SOCK_STREAM:
                found.append(int(name))
    return found


class _Instruction(ctypes.Structure):  # struct sock_filter: one classic BPF instruction
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


_SO_ATTACH_FILTER = 26  # Linux's setsockopt option (socket.SO_ATTACH_FILTER is not in Python's socket module)
_LOAD_IFINDEX = 0x20, 0xFFFFF008  # ld [SKF_AD_OFF + SKF_AD_IFINDEX]: the device the packet arrived on
_JUMP_IF_EQUAL, _RETURN = 0x15, 0x06


def only_from_this_host(fd: int) -> bool:
    """Make listening socket `fd` answer this host alone: a socket filter (classic BPF, as tcpdump's) drops every
    packet that did not arrive on the loopback device, so a connection from another host gets no answer, and one
    from this host, to any of its addresses (all of which arrive on loopback), is accepted as before. The filter
    belongs to the socket, not to this descriptor: it holds for every process that shares it (mpiexec included).

    False where the kernel refuses the filter (some kernels ask CAP_NET_ADMIN for it, which an ordinary user lacks):
    a hardening step, never a reason for the start to fail; the caller says what stays open."""
    loopback = socket.if_nametoindex(loopback_interface())
    program = (_Instruction * 4)(
        _Instruction(_LOAD_IFINDEX[0], 0, 0, _LOAD_IFINDEX[1]),
        _Instruction(_JUMP_IF_EQUAL, 0, 1, loopback),
        _Instruction(_RETURN, 0, 0, 0xFFFFFFFF),  # keep the packet
        _Instruction(_RETURN, 0, 0, 0),  # drop it
    )
    with socket.socket(fileno=os.dup(fd)) as sock:
        fprog = struct.pack("HP", len(program), ctypes.addressof(program))  # struct sock_fprog: length, pointer
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
        except PermissionError:
            return False
        return True


def port_of(fd: int) -> int:
    """The port listening socket `fd` is bound to."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        return sock.getsockname()[1]

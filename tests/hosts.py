"""Hosts for multi-host tests, made on this machine: Linux network namespaces, each with its own address on a
private bridge and its own host name, each running a real sshd.

Why namespaces: nbdist's multi-host paths (ssh through MPI's launcher, the controller and lifeline listening where
other hosts reach them, the rendezvous at rank 0's address) must be tested against real daemons over a real network
stack, and CI has one machine. A host here is a network namespace (`ip netns add`) joined to a bridge in this
namespace by a veth pair, and an sshd started inside it under its own UTS namespace (so `hostname` there answers
the host's name). The file system is shared, as a cluster's home directories usually are. Only addresses inside the
private subnet the hosts are made in are used; everything is removed when the hosts are closed.

Needs root and iproute2, and Debian's openssh-server (.ci/run installs it). Where a host cannot be made, `SshHosts`
raises `HostsUnavailable` with the reason, and the tests skip saying it.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SSH_CONFIG = """\
Port 22
ListenAddress {address}
HostKey {folder}/host_key
AuthorizedKeysFile {folder}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
AcceptEnv *
"""
SSH_WRAPPER = """\
#!/bin/sh
# ssh to the test hosts: their key, no host-key prompts (they are made fresh every run), a short connect timeout
exec ssh -i {folder}/id -F /dev/null -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR \\
    -o BatchMode=yes -o ConnectTimeout=5 "$@"
"""


class HostsUnavailable(RuntimeError):
    """Hosts cannot be made here (not root, no network namespaces, no sshd): the reason, in one line."""


def made_or_skip(make):
    """`make()` entered, for a module fixture; where it cannot be made, the test skips saying why, or fails under
    NBDIST_REQUIRE_HOSTS=1 (CI: these tests must run there)."""
    import pytest

    try:
        return make().__enter__()
    except HostsUnavailable as why:
        if os.environ.get("NBDIST_REQUIRE_HOSTS") == "1":
            pytest.fail(f"cannot be made here, and NBDIST_REQUIRE_HOSTS=1: {why}")
        pytest.skip(f"cannot be made here: {why}")


class Made:
    """Something a test makes and must remove: `_make()` on entering (what was made is removed again if it fails),
    `close()` on leaving."""

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


@dataclass
class Host:
    name: str  # its host name (what `hostname` says there, and what nbdist reports)
    namespace: str  # its network namespace
    address: str  # its address on the bridge


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=30)


# Not the module `random`: code under test seeds it (a Trainer's inputs), and a seeded draw gave two runs the same
# subnet, so a bridge left by a killed run shadowed the next run's hosts (CI, 2026-12-07).
_RANDOM = random.SystemRandom()


def _free_subnet() -> str:
    """A private /24 no route here uses yet (one left by a killed run included)."""
    routes = _run("ip", "-4", "route", "show", "table", "all", check=False).stdout if shutil.which("ip") else ""
    for _ in range(100):
        subnet = f"10.{_RANDOM.randrange(100, 250)}.{_RANDOM.randrange(1, 250)}"
        if f"{subnet}." not in routes:
            return subnet
    raise HostsUnavailable("no free 10.x.y.0/24 subnet for the test hosts")


@dataclass
class SshHosts(Made):
    """`count` hosts with sshd, made on entering and removed on leaving (also after a failed start)."""

    count: int = 2
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="nbdist-hosts-")))
    hosts: list[Host] = field(default_factory=list)
    _daemons: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 10000}{_RANDOM.randrange(100)}"
        self.bridge = f"nbdbr{tag}"[:15]
        self.subnet = _free_subnet()
        self.gateway = f"{self.subnet}.1"  # this namespace's address on the bridge: where the kernel listens
        self.hosts = [Host(f"nbdist-host{i + 1}", f"nbdh{tag}x{i + 1}", f"{self.subnet}.{i + 2}")
                      for i in range(self.count)]

    # -- making and removing ------------------------------------------------------------------------------------------

    def _make(self) -> None:
        why = self.unavailable()
        if why:
            raise HostsUnavailable(why)
        self._keys()
        self._network()
        for host in self.hosts:
            self._sshd(host)
        self._wait_for_sshd()

    @staticmethod
    def unavailable() -> str | None:
        """Why hosts cannot be made here, or None."""
        if os.geteuid() != 0:
            return "needs root (network namespaces)"
        if not shutil.which("ip") or not shutil.which("unshare"):
            return "needs iproute2's ip and util-linux's unshare"
        if not os.access(SSHD, os.X_OK):
            return f"needs sshd ({SSHD}: apt-get install openssh-server)"
        probe = f"nbdprobe{os.getpid() % 100000}"
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace here: {made.stderr.strip()}"
        _run("ip", "netns", "delete", probe, check=False)
        return None

    def _keys(self) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "id"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "host_key"))
        shutil.copy(self.folder / "id.pub", self.folder / "authorized_keys")
        os.chmod(self.folder / "authorized_keys", 0o600)
        self.ssh = self.folder / "ssh"
        self.ssh.write_text(SSH_WRAPPER.format(folder=self.folder))
        self.ssh.chmod(0o755)

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            veth = self._veth(i)
            _run("ip", "netns", "add", host.namespace)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", host.namespace, "link", "set", "lo", "up")

    def _sshd(self, host: Host) -> None:
        config = self.folder / f"sshd_{host.name}"
        config.write_text(SSH_CONFIG.format(address=host.address, folder=self.folder))
        os.makedirs("/run/sshd", exist_ok=True)
        log = open(self.folder / f"{host.name}.log", "w")  # noqa: SIM115 - the daemon writes it until closed
        self._daemons.append(subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c",
             f"hostname {host.name} && exec {SSHD} -D -e -f {config}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_for_sshd(self, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        for host in self.hosts:
            while (tried := _run(str(self.ssh), host.address, "true", check=False)).returncode != 0:
                if time.monotonic() > deadline:
                    log = (self.folder / f"{host.name}.log").read_text()[-300:].strip()
                    raise HostsUnavailable(f"sshd on {host.name} ({host.address}) did not answer: ssh said "
                                           f"{tried.stderr.strip()[-300:]!r}; sshd's log: {log!r}")
                time.sleep(0.1)

    def close(self) -> None:
        """Every process left in the hosts' namespaces (sshd, and anything a test left there), the namespaces, the
        veth pairs, the bridge and the keys: nothing stays."""
        for host in self.hosts:
            for pid in self.pids(host):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5  # a namespace lives on while a process is in it
        while any(self.pids(host) for host in self.hosts) and time.monotonic() < deadline:
            time.sleep(0.05)
        for i, host in enumerate(self.hosts):
            _run("ip", "link", "delete", self._veth(i), check=False)
            _run("ip", "netns", "delete", host.namespace, check=False)
        _run("ip", "link", "delete", self.bridge, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _veth(self, i: int) -> str:
        return f"{self.bridge}v{i}"[:15]

    # -- what tests ask ---------------------------------------------------------------------------------------------

    def pids(self, host: Host) -> list[int]:
        """The processes running in `host`'s network namespace."""
        listed = _run("ip", "netns", "pids", host.namespace, check=False).stdout.split()
        return [int(p) for p in listed if p.isdigit()]

    def engine_pids(self, host: Host) -> list[int]:
        """Processes in `host` other than its sshd and that sshd's helpers: what a cluster would have left there."""
        own = {d.pid for d in self._daemons}
        left = []
        for pid in self.pids(host):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if pid in own or command.startswith((SSHD, "sshd", "ip netns", "unshare")):
                continue
            left.append(pid)
        return left

    def link_of(self, host: Host) -> str:
        """The bridge's end of `host`'s cable."""
        return self._veth(self.hosts.index(host))

    def set_link(self, host: Host, state: str) -> None:
        """Unplug ("down") or plug back ("up") `host`'s cable: the host keeps running, unreachable."""
        _run("ip", "link", "set", self.link_of(host), state)

    @property
    def mpi_args(self) -> tuple[str, ...]:
        """What mpiexec needs to ssh to these hosts (their key, no host-key prompts)."""
        return ("-launcher", "ssh", "-launcher-exec", str(self.ssh))

    def names(self, slots: int) -> str:
        """`--hosts` for these hosts with `slots` engines each: their addresses (names resolve only inside)."""
        return ",".join(f"{h.address}:{slots}" for h in self.hosts)

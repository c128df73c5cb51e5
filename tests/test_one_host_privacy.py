"""A cluster on one host is its user's alone: another local user can neither read its traffic nor end it.

Before: the controller's 18 ports on 127.0.0.1 gave any local user every cell's source and every rank's output (an
iopub subscriber needs no key), and 12 bytes to Hydra's control port (`HYD\\0`, pgid 0, proxy 0) ended the job. Now
the controller and the lifeline server listen on socket files in the cluster's 0700 folder, and mpiexec and the
ranks live in a network namespace of their own (cluster/launching/privacy.py). The probes run as another Unix user
(made here; CI runs the tests as root) with the system's Python, against the real shared cluster.

Where the OS refuses the namespace (user.max_user_namespaces=0 inside a user namespace of the test's; or
NBDIST_PRIVATE_NET=0) the cluster still starts, and its status says in one line each what stays open.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys

import psutil
import pytest

NEIGHBOUR = "nbdist-neighbour"
PROBE_PYTHON = "/usr/bin/python3"  # the neighbour's own Python: root's venv lies in a folder they cannot enter

KERNEL = """
import nbdist
cluster = nbdist.start(2, timeout=120, fork={fork})
try:
    print(cluster.status())
    print("ranks:", sorted(cluster.run(lambda: __import__("torch").distributed.get_rank())))
finally:
    nbdist.stop()
"""

PROBE = r"""
import json, socket, sys
paths, ports = json.loads(sys.argv[1])
found = {}
for path in paths:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        found[path] = "connected"
    except OSError as e:
        found[path] = type(e).__name__
    s.close()
for port in ports:  # Hydra's 'kill the job': HYD\0, then pgid 0 and proxy 0
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"HYD\0" + (0).to_bytes(4, "little") + (0).to_bytes(4, "little"))
        found[port] = "sent"
    except OSError as e:
        found[port] = type(e).__name__
print(json.dumps(found))
"""


def _listening(processes: list[psutil.Process]) -> list[str]:
    """What the processes listen on as this host's network sees it (ss: TCP, UDP, Unix)."""
    pids = {p.pid for p in processes}
    out = subprocess.run(["ss", "-lntuxp"], capture_output=True, text=True, check=True).stdout
    return [" ".join(line.split()[:5]) for line in out.splitlines()
            if any(f"pid={pid}," in line for pid in pids)]


def _folder(cluster) -> str:
    return cluster._launched.cluster.profile_dir


def _neighbour() -> pwd.struct_passwd:
    if os.getuid() != 0:
        pytest.skip("the probes run as another user, whom only root can make and become (CI runs this as root)")
    try:
        return pwd.getpwnam(NEIGHBOUR)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", NEIGHBOUR], check=True)
        return pwd.getpwnam(NEIGHBOUR)


def _cluster_listening(cluster) -> list[str]:
    """What the cluster's processes listen on, and the lifeline server this process serves for it."""
    return _listening(cluster.processes()) + [line for line in _listening([psutil.Process()]) if _folder(cluster) in line]


def test_a_cluster_on_one_host_listens_on_no_port_of_this_host(cluster):
    listening = _cluster_listening(cluster)
    ports = [line for line in listening if line.split()[0] in ("tcp", "udp")]
    abstract = [line for line in listening if "@" in line]
    assert not ports and not abstract, "\n".join(listening)
    folders = {os.path.dirname(line.split()[4]) for line in listening}
    assert _folder(cluster) in folders and all(os.stat(f).st_mode & 0o077 == 0 for f in folders), folders


def test_another_user_reaches_nothing_and_cannot_end_the_job(cluster):
    neighbour = _neighbour()
    sockets = sorted({line.split()[4] for line in _cluster_listening(cluster)})

    def hydra_ports():
        from nbdist.cluster.hosts.ranks import addresses

        return [addresses.port_of(fd) for fd in addresses.inherited_listeners()]

    ports = sorted({port for ranks in cluster.run(hydra_ports) for port in ranks})
    assert sockets and ports
    probe = subprocess.run(
        ["setpriv", f"--reuid={neighbour.pw_uid}", f"--regid={neighbour.pw_gid}", "--clear-groups",
         PROBE_PYTHON, "-I", "-c", PROBE, json.dumps([sockets, ports])],
        capture_output=True, text=True, timeout=60, cwd="/")
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert all(found[path] == "PermissionError" for path in sockets), found
    assert all(found[str(port)] == "ConnectionRefusedError" for port in ports), found
    assert cluster.run(lambda: __import__("torch").distributed.get_world_size()) == [2, 2]
    assert [t.tolist() for t in cluster.run(_all_reduce_ones)] == [[2.0, 2.0]] * 2


def _all_reduce_ones():
    import torch
    import torch.distributed as dist

    t = torch.ones(2)
    dist.all_reduce(t)
    return t


def _open_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("open: ")]


def _run_kernel(command: list[str], fork: bool, env: dict[str, str] | None = None) -> str:
    run = subprocess.run(command + [sys.executable, "-c", KERNEL.format(fork=fork)], capture_output=True, text=True,
                         timeout=240, env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "ranks: [0, 1]" in run.stdout, run.stdout
    return run.stdout


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "launched"])
def test_without_cap_net_admin_the_cluster_still_gets_a_network_of_its_own(fork):
    """An ordinary user lacks CAP_NET_ADMIN (the socket filter on Hydra's port needs it); the namespace does not.
    Root takes it away with setpriv; an ordinary user (scripts/test_as_user.sh) has none to take."""
    without = ["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin"] if os.getuid() == 0 else []
    stdout = _run_kernel(without, fork)
    assert not _open_lines(stdout), stdout


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "launched"])
def test_where_the_os_refuses_the_namespace_the_start_goes_on_and_says_what_is_open(fork, tmp_path):
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to turn user namespaces off for one kernel")
    turned_off = ["unshare", "--user", "--map-root-user", "sh", "-c",
                  'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"]
    # the kernel is root in that namespace: its clusters' folder must be one it owns there
    lines = _open_lines(_run_kernel(turned_off, fork, {"NBDIST_CLUSTER_DIR": str(tmp_path / "clusters")}))
    why = "(no private network namespace: the OS refuses a private network namespace: user namespaces are turned " \
          "off or used up (sysctl user.max_user_namespaces))"
    assert len(lines) == 2, lines
    assert lines[0].startswith("open: Hydra's control port ") and lines[0].endswith(
        " answers every local user and other hosts (the socket filter that keeps it to this host needs "
        f"CAP_NET_ADMIN): any of them can end the job {why}"), lines
    assert lines[1] == ("open: the ranks' ports on loopback (gloo's, MPICH's abstract sockets) answer every local "
                        f"user {why}"), lines


def test_turned_off_by_the_user_it_says_so():
    lines = _open_lines(_run_kernel([], True, {"NBDIST_PRIVATE_NET": "0"}))
    assert len(lines) == 2 and all(line.endswith("(no private network namespace: NBDIST_PRIVATE_NET=0 turns it off)")
                                   for line in lines), lines

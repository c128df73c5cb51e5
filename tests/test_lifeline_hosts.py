"""The lifeline across hosts: a process started for a kernel on another host lives exactly as long as that kernel.

A kernel "on another host" is a real process here whose host name, as the environment passes it on, is not this
machine's, and whose pid means nothing here (a pid that has exited), as a remote kernel's pid would. The old
lifeline watched that pid and ended its process at once; the new one holds a TCP connection to the kernel's
lifeline server and ends its process when the kernel dies (SIGKILL included), and never for a stranger's server.
Real processes and sockets throughout; the cluster tests start real MPI engines.

Run as a module (`python -m nbdist.cluster.hosts.lifeline PID test_lifeline_hosts`) this file is the watched program: it says
it is running, then sleeps.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SLEEP_SECONDS = 120

FAKE_KERNEL = """
import json, sys, time
from nbdist.cluster.hosts.lifeline import HOST_ENV, WATCH_ENV
from nbdist.cluster.hosts.lifeline_server import LifelineServer
server = LifelineServer("127.0.0.1")
env = server.environment()
env.update({HOST_ENV: sys.argv[1], WATCH_ENV: sys.argv[2]})
print(json.dumps(env), flush=True)
time.sleep(600)
"""


def _gone_pid() -> int:
    """A pid no process has here: what a kernel's pid on another host looks like to this one."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


def _fake_kernel(host_name: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """A real process serving a lifeline, claiming to run on `host_name`; returns it and the engines' environment."""
    kernel = subprocess.Popen([sys.executable, "-c", FAKE_KERNEL, host_name, str(_gone_pid())],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return kernel, json.loads(kernel.stdout.readline())


def _watched(env: dict[str, str], pid: int | str) -> subprocess.Popen:
    """`python -m nbdist.cluster.hosts.lifeline PID test_lifeline_hosts` (this file, which sleeps) with `env` on top of ours."""
    paths = os.pathsep.join([str(ROOT), str(TESTS)])
    proc = subprocess.Popen([sys.executable, "-m", "nbdist.cluster.hosts.lifeline", str(pid), "test_lifeline_hosts"],
                            env={**os.environ, **env, "PYTHONPATH": paths}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc


def _exit_within(proc: subprocess.Popen, seconds: float) -> tuple[int | None, float]:
    """(return code or None if still running after `seconds`, seconds it took)."""
    started = time.monotonic()
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pass
    return proc.returncode, time.monotonic() - started


def _end(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_process_for_a_kernel_elsewhere_lives_with_it_and_exits_when_it_is_killed():
    kernel, env = _fake_kernel("kernel-elsewhere")
    watched = _watched(env, env["NBDIST_KERNEL_PID"])
    try:
        assert watched.stdout.readline().strip() == "running"  # the lifeline let the program start
        assert _exit_within(watched, 3.0)[0] is None  # the old pid watch ended it at once (its pid is gone here)
        connections = [c for c in psutil.Process(watched.pid).net_connections("tcp") if c.status == "ESTABLISHED"]
        assert [c.raddr.port for c in connections] == [int(env["NBDIST_LIFELINE_ADDR"].rpartition(":")[2])]
        kernel.send_signal(signal.SIGKILL)
        code, seconds = _exit_within(watched, 5.0)
        assert code == 3 and seconds < 2.0, (code, seconds)
        assert watched.stderr.read() == ""  # a kernel's death is no error: nothing to say
    finally:
        _end(watched, kernel)


def test_on_the_kernels_host_the_pid_is_watched_not_the_server():
    """Same host name: the pid watch (instant, no socket), even though a lifeline server is named."""
    from nbdist.cluster.hosts.lifeline_server import LifelineServer

    server = LifelineServer()
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watched = _watched({**server.environment(), "NBDIST_KERNEL_HOST": socket.gethostname()}, kernel.pid)
    try:
        assert watched.stdout.readline().strip() == "running"
        assert _exit_within(watched, 1.0)[0] is None and server.held() == 0
        kernel.send_signal(signal.SIGKILL)
        code, seconds = _exit_within(watched, 5.0)
        assert code == 3 and seconds < 2.0, (code, seconds)
    finally:
        _end(watched, kernel)
        server.close()


def test_a_wrong_token_is_not_a_lifeline():
    """The process given a wrong token is refused and ends (it must not run unwatched), saying so in one line."""
    from nbdist.cluster.hosts.lifeline_server import LifelineServer

    server = LifelineServer()
    env = {**server.environment(), "NBDIST_KERNEL_HOST": "kernel-elsewhere", "NBDIST_LIFELINE_TOKEN": "0" * 32}
    watched = _watched(env, _gone_pid())
    try:
        code, _ = _exit_within(watched, 10.0)
        lines = watched.stderr.read().splitlines()
        assert code == 3 and server.held() == 0
        expected = ("nbdist lifeline: the server closed the connection: it did not accept this process's token "
                    f"(kernel's lifeline server at {server.address}); this process exits")
        assert lines == [expected]
    finally:
        _end(watched)
        server.close()


def test_the_server_holds_only_connections_that_say_the_token():
    from nbdist.cluster.hosts.lifeline_server import LifelineServer

    server = LifelineServer(handshake_seconds=0.5)
    try:
        wrong = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        wrong.sendall(b"not-the-token\n")
        assert wrong.recv(16) == b""  # closed by the server
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert silent.recv(16) == b""  # said nothing within the handshake time: closed
        good = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        good.sendall(server.token.encode() + b"\n")
        assert good.recv(16) == b"ok\n"
        assert _wait_for(lambda: server.held() == 1)
        good.close()  # an engine that exits leaves the server's list
        assert _wait_for(lambda: server.held() == 0)
    finally:
        server.close()
    assert not server.serving


def _lifeline_to(server, pid: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    conn.sendall(server.token.encode() + f" elsewhere {pid}\n".encode())
    assert conn.recv(3) == b"ok\n"
    return conn


def _line(conn: socket.socket) -> bytes:
    said = b""
    while not said.endswith(b"\n"):
        said += conn.recv(4096)
    return said


def test_the_controllers_connection_info_reaches_every_lifeline_once_before_or_after_it_is_published():
    """Engines on other hosts register with what comes down their lifeline, not with a file they cannot read."""
    from nbdist.cluster.hosts.lifeline_server import LifelineServer

    info = {"interface": "tcp://10.0.0.1", "registration": 41234, "key": "k" * 32}
    server = LifelineServer()
    try:
        early = _lifeline_to(server, 1)
        assert _wait_for(lambda: server.held() == 1)
        server.publish_engine_connection(info)
        late = _lifeline_to(server, 2)
        assert [json.loads(_line(c)) for c in (early, late)] == [info, info]
        assert server.signal("elsewhere", 2, 15)  # signals still follow on the same line
        assert _line(late) == b"15\n"
    finally:
        server.close()


def test_across_hosts_the_lifeline_is_tls_to_the_pinned_certificate_and_the_token_stays_out_of_the_environment(
        tmp_path):
    """The server made for engines on other hosts speaks TLS 1.3 only; a process holds its lifeline once the server
    shows the certificate pinned in its environment (public) and accepts its token (which the environment mpiexec
    sends does not hold); a server showing another certificate is never told the token."""
    from nbdist.cluster.hosts.lifeline_server import serve

    server = serve("127.0.0.1", token_file=str(tmp_path / "token"))
    impostor = serve("127.0.0.1", token_file=str(tmp_path / "other"))
    env = server.environment()
    assert "NBDIST_LIFELINE_TOKEN" not in env and len(env["NBDIST_LIFELINE_TLS"]) == 64
    assert (tmp_path / "token").read_text() == server.token and oct((tmp_path / "token").stat().st_mode)[-3:] == "600"
    good = _watched({**env, **server.secret_environment(), "NBDIST_KERNEL_HOST": "kernel-elsewhere"}, _gone_pid())
    fooled = _watched({**env, **server.secret_environment(), "NBDIST_KERNEL_HOST": "kernel-elsewhere",
                       "NBDIST_LIFELINE_ADDR": impostor.address}, _gone_pid())
    try:
        assert good.stdout.readline().strip() == "running" and _wait_for(lambda: server.held() == 1)
        plain = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        plain.sendall(server.token.encode() + b" elsewhere 1\n")  # the right token, in clear: not TLS, dropped
        try:
            said = plain.recv(16)
        except ConnectionResetError:  # closed with the unread line still in its buffer
            said = b""
        assert said == b"" and server.held() == 1
        code, _ = _exit_within(fooled, 20.0)
        assert code == 3 and impostor.held() == impostor.pending() == 0
        assert "certificate is not the kernel's" in fooled.stderr.read()
    finally:
        _end(good, fooled)
        server.close()
        impostor.close()
    assert not (tmp_path / "token").exists()


def test_an_unreachable_server_ends_the_process_with_one_line_naming_it(closed_port):
    port = closed_port
    env = {"NBDIST_KERNEL_HOST": "kernel-elsewhere", "NBDIST_LIFELINE_ADDR": f"127.0.0.1:{port}",
           "NBDIST_LIFELINE_TOKEN": "0" * 32}
    watched = _watched(env, _gone_pid())
    try:
        assert watched.stdout.readline().strip() == "running"  # it kept trying while its program started
        code, seconds = _exit_within(watched, 20.0)
        lines = watched.stderr.read().splitlines()
        # it gives up CONNECT_SECONDS after it started, a moment before "running" was read (its program's start-up
        # time, seconds on a loaded machine): so no lower bound here; the message says how long it tried
        assert code == 3 and seconds < 15.0, (code, seconds)
        assert len(lines) == 1 and lines[0].startswith("nbdist lifeline: cannot connect for 10 s: ConnectionRefused")
        assert lines[0].endswith(f"(kernel's lifeline server at 127.0.0.1:{port}); this process exits")
    finally:
        _end(watched)


@pytest.fixture
def closed_port():
    """A port on which nothing listens: bound (so no one else takes it) but never listening, until the test ends."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- real clusters ---------------------------------------------------------------------------------------------


def _lifeline_threads() -> int:
    from nbdist.cluster.hosts.lifeline_server import THREAD_NAME

    return sum(1 for t in threading.enumerate() if t.name == THREAD_NAME)


def _engines(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The ranks themselves (mpiexec's command line names the engine module too; a rank forked from the kernel shows
    its command line as one string: cluster/launching/ranks/zygote.py)."""
    return [p for p in procs if " ".join(p.cmdline()).split()[1:3] == ["-m", "nbdist.cluster.launching.ranks.main"]]


def _run_cluster(mpi_args: tuple[str, ...]) -> tuple[str, list[int], int]:
    """Start a real 2-engine cluster, return its lifeline's socket file (one host: in the cluster's 0700 folder), how
    many lines each engine holds to it (its lifeline, if it holds one, and its inspector's line:
    cluster/waiting/ranks/inspector.py, counted at the server by the engine's pid) and how many lifelines the
    server holds; stop it."""
    import nbdist
    from nbdist.cluster.hosts.lifeline import ADDRESS_ENV, UNIX_PREFIX

    threads = _lifeline_threads()
    with nbdist.Cluster(nbdist.cluster.options.ClusterOptions(n=2, mpi_args=mpi_args)) as c:
        assert c.run(lambda: 7) == [7, 7]
        engines = _engines(c.processes())
        server = c._launched.lifeline
        address = server.environment()[ADDRESS_ENV]
        assert address.startswith(UNIX_PREFIX) and os.path.exists(address[len(UNIX_PREFIX):])
        assert _lifeline_threads() == threads + 1
        assert _wait_for(lambda: len(server._inspectors) == len(engines))
        with server._lock:
            lines = [pid for _, pid in list(server._by_process) + list(server._inspectors)]
        links = [lines.count(e.pid) for e in engines]
        held = server.held()
    assert _lifeline_threads() == threads and not os.path.exists(address[len(UNIX_PREFIX):])  # stop closed it
    return address, links, held


def test_a_single_host_cluster_serves_a_lifeline_no_engine_needs_and_stop_closes_it():
    _, links, held = _run_cluster(())
    assert held == 0  # on the kernel's host the engines watch its pid
    assert links == [1, 1]  # each engine's inspector line only


def test_engines_that_believe_they_are_elsewhere_hold_the_kernels_lifeline():
    """The whole wiring of the remote path on one machine: mpiexec gives the ranks another kernel host name."""
    _, links, held = _run_cluster(("-genv", "NBDIST_KERNEL_HOST", "kernel-elsewhere"))
    assert held == 2 and links == [2, 2]  # a lifeline and an inspector line each


def test_sigkill_of_a_kernel_elsewhere_ends_its_engines(tmp_path):
    """A real kernel, its engines told it is on another host: SIGKILL it and every process of its cluster goes."""
    from kernel_driver import KernelDriver
    from processes import wait_until_gone

    cluster_dir = tmp_path / "clusters"
    driver = KernelDriver(env={"NBDIST_CLUSTER_DIR": str(cluster_dir)})
    try:
        start = "import nbdist; c = nbdist.start(2, mpi_args=('-genv', 'NBDIST_KERNEL_HOST', 'kernel-elsewhere'))"
        result = driver.execute(start)
        assert not result.error, result.error_text
        procs = psutil.Process(driver.pid).children(recursive=True)
        engines = _engines(procs)
        told = driver.execute("print(c.run(lambda: __import__('os').environ['NBDIST_KERNEL_HOST']))")
        assert len(engines) == 2 and told.stdout.strip() == "['kernel-elsewhere', 'kernel-elsewhere']", told.stdout
        os.kill(driver.pid, signal.SIGKILL)
        assert wait_until_gone(engines, timeout=5) == []
        assert wait_until_gone(procs, timeout=15) == []
        assert _wait_for(lambda: list(cluster_dir.iterdir()) == [])  # the controller's lifeline (kernel's host)
    finally:
        driver.client.stop_channels()
        driver.manager.cleanup_resources()


if __name__ == "__main__":
    print("running", flush=True)
    time.sleep(SLEEP_SECONDS)

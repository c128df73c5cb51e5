"""A classroom, for real: a JupyterHub (pip's jupyterhub, npm's configurable-http-proxy, local Unix users, the idle
culler) with three learners who run lab 00 at the same time, each through their own server, each with their own
2-engine cluster. Each sees only their own cluster: one learner's probes against another's (its socket files, its
folder, its processes, Hydra's port) read nothing and disturb nothing, and the other's cluster answers after.
Culling a server leaves nothing of its cluster: no process, no cluster folder, no shared-memory file.

The learners' servers run from a venv on the system's Python, set up the README's way in a copy of this checkout
under /opt (root's venv lies in a folder they cannot enter). Needs root (the hub spawns servers as other users);
the memory and cores each learner used are printed (docs/teachers.md quotes them).
"""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import psutil
import pytest
from notebook_files import read_cells

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSROOM = "/opt/nbdist-classroom"  # a copy of this checkout and its venv, readable by the learners
LEARNERS = ("learner-a", "learner-b", "learner-c")
LAB = os.path.join(ROOT, "notebooks", "00_quickstart.ipynb")
SYSTEM_PYTHON = "/usr/bin/python3"
CULL_AFTER_S = 30  # idle seconds before the culler stops a server: longer than any pause between the test's cells
# (the longest: the first learner's server while the two others' servers start); 60 cost 30 s more of the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def classroom_venv() -> str:
    """This checkout's files (committed or not) copied to CLASSROOM, its venv made there by scripts/setup.sh on the
    system's Python (kept between runs: setup.sh installs again only when pyproject.toml changed)."""
    if os.getuid() != 0:
        pytest.skip("a JupyterHub that spawns servers as other users runs as root (CI runs this as root)")
    if shutil.which("configurable-http-proxy") is None:
        pytest.fail("configurable-http-proxy is needed: npm install -g configurable-http-proxy (.ci/run does)")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    os.makedirs(CLASSROOM, exist_ok=True)
    for name in filter(None, listed):
        source, target = os.path.join(ROOT, name), os.path.join(CLASSROOM, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)
    setup = subprocess.run(["bash", "-c", "source scripts/setup.sh"], cwd=CLASSROOM, capture_output=True, text=True,
                           env={**os.environ, "PYTHON": SYSTEM_PYTHON, "PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert setup.returncode == 0, setup.stdout[-2000:] + setup.stderr[-2000:]
    subprocess.run(["chmod", "-R", "a+rX", CLASSROOM], check=True)
    return os.path.join(CLASSROOM, ".venv")


def _config(venv: str, port: int, token: str) -> str:
    return f"""
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_port = {_free_port()}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{_free_port()}"
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {set(LEARNERS)!r}
c.Spawner.cmd = [{os.path.join(venv, "bin", "jupyterhub-singleuser")!r}]
c.Spawner.environment = {{"PATH": {os.path.join(venv, "bin") + ":/usr/bin:/bin"!r},
                          "JUPYTERHUB_ACTIVITY_INTERVAL": "5"}}  # the culler sees a busy learner as busy
c.JupyterHub.last_activity_interval = 5
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180
c.JupyterHub.services = [
    {{"name": "classroom-test", "api_token": {token!r}}},
    {{"name": "idle-culler", "command": [{sys.executable!r}, "-m", "jupyterhub_idle_culler",
                                         "--timeout={CULL_AFTER_S}", "--cull-every=5"]}},
]
c.JupyterHub.load_roles = [
    {{"name": "classroom-test", "services": ["classroom-test"],
      "scopes": ["admin:users", "admin:servers", "tokens", "access:servers", "read:users"]}},
    {{"name": "idle-culler", "services": ["idle-culler"],
      "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}},
]
"""


class Hub:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def api(self, method: str, path: str, body: dict | None = None, token: str | None = None):
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"token {token or self.token}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            text = answer.read()
        return json.loads(text) if text else None


@pytest.fixture(scope="module")
def hub(classroom_venv, tmp_path_factory):
    for name in LEARNERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
    folder = tmp_path_factory.mktemp("hub")
    port, token = _free_port(), secrets.token_hex(16)
    (folder / "jupyterhub_config.py").write_text(_config(classroom_venv, port, token))
    log = open(folder / "hub.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"], cwd=folder,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    made = Hub(f"http://127.0.0.1:{port}", token)
    deadline = time.monotonic() + 60
    while True:
        try:
            made.api("GET", "/hub/api/users")
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, (folder / "hub.log").read_text()[-3000:]
            time.sleep(0.5)
    yield made
    os.killpg(process.pid, 15)
    process.wait(30)
    log.close()
    for name in LEARNERS:  # whatever a failed test left
        subprocess.run(["pkill", "-KILL", "-u", name])


class Learner:
    """One learner's server and kernel, driven over the Jupyter protocol through the hub's proxy."""

    def __init__(self, hub: Hub, name: str):
        self.hub, self.name = hub, name
        self.token = hub.api("POST", f"/hub/api/users/{name}/tokens", {"note": "classroom test"})["token"]
        kernel = self.api("POST", "/api/kernels", {"name": "python3"})
        self.kernel_id = kernel["id"]
        import websocket

        self.ws = websocket.create_connection(
            f"{hub.url.replace('http', 'ws')}/user/{name}/api/kernels/{kernel['id']}/channels",
            header=[f"Authorization: token {self.token}"], timeout=600)
        self.session = uuid.uuid4().hex

    def close(self) -> None:
        """Shut this kernel down (its cluster, if any, with it)."""
        self.ws.close()
        self.api("DELETE", f"/api/kernels/{self.kernel_id}")

    def api(self, method: str, path: str, body: dict | None = None):
        return self.hub.api(method, f"/user/{self.name}{path}", body, token=self.token)

    def execute(self, code: str) -> str:
        """Run one cell; its text output, or AssertionError with the error the cell raised."""
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": self.name,
                       "session": self.session, "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        out, error, replied, idle = [], None, False, False
        while not (replied and idle):
            message = json.loads(self.ws.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            if kind == "stream":
                out.append(message["content"]["text"])
            elif kind == "error":
                error = f"{message['content']['ename']}: {message['content']['evalue']}"
            elif kind == "execute_reply":
                replied = True
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                idle = True
        assert error is None, f"{self.name}: {code[:80]!r} raised {error}\n{''.join(out)[-2000:]}"
        return "".join(out)


def _lab_cells() -> list[str]:
    """Lab 00's code cells as the teacher's version has them (exercises solved; its `%dist_start` starts the
    learner's cluster), all but its last `%dist_stop`:
    the probes need the clusters running, and culling is what stops them here."""
    cells = [cell.source for cell in read_cells(LAB) if cell.cell_type == "code"]
    assert cells[-1].strip() == "%dist_stop" and "c.run(train_ddp" in cells[TRAINING_CELL]
    return cells[:-1]


TRAINING_CELL = 6  # lab 00's first training: `results = c.run(train_ddp, make_problem, shard_loss)`


def _timed(run, cell: str) -> float:
    started = time.perf_counter()
    run(cell)
    return time.perf_counter() - started


def _usage(names: tuple[str, ...], stop: threading.Event, peak: dict, cpu: dict) -> None:
    """Sample each learner's processes every 0.5 s: the peak of their summed proportional memory (PSS: the pages
    forked ranks share are counted once) and their CPU time."""
    while not stop.wait(0.5):
        for name in names:
            pss = 0
            for p in psutil.process_iter(["username"]):
                if p.info["username"] != name:
                    continue
                try:
                    pss += p.memory_full_info().pss
                    times = p.cpu_times()
                    cpu[(name, p.pid)] = times.user + times.system
                except psutil.Error:
                    pass
            peak[name] = max(peak.get(name, 0), pss)


def _own_cluster(learner: Learner) -> dict:
    return json.loads(learner.execute(
        "import json, os, nbdist\n"
        "_c = nbdist.current()\n"
        "_folder = _c._launched.cluster.profile_dir\n"
        "print(json.dumps({'uid': os.getuid(), 'folder': _folder,\n"
        "    'sockets': sorted(os.path.join(_folder, n) for n in os.listdir(_folder) if n.startswith(('zmq', 'lifeline'))),\n"
        "    'pids': [p.pid for p in _c.processes()],\n"
        "    'hydra': sorted({p for r in _c.run(lambda: [__import__('nbdist.cluster.hosts.ranks.addresses', fromlist=['x'])"
        ".port_of(fd) for fd in __import__('nbdist.cluster.hosts.ranks.addresses', fromlist=['x']).inherited_listeners()])"
        " for p in r})}))\n"))


PROBE = """
import errno, json, os, signal, socket
target = json.loads({target!r})
found = {{}}
try:
    os.listdir(target["folder"]); found["folder"] = "listed"
except OSError as e:
    found["folder"] = errno.errorcode[e.errno]
for path in target["sockets"]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path); found[path] = "connected"
    except OSError as e:
        found[path] = errno.errorcode[e.errno]
    s.close()
for port in target["hydra"]:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"HYD\\0" + bytes(8)); found[f"hydra {{port}}"] = "sent"
    except OSError as e:
        found[f"hydra {{port}}"] = errno.errorcode[e.errno]
for pid in target["pids"]:
    try:
        os.kill(pid, signal.SIGTERM); found[f"kill {{pid}}"] = "sent"
    except OSError as e:
        found[f"kill {{pid}}"] = errno.errorcode[e.errno]
print(json.dumps(found))
"""


def _spawn(hub: Hub, names: tuple[str, ...]) -> None:
    for name in names:
        hub.api("POST", f"/hub/api/users/{name}/server")
    deadline = time.monotonic() + 180
    while not all(hub.api("GET", f"/hub/api/users/{name}")["servers"].get("", {}).get("ready") for name in names):
        assert time.monotonic() < deadline, f"the servers of {', '.join(names)} did not become ready within 180 s"
        time.sleep(1)


def test_three_learners_run_lab_00_at_once_each_alone_and_culling_leaves_nothing(hub):
    # the first learner alone on the machine, in a kernel of its own: the baseline; the others' servers start after it
    # (a server idle through the whole baseline could be culled: CULL_AFTER_S is not much longer than it)
    _spawn(hub, LEARNERS[:1])
    first = Learner(hub, LEARNERS[0])
    alone = [_timed(first.execute, cell) for cell in _lab_cells() + ["%dist_stop"]]
    first.close()
    _spawn(hub, LEARNERS[1:])
    learners = [Learner(hub, name) for name in LEARNERS]  # fresh kernels, as the baseline's was

    stop, peak, cpu, failures, together = threading.Event(), {}, {}, [], {}
    sampler = threading.Thread(target=_usage, args=(LEARNERS, stop, peak, cpu), daemon=True)
    sampler.start()

    def run_lab(learner: Learner) -> None:
        try:
            together[learner.name] = [_timed(learner.execute, cell) for cell in _lab_cells()]
        except BaseException as e:  # noqa: BLE001 - said below, for each learner
            failures.append(f"{learner.name}: {e}")

    started = time.monotonic()
    runs = [threading.Thread(target=run_lab, args=(learner,)) for learner in learners]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    wall = time.monotonic() - started
    stop.set()
    sampler.join()
    assert not failures, "\n".join(failures)
    cores = {name: sum(t for (who, _), t in cpu.items() if who == name) / wall for name in LEARNERS}
    print(f"\n3 learners ran lab 00 at once in {wall:.0f} s on {psutil.cpu_count()} cores; per learner: "
          + "; ".join(f"{name}: peak {peak[name] / 2**20:.0f} MiB (PSS), {cores[name]:.2f} cores on average"
                      for name in LEARNERS))

    training = TRAINING_CELL
    print(f"lab 00's training cell (50 DDP steps, 2 ranks): {LEARNERS[0]} alone {alone[training]:.2f} s; beside two "
          "others: " + ", ".join(f"{name} {together[name][training]:.2f} s "
                                 f"({together[name][training] / alone[training]:.1f}x)" for name in LEARNERS))

    clusters = {learner.name: _own_cluster(learner) for learner in learners}
    assert len({c["uid"] for c in clusters.values()}) == 3
    for learner, other in zip(learners, learners[1:] + learners[:1]):
        target = clusters[other.name]
        found = json.loads(learner.execute(PROBE.format(target=json.dumps(target))).strip().splitlines()[-1])
        assert found.pop("folder") == "EACCES", found
        assert all(found[path] == "EACCES" for path in target["sockets"]), found
        assert all(found[f"hydra {port}"] == "ECONNREFUSED" for port in target["hydra"]), found
        assert all(found[f"kill {pid}"] == "EPERM" for pid in target["pids"]), found
        assert other.execute("%%dist\nimport torch, torch.distributed as dist\n"
                             "t = torch.ones(2); dist.all_reduce(t); print(t.tolist())").count("[3.0, 3.0]") >= 1

    for learner in learners:
        learner.ws.close()
    deadline = time.monotonic() + CULL_AFTER_S + 90
    while any(hub.api("GET", f"/hub/api/users/{name}")["servers"] for name in LEARNERS):
        assert time.monotonic() < deadline, "the idle culler did not stop the servers"
        time.sleep(2)
    time.sleep(3)  # the lifelines end the ranks once their kernel is gone
    for name in LEARNERS:
        uid = pwd.getpwnam(name).pw_uid
        left = [p.info for p in psutil.process_iter(["pid", "name", "cmdline", "username"]) if p.info["username"] == name]
        assert not left, f"{name}'s processes left after culling: {left}"
        folder = f"/tmp/nbdist-{uid}"
        assert not os.path.isdir(folder) or not [n for n in os.listdir(folder) if n.startswith("cluster-")]
        assert not [n for n in os.listdir("/dev/shm") if os.stat(os.path.join("/dev/shm", n)).st_uid == uid]

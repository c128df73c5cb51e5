"""The lifeline's token as MUNGE credentials (cluster/hosts/token_launcher.py, under Slurm), against a real munged
the test starts on a socket of its own (no Slurm, no other host): the credentials hold no token in clear, the
receiver a node runs before Hydra's proxy decodes its task's credential into the proxy's environment, and every way
it cannot (a replay, no credential for its task, no munged, no unmunge) is one line naming the node, exit 1.

Skips where munge is not installed (apt-get install munge).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from nbdist.cluster.hosts import token_launcher as tl

TOKEN = "0f" * 16
SHOW = 'echo "token=$NBDIST_LIFELINE_TOKEN held=${NBDIST_LIFELINE_MUNGE:-none}"'


@pytest.fixture(scope="module")
def munged(tmp_path_factory):
    if not (os.access("/usr/sbin/munged", os.X_OK) and shutil.which("munge") and shutil.which("unmunge")):
        pytest.skip("needs munge (apt-get install munge)")
    folder = tmp_path_factory.mktemp("munge")
    key = folder / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket = folder / "socket"
    daemon = subprocess.Popen(["/usr/sbin/munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={socket}", f"--pid-file={folder}/pid", f"--log-file={folder}/log",
                               f"--seed-file={folder}/seed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not socket.exists() and time.monotonic() < deadline and daemon.poll() is None:
        time.sleep(0.02)
    assert socket.exists(), "munged did not start"
    yield str(socket)
    daemon.kill()
    daemon.wait()


def receive(socket: str, credentials: list[str], task: int, path: str | None = None) -> subprocess.CompletedProcess:
    """The receiver as srun's task `task` on node "node<task>" runs it, the proxy replaced by a shell that shows
    what it was given."""
    env = {**os.environ, "SLURM_PROCID": str(task), "SLURMD_NODENAME": f"node{task}",
           tl.CREDENTIALS_ENV: " ".join(credentials), "PATH": path or os.environ["PATH"]}
    env.pop(tl.TOKEN_ENV, None)
    command = tl.srun_command(["-N", "2", "-n", "2", "--input", "none", "hydra_pmi_proxy"], sys.executable, socket)
    at = command.index("hydra_pmi_proxy")
    return subprocess.run(command[6:at] + ["/bin/sh", "-c", SHOW], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_credentials_hide_the_token_and_each_task_decodes_its_own_once(munged):
    made = tl.credentials(TOKEN, munged, 2)
    assert len(set(made)) == 2 and all(c.startswith("MUNGE:") and TOKEN not in c for c in made), made
    for task in (0, 1):
        done = receive(munged, made, task)
        assert (done.returncode, done.stdout.strip(), done.stderr) == (0, f"token={TOKEN} held=none", "")
    replayed = receive(munged, made, 1)
    assert replayed.returncode == 1 and replayed.stdout == ""
    assert replayed.stderr == ("nbdist: node node1 could not read the lifeline's token (a MUNGE credential): "
                               "Replayed credential (17)\n")


def test_a_node_that_cannot_decode_says_so_in_one_line(munged, tmp_path):
    made = tl.credentials(TOKEN, munged, 1)
    lines = {"no credential for its task": receive(munged, made, 1).stderr,
             "no munged": receive(munged + ".none", made, 0).stderr}
    no_unmunge = tmp_path / "bin"  # a PATH without unmunge
    no_unmunge.mkdir()
    lines["no unmunge"] = receive(munged, made, 0, path=str(no_unmunge)).stderr
    said = {why: line.removeprefix("nbdist: node ").split(": ", 1) for why, line in lines.items()}
    assert said == {"no credential for its task": ["node1 could not read the lifeline's token (a MUNGE credential)",
                                                   "no credential for task 1 (srun was given 1)\n"],
                    "no munged": ["node0 could not read the lifeline's token (a MUNGE credential)",
                                  (f'unmunge: Error: Failed to access "{munged}.none": No such file or directory '
                                   "(Did you start munged?)\n")],
                    "no unmunge": ["node0 could not read the lifeline's token (a MUNGE credential)",
                                   "no unmunge on PATH\n"]}, said


def test_srun_is_wrapped_before_the_proxy_and_asked_for_one_credential_per_task():
    hydra = ["--nodelist", "a,b", "-N", "2", "-n", "2", "--input", "none", "/x/hydra_pmi_proxy", "--control-port",
             "h:1", "-1"]
    wrapped = tl.srun_command(hydra, "/py", "/s")
    assert wrapped[:8] == hydra[:8] and wrapped[8:11] == ["/py", "-S", "-c"] and wrapped[-4:] == hydra[-4:]
    assert wrapped[12:15] == [tl.TOKEN_ENV, tl.CREDENTIALS_ENV, "/s"]
    assert tl.tasks(hydra) == 2 and tl.tasks(["--ntasks=3", "hydra_pmi_proxy"]) == 3 and tl.tasks(["x"]) == 1
    assert tl.srun_command(["-n", "1", "hostname"], "/py", "") is None  # not Hydra's: srun as it is

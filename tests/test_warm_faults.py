"""The warm process (cluster/launching/warm.py) failing or stalling between its fork and "ready", each fault real and
injected from outside nbdist: a handler the kernel registered for its forks (os.register_at_fork: slow, hanging,
killing, stopping the child, as a library's own handler could), a broken module on the kernel's path, a folder
path too long for a socket. Each start runs in a fresh Python (this test process may have loaded MPI, and then
gets fresh ranks), and must end within a bound, in one line naming the problem, with no process, socket folder
or MPICH file of its own left.

Before: a start that failed while the warm process had not yet set its parent-death signal and called setsid (a
slow fork handler, a settings file nbdist reads at once) hung for good in the warm process's stop (killpg of a
group that was not there, then waitpid); a warm process that died before it was ready was named only by its
ranks' stand-ins ("does not answer ... (Connection refused)"); one that hung was "only 0 of 2 engines registered".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cluster  # each test (bar the last) starts a cluster, in a Python of its own
WARM = "the warm process that forks the ranks"
STARTS = textwrap.dedent('''
    import glob, json, os, sys, tempfile, time
    import psutil
    {fault}
    import nbdist
    from nbdist.cluster.launching import mpi_segments
    from nbdist.cluster.options import ClusterOptions
    before = set(mpi_segments.segments())
    started = time.monotonic()
    try:
        nbdist.Cluster(ClusterOptions(n=2, cpu=True, timeout={timeout})).start().stop()
        said = "started"
    except Exception as e:
        said = f"{{type(e).__name__}}: {{e}}"
    took = time.monotonic() - started
    def still_there(p):  # a child may end between the listing and the look (seen in CI: NoSuchProcess)
        try:
            return " ".join(p.cmdline()) if p.status() != psutil.STATUS_ZOMBIE else None
        except psutil.NoSuchProcess:
            return None
    left = [c for c in map(still_there, psutil.Process().children(recursive=True)) if c is not None]
    print(json.dumps({{"said": said, "took": took, "left": left,
                      "sockets": glob.glob(os.path.join(tempfile.gettempdir(), "nbdist-warm-*")),
                      "segments": sorted(set(mpi_segments.segments()) - before - mpi_segments.held())}}))
''')
AT_FORK = "import os, signal, time\nos.register_at_fork(after_in_child=lambda: {action})\n"
BAD_SETTING = ("ipd = tempfile.mkdtemp(); os.makedirs(ipd + '/profile_default')\n"
               "open(ipd + '/profile_default/ipcluster_config.py', 'w').write(\"c = get_config()\\nc.Cluster.delay = 'soon'\\n\")\n"
               "os.environ['IPYTHONDIR'] = ipd\n")


def _start(fault: str, tmp_path, timeout: float = 8, env: dict | None = None) -> dict:
    """A start in a fresh Python after `fault` (code run first); what it said, how long it took, what it left."""
    os.environ.setdefault("TMPDIR", str(tmp_path))
    code = STARTS.format(fault=fault, timeout=timeout)
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout + 60,
                         env={**os.environ, "TMPDIR": str(tmp_path), **(env or {})})
    assert ran.returncode == 0, ran.stdout + ran.stderr
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen["left"] == [] and seen["sockets"] == [] and seen["segments"] == [], seen
    return seen


@pytest.mark.parametrize("stall", ["time.sleep(3)", "time.sleep(3600)"])
def test_a_start_failing_before_the_warm_process_has_left_the_kernel_ends_at_once(stall, tmp_path):
    """Before: hung for good (the slow one too: once its handler returned it served, unwatched)."""
    seen = _start(AT_FORK.format(action=stall) + BAD_SETTING, tmp_path)
    assert seen["said"].startswith("TraitError: The 'delay' trait of a Cluster instance expected a float"), seen
    assert seen["took"] < 7, seen  # the stop waits STOP_SECONDS at most; it takes milliseconds


@pytest.mark.parametrize("action, said", [
    ("os.kill(os.getpid(), signal.SIGKILL)", f"{WARM} was killed by SIGKILL before it was ready"),
    ("os._exit(3)", f"{WARM} exited with code 3 before it was ready"),
])
def test_a_warm_process_that_dies_before_it_is_ready_is_named(action, said, tmp_path):
    """Before: 'the engines' mpiexec exited during start-up: the kernel's warm process does not answer at ...'."""
    seen = _start(AT_FORK.format(action=action), tmp_path)
    assert seen["said"].startswith(f"DistError: {said}"), seen
    assert seen["took"] < 8, seen


def test_an_exception_in_its_start_up_is_said_in_the_line(tmp_path):
    """A module it imports first (setproctitle, which the kernel never imports) raising: before, the reason went
    to the kernel's stderr only, and the start said the warm process 'does not answer'."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "setproctitle.py").write_text("raise RuntimeError('broken setproctitle')\n")
    seen = _start(f"sys.path.insert(0, {str(shadow)!r})", tmp_path)
    assert seen["said"] == (f"DistError: {WARM} failed before it was ready (RuntimeError: broken setproctitle); "
                            "the ranks did not start (NBDIST_WARM=0 launches fresh ranks instead)"), seen


@pytest.mark.parametrize("action", ["time.sleep(3600)", "os.kill(os.getpid(), signal.SIGSTOP)"])
def test_a_warm_process_that_never_gets_ready_is_named_at_the_timeout(action, tmp_path):
    """Before: 'only 0 of 2 engines registered within 8 s (raise --timeout?); engine output:' (empty)."""
    seen = _start(AT_FORK.format(action=action), tmp_path, timeout=6)
    assert seen["said"] == (f"DistError: {WARM} was not ready within 6 s (still starting); the ranks did not start "
                            "(raise --timeout, or NBDIST_WARM=0 launches fresh ranks)"), seen
    assert seen["took"] < 6 + 7, seen


def test_a_socket_path_too_long_gives_fresh_ranks_and_leaves_no_folder(tmp_path):
    """Already so before (kept: it takes a second): the warm process's socket would not bind; nothing is forked."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    code = ("from nbdist.cluster.launching import warm\n"
            "try:\n    warm.start()\nexcept OSError as e:\n    print(e)\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TMPDIR": str(deep)})
    assert ran.stdout.strip() == "AF_UNIX path too long", ran.stdout + ran.stderr
    assert os.listdir(deep) == []

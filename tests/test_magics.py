"""The magics, driven through a real IPython kernel exactly as a notebook would."""
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from kernel_driver import KernelDriver
from processes import wait_until_gone

# What a user must never see unless they ask (NBDIST_DEBUG=1): the way through nbdist and ipyparallel.
INTERNALS = ("cluster/waiting/remote.py", "cluster/api.py", "magics.py", "cluster/launching/launch.py", "asyncresult.py", "threading.py", "ipyparallel")

ALL_REDUCE_CELL = """%%dist
import torch, torch.distributed as dist
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(t)
"""


def nbdist_lines(shown: str) -> list[str]:
    """The lines under a cell that are not a rank's own output: what nbdist itself says."""
    return [line for line in shown.splitlines() if line.strip() and not line.startswith(("[rank ", "[ranks "))]


def internals(shown: str) -> list[str]:
    return [line for line in shown.splitlines() if any(name in line for name in INTERNALS)]


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def wait_until_empty(folder: Path, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while files_under(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(files_under(folder)) + [str(p) for p in folder.glob("*")]


def private_kernel(tmp_path: Path) -> tuple[KernelDriver, Path, Path]:
    """A kernel with its own IPython directory (the user's profile) and its own place for nbdist's cluster files,
    so that what a cluster leaves behind is seen, whatever other kernels on the machine do."""
    ipython_dir, cluster_dir = tmp_path / "ipython", tmp_path / "clusters"
    driver = KernelDriver(env={"IPYTHONDIR": str(ipython_dir), "NBDIST_CLUSTER_DIR": str(cluster_dir)})
    assert not driver.execute("import nbdist").error  # the kernel has made its own profile files by now
    return driver, ipython_dir, cluster_dir


def with_cluster(kernel: KernelDriver) -> KernelDriver:
    """The kernel with nbdist's magics loaded and a 2-engine cluster started."""
    assert not kernel.execute("%load_ext nbdist").error
    result = kernel.execute("%dist_start -n 2")
    assert not result.error, result.error_text
    return kernel


@pytest.fixture(scope="module")
def started(kernel):
    return with_cluster(kernel)


def test_dist_before_start_is_a_usage_error(kernel):
    kernel.execute("%load_ext nbdist")
    result = kernel.execute("%%dist\nprint(1)")
    assert result.error is None or result.error["ename"] == "UsageError"
    assert "UsageError: no cluster is running" in result.stderr + result.error_text
    assert "Traceback" not in result.stderr + result.error_text


def test_start_prints_status_and_time(kernel):
    kernel.execute("%load_ext nbdist")
    result = kernel.execute("%dist_start -n 2")
    text = result.displays[0]["text/plain"]
    assert "rank" in text and "mpi4py" in text and "engines ready" in text


def test_all_reduce_output_labelled_by_rank(started):
    result = started.execute(ALL_REDUCE_CELL)
    assert result.error is None
    assert result.stdout == "[rank 0] tensor([3., 3.])\n"
    result = started.execute(ALL_REDUCE_CELL.replace("%%dist", "%%dist --output all"))
    assert "[rank 0] tensor([3., 3.])" in result.stdout and "[rank 1] tensor([3., 3.])" in result.stdout


def test_error_on_rank_1_then_next_cell_works(started):
    cell = "%%dist\nimport torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('bad one')"
    result = started.execute(cell)
    assert result.error["ename"] == "DistError"
    assert "rank 1 raised ValueError: bad one" in result.error["evalue"]
    assert "[rank 1]" in result.stderr and "ValueError: bad one" in result.stderr
    assert len(result.error["traceback"]) == 1  # one line, no traceback from nbdist's internals
    assert started.execute(ALL_REDUCE_CELL).stdout == "[rank 0] tensor([3., 3.])\n"


@pytest.mark.parametrize(
    "line, message",
    [
        ("%dist_start --bogus", "unrecognized arguments: --bogus"),
        ("%dist_start -n 0 --restart", "-n must be at least 1"),
        ("%dist_start -n 100000 --restart", "more engines than this machine can hold"),
        ("%dist_start --backend nccl --restart", "--backend nccl needs GPUs"),
        ("%%dist --ranks 9\nprint(1)", "ranks '9' are not in 0..1"),
        ("%%dist --output everyone\nprint(1)", "--output must be one of"),
    ],
)
def test_bad_input_is_one_usage_line(started, line, message):
    before = {p.pid for p in psutil.Process(started.pid).children(recursive=True)}
    result = started.execute(line)
    shown = result.stderr + result.error_text
    assert "UsageError" in shown and message in shown
    assert "Traceback" not in shown
    assert {p.pid for p in psutil.Process(started.pid).children(recursive=True)} == before  # nothing new left running
    assert started.execute(ALL_REDUCE_CELL).stdout == "[rank 0] tensor([3., 3.])\n"


def test_kernel_interrupt_stops_the_cell_on_all_ranks(started):
    result = started.execute("%%dist\nimport time\ntime.sleep(60)", timeout=30, interrupt_after=2)
    assert result.error["ename"] == "KeyboardInterrupt"
    assert result.seconds < 10
    shown = result.shown
    # where each rank was: the hang view's table (a display) and sentence, not the tracebacks of nbdist's interrupts
    (table,) = [d["text/plain"] for d in result.displays if "rank  host  state" in d.get("text/plain", "")]
    assert re.search(r"\n0 +\S+ +runs +cell In\[\d+\]:2 in <module>", table), table
    assert "KeyboardInterrupt" not in shown.replace("KeyboardInterrupt: interrupted", ""), shown
    one_line = ("KeyboardInterrupt: interrupted: ranks 0, 1 run cell In[{}]:2 in <module>, outside any communication "
                "call; nbdist interrupted rank(s) 0, 1, which then stopped")
    cell = re.search(r"run cell In\[(\d+)\]", shown)
    assert cell is not None, shown
    one_line = one_line.format(cell.group(1))
    assert nbdist_lines(shown) == [one_line]
    assert internals(shown) == []
    assert started.execute(ALL_REDUCE_CELL).stdout == "[rank 0] tensor([3., 3.])\n"


def test_dist_why_shows_every_rank_and_the_last_hang(started):
    assert not started.execute(ALL_REDUCE_CELL).error
    now = started.execute("%dist_why")
    (table,) = [d["text/plain"] for d in now.displays]
    assert table.splitlines()[0].split() == ["rank", "host", "state", "last", "done"], table
    assert "no rank is running a cell: every engine waits for the next one" in table
    hung = started.execute("%%dist --timeout 2\nimport time, torch.distributed as dist\n"
                           "if dist.get_rank() == 1:\n    time.sleep(30)\ndist.barrier()")
    assert hung.error and "rank 1 never reached it" in hung.error["evalue"]
    last = started.execute("%dist_why --last --stacks")
    assert not last.error and "rank 0 waits in barrier #" in last.displays[0]["text/plain"]
    assert "rank 1, innermost last:" in last.stdout and "time.sleep(30)" in last.stdout
    bogus = started.execute("%dist_why --bogus")
    assert "UsageError" in bogus.stderr + bogus.error_text and "unrecognized arguments: --bogus" in bogus.stderr


def test_interrupt_is_still_a_keyboard_interrupt(started):
    """A training loop's `except KeyboardInterrupt` still catches the stop button while ranks work."""
    cell = (
        "import nbdist\ntry:\n    nbdist.current().execute('import time; time.sleep(60)')\n"
        "except KeyboardInterrupt:\n    print('caught')"
    )
    result = started.execute(cell, timeout=30, interrupt_after=2)
    assert result.error is None and "caught" in result.stdout


def test_interrupt_stops_run_all(started):
    cells = ["%%dist\nimport time\ntime.sleep(60)", "print('the next cell ran')"]
    assert started.run_all(cells, interrupt_after=2) == ["error", "aborted"]


TRAIN_STEP_CELL = """import nbdist
def train_step():
    import torch.distributed as dist
    return loss_of(dist.get_rank()) if dist.get_rank() == 1 else 0.0
nbdist.current().run(train_step)"""


def test_rank_error_in_cluster_run_shows_the_ranks_frames_and_one_line(started):
    """A function called through Cluster.run from a plain cell raises on rank 1, in a loss defined on the ranks."""
    assert not started.execute("%%dist\ndef loss_of(x):\n    raise ValueError(f'loss of {x} failed')").error
    result = started.execute(TRAIN_STEP_CELL)
    shown = result.shown
    assert result.error["ename"] == "DistError"
    assert "[rank 1] ----> 4     return loss_of(dist.get_rank()) if dist.get_rank() == 1 else 0.0" in shown
    assert "[rank 1] ----> 2     raise ValueError(f'loss of {x} failed')" in shown
    assert "[rank 1] ValueError: loss of 1 failed" in shown
    assert nbdist_lines(shown) == ["DistError: rank 1 raised ValueError: loss of 1 failed"]
    assert internals(shown) == []


PIPELINE_STEP_CELL = """import torch
from torch import nn
def exploding_loss(output, target):
    raise RuntimeError("loss exploded")
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
pipe = nbdist.pipeline(model, stages=2, schedule="1f1b", microbatches=2)
pipe.step(torch.randn(4, 4), torch.randn(4, 4), exploding_loss)"""


def test_loss_raising_in_a_pipeline_step_shows_the_loss_not_the_executor(started):
    """pipe.step() goes through Cluster.run_each and nbdist's executor on the ranks: only the user's loss shows."""
    shown = started.execute(PIPELINE_STEP_CELL).shown
    assert "[rank 1]" in shown and "in exploding_loss(output, target)" in shown
    assert "[rank 1] RuntimeError: loss exploded" in shown
    lines = nbdist_lines(shown)
    assert len(lines) == 1 and lines[0].startswith("DistError: rank 1 raised RuntimeError: loss exploded"), lines
    assert internals(shown) == [] and "pipeline_parallel" not in shown


def test_nbdist_debug_shows_the_full_traceback(started):
    assert not started.execute("%env NBDIST_DEBUG=1").error
    try:
        shown = started.execute(TRAIN_STEP_CELL).shown
    finally:
        started.execute("%env NBDIST_DEBUG=")
    assert "Traceback (most recent call last)" in "\n".join(nbdist_lines(shown))  # the kernel's own traceback
    for name in ("cluster/api.py", "cluster/waiting/remote.py"):
        assert name in "\n".join(nbdist_lines(shown))
    assert "[rank 1] File " in shown and "ipyparallel" in shown  # the ranks' frames through ipyparallel too


def test_status_and_stop(started):
    result = started.execute("%dist_status")
    assert "mpi4py" in result.displays[0]["text/plain"]
    procs = [p for p in psutil.Process(started.pid).children(recursive=True)]
    assert started.execute("%dist_stop").stdout.startswith("stopped 2 engines")
    assert wait_until_gone(procs, timeout=2) == []


def test_plain_start_shows_errors_as_one_line_and_stop_leaves_no_file(tmp_path):
    """`import nbdist; nbdist.start()` without %load_ext: errors are still one line; stopping leaves nothing in
    the user's IPython profile nor in nbdist's cluster folder."""
    driver, ipython_dir, cluster_dir = private_kernel(tmp_path)
    try:
        profile_files = files_under(ipython_dir)
        assert not driver.execute("cluster = nbdist.start(2)").error
        assert len(list(cluster_dir.iterdir())) == 1  # the running cluster's own profile directory
        result = driver.execute("cluster.run(lambda: 1 / 0, ranks=[1])")
        assert "[rank 1] ZeroDivisionError: division by zero" in result.shown
        assert nbdist_lines(result.shown) == ["DistError: rank 1 raised ZeroDivisionError: division by zero"]
        assert internals(result.shown) == []
        assert not driver.execute("nbdist.stop()").error
        assert files_under(ipython_dir) - profile_files == set()
        assert list(cluster_dir.iterdir()) == []
    finally:
        driver.shutdown()


def test_sigkill_of_the_kernel_leaves_no_process_and_no_file(tmp_path):
    driver, ipython_dir, cluster_dir = private_kernel(tmp_path)
    try:
        profile_files = files_under(ipython_dir)
        driver.execute("%load_ext nbdist")
        assert not driver.execute("%dist_start -n 2").error
        procs = psutil.Process(driver.pid).children(recursive=True)
        assert len(procs) >= 4
        assert files_under(cluster_dir)  # connection files and logs, in the cluster's own directory
        os.kill(driver.pid, signal.SIGKILL)
        assert wait_until_gone(procs, timeout=15) == []
        assert wait_until_empty(cluster_dir, timeout=5) == []  # removed by the lifeline
        assert files_under(ipython_dir) - profile_files == set()
    finally:
        driver.client.stop_channels()
        driver.manager.cleanup_resources()


def test_kernel_shutdown_leaves_no_process_and_no_file(tmp_path):
    driver, ipython_dir, cluster_dir = private_kernel(tmp_path)
    profile_files = files_under(ipython_dir)
    driver.execute("%load_ext nbdist")
    assert not driver.execute("%dist_start -n 2").error
    procs = psutil.Process(driver.pid).children(recursive=True)
    driver.shutdown()
    assert wait_until_gone(procs, timeout=15) == []
    assert wait_until_empty(cluster_dir, timeout=5) == []
    assert files_under(ipython_dir) - profile_files == set()

"""The magics, driven through a real IPython kernel exactly as a notebook would."""
import os
import signal

import psutil
import pytest

from kernel_driver import KernelDriver
from processes import wait_until_gone

ALL_REDUCE_CELL = """%%dist
import torch, torch.distributed as dist
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(t)
"""


@pytest.fixture(scope="module")
def started(kernel):
    assert not kernel.execute("%load_ext nbdist").error
    result = kernel.execute("%dist_start -n 2")
    assert not result.error, result.error_text
    return kernel


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
    assert "rank" in text and "gloo" in text and "engines ready" in text


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
    assert "interrupted rank(s) 0, 1" in result.error["evalue"] + result.error_text
    assert started.execute(ALL_REDUCE_CELL).stdout == "[rank 0] tensor([3., 3.])\n"


def test_status_and_stop(started):
    result = started.execute("%dist_status")
    assert "gloo" in result.displays[0]["text/plain"]
    procs = [p for p in psutil.Process(started.pid).children(recursive=True)]
    assert started.execute("%dist_stop").stdout.startswith("stopped 2 engines")
    assert wait_until_gone(procs, timeout=2) == []


def test_sigkill_of_the_kernel_leaves_no_process():
    driver = KernelDriver()
    try:
        driver.execute("%load_ext nbdist")
        assert not driver.execute("%dist_start -n 2").error
        procs = psutil.Process(driver.pid).children(recursive=True)
        assert len(procs) >= 4
        os.kill(driver.pid, signal.SIGKILL)
        assert wait_until_gone(procs, timeout=15) == []
    finally:
        driver.client.stop_channels()
        driver.manager.cleanup_resources()


def test_kernel_shutdown_leaves_no_process():
    driver = KernelDriver()
    driver.execute("%load_ext nbdist")
    assert not driver.execute("%dist_start -n 2").error
    procs = psutil.Process(driver.pid).children(recursive=True)
    driver.shutdown()
    assert wait_until_gone(procs, timeout=15) == []

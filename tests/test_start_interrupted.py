"""A start interrupted (the notebook's stop button while `%dist_start` runs) says so in one line and leaves nothing:
no process, no cluster directory, no MPICH file in /dev/shm; and the next start works.

The interrupt is a real SIGINT to this process, sent at fractions of a real start's duration (measured first on
this machine): early (the warm process loading what ranks need, the controller starting), midway, and late (the
ranks joining MPI, the engines registering). A start that finishes before its interrupt arrives is stopped and the
case repeated earlier, so that every case interrupts a start.
"""
from __future__ import annotations

import glob
import os
import signal
import threading
import time

import psutil
import pytest
from processes import wait_until_gone

import nbdist
from nbdist.cluster.launching.files import profile_root
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistInterrupt

SAID = "interrupted during start-up; nbdist stopped what it had started"


def _start() -> nbdist.Cluster:
    return nbdist.Cluster(ClusterOptions(n=2, cpu=True)).start()


@pytest.fixture(scope="module")
def start_seconds() -> float:
    """How long an uninterrupted start takes here (the second of two: the first fills the page cache)."""
    for _ in range(2):
        started = time.monotonic()
        _start().stop()
        seconds = time.monotonic() - started
    return seconds


def _own_segments() -> set[str]:
    """This user's MPICH files in /dev/shm (another user's runs on the machine make and remove theirs meanwhile)."""
    own = set()
    for path in glob.glob("/dev/shm/mpich_*"):
        try:
            if os.stat(path).st_uid == os.getuid():
                own.add(path)
        except OSError:
            pass
    return own


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


def _interrupted_start(after: float) -> DistInterrupt | None:
    """Start, with SIGINT sent to this process `after` seconds in; the DistInterrupt raised, or None when the start
    finished first (its cluster is stopped)."""
    timer = threading.Timer(after, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    cluster = None
    try:
        try:
            cluster = _start()
        except DistInterrupt as interrupted:
            return interrupted
        finally:
            timer.cancel()
            timer.join()
        time.sleep(max(0.0, after))  # the interrupt may still be on its way: let it land here, not in the next case
    finally:  # also where it landed after the start had returned (a loaded machine): that cluster is stopped too
        if cluster is not None:
            cluster.stop()
    return None


@pytest.mark.parametrize("fraction", [0.1, 0.45, 0.8, 0.9])
def test_an_interrupted_start_says_so_and_leaves_nothing(start_seconds, fraction):
    children = {p.pid for p in _children()}
    segments = _own_segments()
    directories = set(glob.glob(os.path.join(profile_root(), "cluster-*")))
    after = fraction * start_seconds
    interrupted = None
    while interrupted is None and after > 0.02:
        try:
            interrupted = _interrupted_start(after)
        except KeyboardInterrupt:  # landed after the start had returned, in this test's own code: try again
            interrupted = None
        after *= 0.7
    assert interrupted is not None, "every start finished before its interrupt"
    assert str(interrupted) == SAID
    assert wait_until_gone([p for p in _children() if p.pid not in children], timeout=5) == []
    assert set(glob.glob(os.path.join(profile_root(), "cluster-*"))) <= directories
    assert _own_segments() <= segments


def test_a_start_after_an_interrupted_one_works(start_seconds):
    assert _interrupted_start(0.5 * start_seconds) is not None
    cluster = _start()
    try:
        assert cluster.run(lambda: __import__("torch.distributed").distributed.get_world_size()) == [2, 2]
    finally:
        cluster.stop()

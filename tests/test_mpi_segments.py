"""MPICH's shared-memory files that a killed start leaves in /dev/shm are removed, and only those
(nbdist/cluster/launching/mpi_segments.py): files of this user that no live process maps or holds open.

The files here are real files in /dev/shm under MPICH's prefix, mapped or held open by real processes; the last test
starts real launched ranks (not forked): the start removes its host's stale files before MPI starts, in the kernel
(ranks in the cluster's own user namespace cannot read the maps of processes outside it: they removed a mapped
file), and ranks on other hosts remove theirs. The removal after
a failed start is tested where it happens, on hosts: tests/test_hosts_ssh.py (an unreachable host).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

import nbdist
from nbdist.cluster.launching import mpi_segments
from nbdist.cluster.options import ClusterOptions

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")

HOLD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] == "map":
    held = mmap.mmap(fd, 4096)
    os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def made():
    """Make files under MPICH's prefix (a name of this test's own); remove what is left after the test."""
    paths = []

    def make() -> str:
        path = f"{mpi_segments.SEGMENT_PREFIX}test_{uuid.uuid4().hex[:12]}"
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        paths.append(path)
        return path

    yield make
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


@pytest.fixture
def holder():
    """A live process that maps a file ("map") or only holds it open ("open")."""
    procs = []

    def hold(path: str, how: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, path, how], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        procs.append(proc)
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_stale_file_nobody_maps_is_removed_and_fresh_mapped_or_open_ones_stay(made, holder):
    stale, mapped, opened = made(), made(), made()
    holder(mapped, "map")
    holder(opened, "open")
    time.sleep(0.3)
    fresh = made()
    removed = mpi_segments.remove_stale(unchanged_for=0.25)
    assert stale in removed and not os.path.exists(stale)
    assert all(os.path.exists(path) for path in (mapped, opened, fresh)), removed
    assert mapped in mpi_segments.held() and opened in mpi_segments.held()


def test_after_a_stop_only_files_made_since_the_launch_that_nobody_maps_go(made, holder):
    before = made()
    time.sleep(0.05)
    launched = time.time()
    left, still_mapped = made(), made()
    holder(still_mapped, "map")
    removed = mpi_segments.remove_left_since(launched)
    assert removed == [left] and not os.path.exists(left)
    assert os.path.exists(before) and os.path.exists(still_mapped)


def test_a_file_whose_mapper_died_is_no_longer_held(made, holder):
    path = made()
    proc = holder(path, "map")
    assert path in mpi_segments.mapped_by(proc.pid)
    proc.kill()
    proc.wait()
    assert path not in mpi_segments.held()


def test_a_start_removes_its_hosts_stale_files_before_mpi_starts(made, holder):
    stale, mapped = made(), made()
    holder(mapped, "map")
    old = time.time() - mpi_segments.STALE_SECONDS - 5
    for path in (stale, mapped):
        os.utime(path, (old, old))
    with nbdist.Cluster(ClusterOptions(n=2, cpu=True, fork=False)) as cluster:
        assert cluster.world_size == 2
    assert not os.path.exists(stale)
    assert os.path.exists(mapped)

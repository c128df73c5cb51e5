"""MPICH's shared-memory files in /dev/shm: each host's ranks remove theirs once mapped, and what a killed start left
is found and removed on the host where it lies.

Why: at MPI's start each host's ranks share a segment, `/dev/shm/mpich_shm_*` (1 MB and more), which MPICH removes
only at MPI_Finalize, which engines ended by a signal never reach. So the ranks remove its name as soon as all of
them have mapped it (cluster/launching/ranks/boot.py; the mappings stay valid). A rank killed before that (mpiexec ending
because another host could not be reached, a start interrupted or timed out) leaves the file on its host until the
host reboots, and each such start adds one. So:
- a stop removes the files made on the kernel's host since its cluster's engines were launched that no live process
  maps or holds open (a normal stop finds none);
- a start removes its host's files that no live process maps or holds open and that have not changed for
  STALE_SECONDS: the kernel, before it launches (cluster/launching/launch.py: a rank in the cluster's own user
  namespace cannot read the maps of processes outside it), and each rank on another host as it starts
  (cluster/launching/ranks/main.py: that is where a failed start's file goes at the next start there, the kernel
  cannot reach that host's files);
- a rank ending without MPI_Finalize removes the names of the files it maps (`unlink_mapped`).
Only this user's files: a running job's segment is mapped by its ranks, or already has no name.

Standard library only: it runs in a rank before torch and MPI are loaded.
"""
from __future__ import annotations

import glob
import os
import time

SEGMENT_PREFIX = "/dev/shm/mpich_"  # MPICH's names there: mpich_shm_<id>_<n>
STALE_SECONDS = 60.0  # unchanged this long and mapped by nobody: a start's segment is mapped within milliseconds


def segments(made_since: float | None = None, unchanged_for: float | None = None) -> list[str]:
    """This user's MPICH files on this host, made since `made_since` (time.time(); their status changed since) or
    not written for `unchanged_for` seconds, where given."""
    found = []
    now = time.time()
    for path in glob.glob(SEGMENT_PREFIX + "*"):
        try:
            info = os.stat(path)
        except OSError:
            continue
        if info.st_uid != os.getuid():
            continue
        if made_since is not None and info.st_ctime < made_since:
            continue
        if unchanged_for is not None and now - info.st_mtime < unchanged_for:
            continue
        found.append(path)
    return found


def held() -> set[str]:
    """The MPICH files some process of this host maps or holds open (as far as /proc lets this user see)."""
    paths: set[str] = set()
    for pid in (entry for entry in os.listdir("/proc") if entry.isdigit()):
        paths |= mapped_by(pid) | _open(pid)
    return paths


def mapped_by(pid: int | str) -> set[str]:
    """The MPICH files that process `pid` maps and that still have a name."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            lines = [line.rstrip("\n") for line in maps if " " + SEGMENT_PREFIX in line]
    except OSError:
        return set()
    paths = {line.split(maxsplit=5)[-1] for line in lines}
    return {path for path in paths if not path.endswith(" (deleted)")}


def unlink_mapped() -> None:
    """Remove the names of the MPICH files this process maps, as it ends without MPI_Finalize (its kernel gone, its
    stand-in killed): a communicator made after the rank's start (the groups renewed after a timed-out cell) has
    a file of its own that boot's removal did not see, and a culled JupyterHub server left 1 MB in /dev/shm per
    learner. The other ranks are ending with it (a job without this rank cannot go on)."""
    for path in mapped_by(os.getpid()):
        try:
            os.unlink(path)
        except OSError:
            pass


def _open(pid: str) -> set[str]:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    found = set()
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith(SEGMENT_PREFIX) and not target.endswith(" (deleted)"):
            found.add(target)
    return found


def remove_unheld(candidates: list[str]) -> list[str]:
    """Remove the candidates no process maps or holds open; the paths removed."""
    if not candidates:
        return []
    in_use = held()
    removed = []
    for path in candidates:
        if path in in_use:
            continue
        try:
            os.remove(path)
        except OSError:  # another rank of this host removed it first, or it is not ours to remove
            continue
        removed.append(path)
    return removed


def remove_left_since(started: float) -> list[str]:
    """After a cluster's stop: its host's segments made since `started` that nothing maps any longer."""
    return remove_unheld(segments(made_since=started))


def remove_stale(unchanged_for: float = STALE_SECONDS) -> list[str]:
    """At a rank's start: its host's files that nothing maps or holds open and that were not written for
    `unchanged_for` seconds."""
    return remove_unheld(segments(unchanged_for=unchanged_for))

"""Find the processes a cluster is made of, to prove that none outlives a stop or a dead kernel."""
from __future__ import annotations

import time

import psutil

MARKERS = ("ipyparallel.controller", "nbdist.cluster.launching.ranks.main", "nbdist.cluster.hosts.lifeline", "hydra_pmi_proxy", "mpiexec",
           "nbdist.cluster.launching.ranks.zygote", "warm_stub.py")


def cluster_processes(cluster_id: str | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes that belong to an nbdist cluster; all of them if cluster_id is None."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status", "environ"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.info["status"] == psutil.STATUS_ZOMBIE or not any(m in cmd for m in MARKERS):
                continue
            if cluster_id and cluster_id not in cmd and cluster_id not in str(proc.info.get("environ") or ""):
                continue
            found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_until_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Return the processes still alive (and not zombies) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    return alive


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

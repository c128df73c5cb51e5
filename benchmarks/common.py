"""What every benchmark script here shares: finding mpiexec, and knowing which processes a run started.

The scripts start real clusters on a shared machine. They must stop everything they started, say if anything of
theirs is left, and say if other runs' engines were alive meanwhile (they share the cores and skew the figures).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import psutil

PROCESS_PATTERNS = ("mpiexec", "hydra_pmi_proxy", "ipyparallel", "ipcontroller", "ipengine", "nbdist.engine")


def put_mpiexec_on_path() -> None:
    """The `mpich` wheel puts mpiexec beside the venv's python; plain ipyparallel looks for it on PATH."""
    here = os.path.dirname(sys.executable)
    if os.access(os.path.join(here, "mpiexec"), os.X_OK):
        os.environ["PATH"] = os.pathsep.join([here, os.environ.get("PATH", "")])


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile (0 < q < 1) of the samples, interpolated as statistics.quantiles does."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100)[max(0, round(q * 100) - 1)]


class ProcessWatch:
    """The cluster processes this run started (by ancestry, cluster id or lifeline pid), and everyone else's."""

    def __init__(self) -> None:
        self.cluster_ids: set[str] = set()
        self.foreign: dict[str, str] = {}  # other runs' processes seen -> when first seen

    def track(self, cluster) -> None:
        """Remember an nbdist cluster's ipyparallel cluster id (private attributes: best effort)."""
        cluster_id = getattr(getattr(getattr(cluster, "_launched", None), "cluster", None), "cluster_id", None)
        if cluster_id:
            self.cluster_ids.add(cluster_id)

    def ours(self, proc: psutil.Process) -> bool:
        try:
            env, cmdline = proc.environ(), proc.cmdline()
            parents = {p.pid for p in proc.parents()}
        except psutil.Error:
            return False
        return (
            os.getpid() in parents
            or env.get("IPP_CLUSTER_ID") in self.cluster_ids
            or env.get("NBDIST_KERNEL_PID") == str(os.getpid())
            or any(cid in arg for arg in cmdline for cid in self.cluster_ids)
        )

    def matching(self, ours: bool) -> list[str]:
        """'pid command' of every live cluster process that is (or is not) ours."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmdline = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if any(p in cmdline for p in PROCESS_PATTERNS) and self.ours(proc) == ours:
                found.append(f"{proc.pid} {cmdline[:120]}")
        return found

    def leftovers(self, grace: float = 3.0) -> list[str]:
        """Our processes still alive (zombies excluded) after up to `grace` seconds."""
        deadline = time.monotonic() + grace
        while True:
            left = self.matching(ours=True)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def note_foreign(self, when: str) -> None:
        """Remember other runs' engines and controllers alive now."""
        for line in self.matching(ours=False):
            self.foreign.setdefault(line, when)


class ClusterTracker(ProcessWatch):
    """The nbdist clusters this run started: stopped together at the end, then checked for leftovers."""

    def __init__(self) -> None:
        super().__init__()
        self.clusters: list = []

    def start(self, n: int):
        import nbdist

        cluster = nbdist.start(n, restart=True)
        self.clusters.append(cluster)
        self.track(cluster)
        return cluster

    def stop_all(self) -> None:
        import nbdist

        for cluster in self.clusters:
            try:
                cluster.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"warning: stopping a cluster failed: {e}", file=sys.stderr)
        nbdist.stop()

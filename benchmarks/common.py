"""What every benchmark script here shares: timing helpers, the rows of results and their report, and the run.

Every script asks one question and answers it with rows (`Measure`): nbdist's samples, the anchor's samples taken in
the same run (sides interleaved, `rotated`), the target, and whether the row decides the exit status. `Run` owns the
clusters a script starts: it stops them all at the end, checks that none of their processes is left (the library
finds a cluster's processes: `Cluster.processes()`), notes other runs' processes that shared the machine (they
skew the figures), prints the report, writes the JSON and says what the exit status is: 0 when every counted
target is met, the sanity checks held and no process was left.

What the benchmarks train (nbdist's own models) is in benchmarks/workloads.py; what runs on the engines, in
benchmarks/on_ranks.py (nbdist puts the script's folder on the engines' import path, so they import it).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

KINDS = ("ratio>=", "ratio<=", "diff<=", "abs<=", "abs>=")
LISTED = 12  # up to this many samples a spread lists them all; more are summarised
# What another run's processes carry in their command line: MPI's launcher and proxies, ipyparallel, nbdist's engines
OTHER_RUN_MARKS = ("mpiexec", "hydra_pmi_proxy", "ipyparallel", "ipcontroller", "ipengine", "nbdist.cluster")


@contextmanager
def bytecode_kept(prefix: str):
    """Processes started meanwhile keep compiled modules (.pyc) in a folder of this run, as an installation does,
    also where PYTHONDONTWRITEBYTECODE is set (this machine sets it): without, every fresh process compiles nbdist's
    modules from source again, which no user's start pays. A warm-up round fills the folder."""
    saved = {name: os.environ.get(name) for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = folder
        try:
            yield folder
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile (0 < q < 1) of the samples, interpolated as statistics.quantiles does."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100)[max(0, round(q * 100) - 1)]


def rotated(items: list, i: int) -> list:
    """`items` starting at position i: who goes first rotates from one repetition to the next."""
    i %= len(items)
    return items[i:] + items[:i]


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class Measure:
    """One row: nbdist's samples and the anchor's (may be empty), judged by `kind`:
    "ratio>=" / "ratio<=": median(nbdist) / median(anchor) against limit; "diff<=": |median(nbdist) -
    median(anchor)| <= limit (in unit); "abs<=" / "abs>=": median(nbdist) against limit (the anchor, if any,
    only shown)."""

    name: str
    unit: str
    nbdist_samples: list[float]
    anchor_samples: list[float]
    kind: str
    limit: float
    counts: bool = True  # decides the exit status; False: shown as "(info)"
    anchor_name: str = ""
    notes: dict = field(default_factory=dict)
    failed: str = ""  # set when nbdist could not be measured (e.g. it hung)
    repetitions: list[float] | None = None  # per-repetition ratio/diff; None: from the paired samples
    per: str = "repetition"  # what one pair of samples is (a repetition, a step, a block of calls)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def nbdist(self) -> float:
        return statistics.median(self.nbdist_samples) if self.nbdist_samples else float("nan")

    @property
    def anchor(self) -> float:
        return statistics.median(self.anchor_samples) if self.anchor_samples else float("nan")

    @property
    def compared(self) -> float:
        """What the target judges: the ratio, the difference, or nbdist's median."""
        if self.kind.startswith("ratio"):
            return self.nbdist / self.anchor
        return self.nbdist - self.anchor if self.kind == "diff<=" else self.nbdist

    @property
    def target(self) -> str:
        return {
            "ratio>=": f"ratio >= {self.limit:g}",
            "ratio<=": f"ratio <= {self.limit:g}",
            "diff<=": f"|diff| <= {self.limit:g} {'pp' if self.unit == '%' else self.unit}",
            "abs<=": f"<= {self.limit:g} {self.unit}",
            "abs>=": f">= {self.limit:g} {self.unit}",
        }[self.kind]

    @property
    def passed(self) -> bool:
        if self.failed or not self.nbdist_samples or math.isnan(self.compared):
            return False
        value = self.compared
        at_least = self.kind in ("ratio>=", "abs>=")
        return value >= self.limit if at_least else (abs(value) if self.kind == "diff<=" else value) <= self.limit

    @property
    def per_repetition(self) -> list[float]:
        if self.repetitions is not None:
            return self.repetitions
        pairs = list(zip(self.nbdist_samples, self.anchor_samples))
        if self.kind.startswith("abs") or len(self.nbdist_samples) != len(self.anchor_samples):
            return []
        return [a / b if self.kind.startswith("ratio") else a - b for a, b in pairs]

    def spread(self) -> str:
        """One line: each side's samples (listed, or summarised when many) and the per-repetition comparison."""
        if self.failed:
            return f"{self.name}: {self.failed}"
        parts = [f"{side} {_samples(xs, self.unit)}" for side, xs in
                 (("nbdist", self.nbdist_samples), (self.anchor_name or "anchor", self.anchor_samples)) if xs]
        reps = self.per_repetition
        if reps:
            word = "ratio" if self.kind.startswith("ratio") else "diff"
            listed = ", ".join(f"{r:.2f}" if word == "ratio" else f"{r:+.2f}" for r in reps)
            many = f"min {min(reps):.2f}, median {statistics.median(reps):.2f}, max {max(reps):.2f}"
            parts.append(f"per-{self.per} {word} " + (listed if len(reps) <= LISTED else many))
        return f"{self.name}: " + "; ".join(parts)

    def as_dict(self) -> dict:
        return {
            "name": self.name, "unit": self.unit, "nbdist_median": self.nbdist, "anchor": self.anchor_name,
            "anchor_median": self.anchor, "compared": self.compared, "target": self.target, "passed": self.passed,
            "counts": self.counts, "failed": self.failed, "per_repetition": self.per_repetition,
            "nbdist_samples": self.nbdist_samples, "anchor_samples": self.anchor_samples, **self.notes,
        }


def fmt(value: float, unit: str) -> str:
    """A value in its unit's usual precision."""
    if math.isnan(value):
        return "-"
    if unit == "samples/s":
        return f"{value:.0f}"
    if unit in ("ms", "pp", "us", "%"):
        return f"{value:.2f}"
    return f"{value:.3f}" if unit == "s" else f"{value:.4g}"


def _samples(xs: list[float], unit: str) -> str:
    if len(xs) <= LISTED:
        return ", ".join(fmt(x, unit) for x in xs) + f" {unit}"
    return (f"median {fmt(statistics.median(xs), unit)}, p90 {fmt(quantile(xs, 0.9), unit)}, "
            f"min {fmt(min(xs), unit)} {unit} over {len(xs)}")


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, a rule under the header."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def table(measures: list[Measure]) -> str:
    """The results: one row per measure, its medians, what the target judges, and the verdict."""
    rows = []
    for m in measures:
        if m.kind.startswith("abs") or not m.nbdist_samples:
            compared = "-"
        else:
            compared = f"{m.compared:.2f}" if m.kind.startswith("ratio") else f"{m.compared:+.2f}"
        result = ("HANG/FAIL" if m.failed else "PASS" if m.passed else "MISS") + ("" if m.counts else " (info)")
        rows.append([m.name, m.unit, fmt(m.nbdist, m.unit), fmt(m.anchor, m.unit), compared, m.target, result])
    return format_table(["measure", "unit", "nbdist", "anchor", "ratio/diff", "target", "result"], rows)


def environment(**extra) -> dict:
    """Versions and machine, and the script's own settings."""
    import ipyparallel
    import mpi4py
    import torch

    import nbdist

    return {"python": platform.python_version(), "torch": torch.__version__, "ipyparallel": ipyparallel.__version__,
            "mpi4py": mpi4py.__version__, "nbdist": nbdist.__version__, "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "machine": platform.platform(), **extra}


# -- the run -------------------------------------------------------------------------------------------------------


class Run:
    """One benchmark run: the clusters it starts (stopped together when the `with` block ends), the processes they
    had as the library lists them (`Cluster.processes()`), checked for leftovers at the end; other runs' processes
    seen meanwhile; its log and its report."""

    def __init__(self) -> None:
        self.clusters: list = []
        self.processes: dict[int, psutil.Process] = {}  # pid -> a process of a cluster this run started
        self.foreign: dict[str, str] = {}  # other runs' processes seen -> when first seen
        self.left: list[str] = []

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
        self.left = self.leftovers()
        if self.left:
            print("warning: processes left running:\n  " + "\n  ".join(self.left), file=sys.stderr)

    def track(self, processes: list[psutil.Process]) -> None:
        """Remember the processes of a cluster this run started, as the library finds them: `cluster.processes()`
        (for a plain ipyparallel cluster, `nbdist.cluster.launching.launch.processes(cluster)`). The end checks none is left."""
        self.processes.update((p.pid, p) for p in processes)

    def leftovers(self, grace: float = 3.0) -> list[str]:
        """'pid command' of the tracked processes still alive (zombies excluded) after up to `grace` seconds."""
        deadline = time.monotonic() + grace
        while True:
            left = [p for p in self.processes.values() if _alive(p)]
            if not left or time.monotonic() > deadline:
                return [_describe(p) for p in left]
            time.sleep(0.2)

    def log(self, text: str) -> None:
        """Print a progress line, and note other runs' processes alive now."""
        print(text, flush=True)
        for line in other_runs(set(self.processes)):
            self.foreign.setdefault(line, text.strip()[:60])

    def start(self, n: int, **options):
        """An nbdist cluster of n engines (any running one is replaced; `options` as nbdist.start takes them, e.g.
        backend="mpi"), stopped when the run ends."""
        import nbdist

        cluster = nbdist.start(n, restart=True, **options)
        self.clusters.append(cluster)
        self.track(cluster.processes())
        return cluster

    def stop_all(self) -> None:
        """Stop every nbdist cluster this run started, and the current one (a subclass adds what it starts besides
        nbdist clusters), noting their processes first."""
        import nbdist

        try:
            clusters = self.clusters + [nbdist.current()]
        except nbdist.DistUsageError:  # none running
            clusters = list(self.clusters)
        for cluster in clusters:
            try:
                self.track(cluster.processes())
                cluster.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"warning: stopping a cluster failed: {e}", file=sys.stderr)

    def finish(self, measures: list[Measure], details: str = "", sane: bool = True, json_path: str | None = None,
               settings: dict | None = None, extra: dict | None = None) -> int:
        """Print the table, the spreads, the script's own `details`, leftovers and other runs seen; write the JSON;
        return the exit status (0: every counted target met, `sane`, nothing left running)."""
        print()
        print(table(measures))
        print()
        print("\n".join(m.spread() for m in measures))
        if details:
            print()
            print(details)
        print("leftover processes: " + ("none" if not self.left else "\n  " + "\n  ".join(self.left)))
        if self.foreign:
            print(f"warning: {len(self.foreign)} process(es) of another nbdist/ipyparallel run shared the machine "
                  "during this run (figures skewed; rerun when it is quiet):")
            for line, when in list(self.foreign.items())[:8]:
                print(f"  {line[:100]}  (first seen at: {when})")
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"environment": environment(**(settings or {})), "measures": [m.as_dict() for m in measures],
                           "sanity_ok": sane, **(extra or {}), "leftover_processes": self.left,
                           "foreign_processes_seen": self.foreign}, f, indent=2, default=str)
            print(f"results written to {json_path}")
        counted = [m for m in measures if m.counts]
        return 0 if counted and all(m.passed for m in counted) and sane and not self.left else 1


def other_runs(ours: set[int]) -> list[str]:
    """'pid command' of the MPI, ipyparallel and nbdist processes on this machine that are not this run's (not
    among its clusters' processes, not descended from this process): another run sharing the cores, which the
    report warns about. Only for that warning: this run's own processes are the library's to find."""
    me, found = os.getpid(), []
    for proc in psutil.process_iter():
        try:
            if proc.pid == me or proc.pid in ours or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline())
            if not any(mark in cmdline for mark in OTHER_RUN_MARKS) or me in {p.pid for p in proc.parents()}:
                continue
        except psutil.Error:
            continue
        found.append(f"{proc.pid} {cmdline[:120]}")
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return str(proc.pid)

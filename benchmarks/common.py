"""What every benchmark script here shares: the model, the rows of results and their report, the run's processes.

Every script asks one question and answers it with rows (`Measure`): nbdist's samples, the anchor's samples taken in
the same run (sides interleaved), the target, and whether the row decides the exit status. `Run` owns the clusters
a script starts: it stops them all at the end, checks that nothing of theirs is left, notes other runs' engines that
shared the machine (they skew the figures), prints the report, writes the JSON and says what the exit status is:
0 when every counted target is met, the sanity checks held and no process was left.

What runs on the engines lives in benchmarks/on_ranks.py; `Run.start` puts this folder on the engines' sys.path so
they can import it (ipyparallel sends a function by reference to its module).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import cloudpickle
import psutil

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
PROCESS_PATTERNS = ("mpiexec", "hydra_pmi_proxy", "ipyparallel", "ipcontroller", "ipengine", "nbdist.engine")
KINDS = ("ratio>=", "ratio<=", "diff<=", "abs<=", "abs>=")
LISTED = 12  # up to this many samples a spread lists them all; more are summarised

# A model builder made here is sent to the engines (nbdist cloudpickles it); they cannot import this module, so
# cloudpickle must send its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def put_mpiexec_on_path() -> None:
    """The `mpich` wheel puts mpiexec beside the venv's python; plain ipyparallel looks for it on PATH."""
    here = os.path.dirname(sys.executable)
    if os.access(os.path.join(here, "mpiexec"), os.X_OK):
        os.environ["PATH"] = os.pathsep.join([here, os.environ.get("PATH", "")])


def parse_size(text: str) -> int:
    """"4K" -> 4096, "64M" -> 67108864, "512" -> 512 (binary prefixes, as the sizes S of nccl-tests)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile (0 < q < 1) of the samples, interpolated as statistics.quantiles does."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100)[max(0, round(q * 100) - 1)]


def rotated(items: list, i: int) -> list:
    """`items` starting at position i: who goes first rotates from one repetition to the next."""
    i %= len(items)
    return items[i:] + items[:i]


# -- the model ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mlp:
    """L x (Linear(w, w) + ReLU) and a batch: `WIDTHxLAYERS/BATCH` on the command line."""

    width: int
    layers: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> Mlp:
        shape, _, batch = text.partition("/")
        width, _, layers = shape.partition("x")
        return cls(int(width), int(layers), int(batch))

    @classmethod
    def parse_list(cls, text: str) -> list[Mlp]:
        return [cls.parse(s) for s in text.split(",") if s.strip()]

    def __str__(self) -> str:
        return f"{self.width}x{self.layers}/{self.batch}"

    @property
    def parameters(self) -> int:
        return self.layers * (self.width * self.width + self.width)

    def builder(self):
        """A function building the model with seed 0: every rank (and torch's side) builds the same one."""
        width, layers = self.width, self.layers

        def build_model():
            import torch
            from torch import nn

            torch.manual_seed(0)
            return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

        return build_model

    def batch_tensors(self):
        """Random inputs and targets of one batch (seed 1)."""
        import torch

        g = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.width, generator=g), torch.randn(self.batch, self.width, generator=g)


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


# -- processes ----------------------------------------------------------------------------------------------------


class Run:
    """One benchmark run: the clusters it starts (stopped together when the `with` block ends, then checked for
    leftovers: processes found by ancestry, cluster id or lifeline pid), other runs' processes seen meanwhile,
    its log and its report."""

    def __init__(self) -> None:
        self.clusters: list = []
        self.cluster_ids: set[str] = set()
        self.foreign: dict[str, str] = {}  # other runs' processes seen -> when first seen
        self.left: list[str] = []

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
        self.left = self.leftovers()
        if self.left:
            print("warning: processes left running:\n  " + "\n  ".join(self.left), file=sys.stderr)

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
        return (os.getpid() in parents or env.get("IPP_CLUSTER_ID") in self.cluster_ids
                or env.get("NBDIST_KERNEL_PID") == str(os.getpid())
                or any(cid in arg for arg in cmdline for cid in self.cluster_ids))

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

    def log(self, text: str) -> None:
        """Print a progress line, and note other runs' engines and controllers alive now."""
        print(text, flush=True)
        for line in self.matching(ours=False):
            self.foreign.setdefault(line, text.strip()[:60])

    def start(self, n: int, **options):
        """An nbdist cluster of n engines (any running one is replaced; `options` as nbdist.start takes them, e.g.
        backend="mpi") that can import benchmarks/on_ranks.py."""
        import nbdist

        cluster = nbdist.start(n, restart=True, **options)
        self.clusters.append(cluster)
        self.track(cluster)
        cluster.execute(f"import sys; sys.path.insert(0, {BENCH_DIR!r})", output="none")
        return cluster

    def stop_all(self) -> None:
        """Stop everything this run started (a subclass adds what it starts besides nbdist clusters)."""
        import nbdist

        for cluster in self.clusters:
            try:
                cluster.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"warning: stopping a cluster failed: {e}", file=sys.stderr)
        nbdist.stop()

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



def adam(params):
    """The optimizer every training benchmark uses (cloudpickled to the ranks)."""
    import torch

    return torch.optim.Adam(params, lr=1e-3)


def gpt_and_text(spec: str):
    """(model_fn, data_fn) for "layers,hidden,seq": the package's transformer (4 heads) and the byte corpus cut
    into windows of seq tokens, as functions the ranks call."""
    layers, hidden, seq = (int(v) for v in spec.split(","))

    def model_fn():
        from nbdist import models

        return models.gpt(seq=seq, layers=layers, hidden=hidden, heads=4, seed=0)

    def data_fn():
        from nbdist import data

        return data.text_dataset(seq=seq)

    return model_fn, data_fn

"""Scaling sweeps: how much faster training gets on more engines, against Amdahl's and Gustafson's laws.

    result = scaling.sweep(model_fn, data_fn, models.lm_loss, optimizer_fn, engines=(1, 2, 4),
                           batch_size=48,      # strong scaling: the same global batch on every engine count
                           per_rank=16)        # weak scaling: 16 samples per rank, batch = 16 n
    print(result)                              # samples/s, step time, speed-up, efficiency, fitted serial fraction
    result.figure()                            # measured speed-ups against the fitted laws, and where the time went

Amdahl (strong scaling, fixed work): if a fraction f of one engine's step cannot be split, n engines take
f + (1 - f)/n of its time, so S(n) = 1 / (f + (1 - f)/n), never more than 1/f. Gustafson (weak scaling, fixed work
per rank): if a fraction f of the n-engine step is serial, one engine would need f + (1 - f) n of it to do the same
work, so the scaled speed-up is S(n) = n - f (n - 1), which keeps growing with n. In both the speed-up is measured
the same way: samples per second on n engines over samples per second on one.

The sweep runs in the notebook kernel: for each engine count it (re)starts the cluster through nbdist.start (the
running cluster is kept where it already has that many engines, and is visited first), runs nbdist.Trainer
(data parallel over every engine) for warm-up steps, then measures `steps` more, and fits f by least squares.
The cluster left running afterwards is the last one visited (the sweep says which).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from nbdist.checks import is_whole, whole_number
from nbdist.errors import DistInterrupt, DistUsageError

LAWS = {"strong": "amdahl", "weak": "gustafson"}
GRID_POINTS = 4001  # the Amdahl fit scans this many candidate fractions before refining the best


# -- the laws and the fit (plain arithmetic) ------------------------------------------------------------------------


def amdahl(n: float, f: float) -> float:
    """Amdahl's speed-up on n engines when a fraction f of one engine's work is serial."""
    return 1.0 / (f + (1.0 - f) / n)


def gustafson(n: float, f: float) -> float:
    """Gustafson's scaled speed-up on n engines when a fraction f of the n-engine run's time is serial."""
    return n - f * (n - 1.0)


def karp_flatt(n: float, speedup: float) -> float:
    """The serial fraction that Amdahl's law needs to explain one measured speed-up (Karp and Flatt, 1990): if it
    grows with n, the loss is overhead that grows with n (communication, shared cores), not serial code."""
    return (1.0 / speedup - 1.0 / n) / (1.0 - 1.0 / n)


def fit_serial_fraction(engines: Sequence[float], speedups: Sequence[float], law: str = "amdahl") -> float:
    """The f that minimises the squared differences between the measured speed-ups and the law's (one engine
    says nothing about f: its speed-up is 1 under any f). Gustafson's law is linear in f, so the least-squares f
    is closed form; Amdahl's is not: its best f lies between the smallest and largest per-point fractions
    (karp_flatt), where a grid scan finds the best neighbourhood and bisection the zero of the error's slope.
    f is not clipped to [0, 1]: a negative f is a super-linear speed-up, an f above 1 a slowdown, and either says
    more than a clipped number would."""
    pairs = _informative(engines, speedups)
    if law == "gustafson":
        return sum((n - 1) * (n - s) for n, s in pairs) / sum((n - 1) ** 2 for n, _ in pairs)
    if law != "amdahl":
        raise DistUsageError(f"unknown law {law!r}: choose amdahl or gustafson")
    each = [karp_flatt(n, s) for n, s in pairs]
    lowest = -1.0 / (max(n for n, _ in pairs) - 1.0)  # below it the law's denominator reaches 0
    lo, hi = max(min(each), lowest * (1 - 1e-9)), max(each)
    if hi - lo <= 1e-15:
        return hi

    def error(f: float) -> float:
        return sum((s - amdahl(n, f)) ** 2 for n, s in pairs)

    def slope(f: float) -> float:  # d error / d f, over 2
        return sum((s - amdahl(n, f)) * (1 - 1 / n) * amdahl(n, f) ** 2 for n, s in pairs)

    step = (hi - lo) / (GRID_POINTS - 1)
    best = min(range(GRID_POINTS), key=lambda i: error(lo + i * step))
    return _zero_between(slope, lo + max(0, best - 1) * step, lo + min(GRID_POINTS - 1, best + 1) * step)


def _informative(engines: Sequence[float], speedups: Sequence[float]) -> list[tuple[float, float]]:
    if len(engines) != len(speedups):
        raise DistUsageError(f"{len(engines)} engine counts but {len(speedups)} speed-ups")
    for s in speedups:
        if not (isinstance(s, (int, float)) and s > 0 and math.isfinite(s)):
            raise DistUsageError(f"speed-ups must be positive numbers, got {s!r}")
    pairs = [(float(n), float(s)) for n, s in zip(engines, speedups) if n > 1]
    if not pairs:
        raise DistUsageError("fitting a serial fraction needs a speed-up measured on more than one engine")
    return pairs


def _zero_between(fn: Callable[[float], float], a: float, b: float) -> float:
    """Where the increasing `fn` crosses zero in [a, b] (bisection), or the end nearer to it."""
    if fn(a) >= 0:
        return a
    if fn(b) <= 0:
        return b
    while True:
        middle = (a + b) / 2
        if not a < middle < b:
            return middle
        if fn(middle) < 0:
            a = middle
        else:
            b = middle


# -- what was measured ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One engine count, one kind of scaling: the measured steps after warm-up.

    A step's period runs from its start (the earliest rank's) to the next step's start, so it includes what
    happens between steps (reading the batch); the typical step is the median period, which a neighbour's burst
    of work on a shared machine moves much less than it moves the mean."""

    engines: int
    batch_size: int  # the global batch of every step
    periods: tuple  # seconds, one per measured step
    split: dict  # the typical step (medians over steps of the mean over ranks): compute_s, comm_s, idle_s, between_s
    losses: tuple
    device: str  # "cpu" or "cuda"
    threads: int  # torch threads per engine during the measurement
    other_cores: float | None = None  # cores that other programs on this host kept busy meanwhile (see _OtherLoad)

    @property
    def steps(self) -> int:
        return len(self.periods)

    @property
    def step_seconds(self) -> float:
        return statistics.median(self.periods)

    @property
    def samples_per_second(self) -> float:
        return self.batch_size / self.step_seconds

    @classmethod
    def from_history(cls, rows: list[dict], engines: int, device: str, threads: int) -> Measurement:
        starts = [min(p["started"] for p in row["ranks"].values()) for row in rows]
        last_end = max(p["ended"] for p in rows[-1]["ranks"].values())
        periods = tuple(b - a for a, b in zip(starts, starts[1:] + [last_end]))
        split = {k: statistics.median(statistics.fmean(p[k] for p in row["ranks"].values()) for row in rows)
                 for k in ("compute_s", "comm_s", "idle_s")}
        split["between_s"] = max(0.0, statistics.median(periods) - sum(split.values()))
        return cls(engines=engines, batch_size=rows[0]["samples"], periods=periods, split=split,
                   losses=tuple(r["loss"] for r in rows), device=device, threads=threads)


@dataclass(frozen=True)
class Scaling:
    """One kind of scaling ("strong": fixed global batch; "weak": fixed batch per rank) over the engine counts."""

    kind: str
    measurements: tuple  # of Measurement, by engine count

    @property
    def law(self) -> str:
        return LAWS[self.kind]

    @property
    def engines(self) -> list[int]:
        return [m.engines for m in self.measurements]

    @cached_property
    def speedups(self) -> list[float]:
        """Samples/s on n engines over samples/s on one (for strong scaling: the step time's ratio too)."""
        base = self.measurements[0].samples_per_second
        return [m.samples_per_second / base for m in self.measurements]

    @property
    def efficiencies(self) -> list[float]:
        return [s / n for s, n in zip(self.speedups, self.engines)]

    @cached_property
    def serial_fraction(self) -> float:
        return fit_serial_fraction(self.engines, self.speedups, self.law)

    def predicted(self, n: float) -> float:
        """The fitted law's speed-up on n engines."""
        return (amdahl if self.law == "amdahl" else gustafson)(n, self.serial_fraction)

    def describe(self) -> str:
        m = self.measurements[0]
        if self.kind == "strong":
            return f"strong scaling: global batch {m.batch_size} on every engine count"
        return f"weak scaling: batch {m.batch_size // m.engines} per rank (global batch {m.batch_size // m.engines} × n)"

    def table(self, cores: int | None = None) -> str:
        f = self.serial_fraction
        header = (f"{'engines':>7} {'batch':>6} {'samples/s':>10} {'step s':>8} {'speed-up':>9} {'efficiency':>10} "
                  f"{'Karp-Flatt':>10} {self.law + ' fit':>13}")
        lines = [f"{self.describe()}, {self.measurements[0].steps} measured steps", header]
        for m, s, e in zip(self.measurements, self.speedups, self.efficiencies):
            kf = f"{karp_flatt(m.engines, s):10.3f}" if m.engines > 1 else f"{'-':>10}"
            shared = "  (engines share cores)" if _oversubscribed(m, cores) else ""
            lines.append(f"{m.engines:7d} {m.batch_size:6d} {m.samples_per_second:10.1f} {m.step_seconds:8.4f} "
                         f"{s:9.2f} {100 * e:9.0f}% {kf} {self.predicted(m.engines):13.2f}{shared}")
        others = [m.other_cores for m in self.measurements]
        if None not in others:
            lines.append("other programs on this host kept " + ", ".join(f"{c:.1f}" for c in others) +
                         f" core(s) busy while n = {', '.join(map(str, self.engines))} was measured")
        limit = f"; at most 1/f = {1 / f:.1f}x on any number of engines" if self.law == "amdahl" and f > 0 else ""
        lines.append(f"fitted serial fraction f = {f:.3f} ({self.law.capitalize()}, least squares on the speed-ups)"
                     f"{limit}")
        return "\n".join(lines)

    def panel(self) -> dict:
        """Plain data for nbdist.viz.scaling: the measurement, the fitted law's curve and the time split."""
        f, top = self.serial_fraction, 2 * max(self.engines)
        xs = [1 + i * (top - 1) / 100 for i in range(101)]
        name = "Amdahl" if self.law == "amdahl" else "Gustafson"
        hover = [f"{m.engines} engine(s), batch {m.batch_size}: {m.samples_per_second:.1f} samples/s, step "
                 f"{m.step_seconds * 1e3:.1f} ms; speed-up {s:.2f}, efficiency {100 * s / m.engines:.0f} %"
                 for m, s in zip(self.measurements, self.speedups)]
        return {"title": self.describe(), "engines": self.engines, "speedup": self.speedups, "hover": hover,
                "curve": {"engines": xs, "speedup": [self.predicted(x) for x in xs],
                          "name": f"{name}, fitted f = {f:.3f}"},
                "split": {k: [m.split[k] for m in self.measurements] for k in ("compute_s", "comm_s", "idle_s",
                                                                             "between_s")}}


def _oversubscribed(m: Measurement, cores: int | None) -> bool:
    return m.device == "cpu" and cores is not None and m.engines * m.threads > cores


@dataclass(frozen=True)
class Sweep:
    """What `sweep` returns: strong and / or weak scaling, measured on the same clusters."""

    strong: Scaling | None
    weak: Scaling | None
    cores: int  # CPU cores of the notebook's host (where CPU engines run)

    @property
    def kinds(self) -> list[Scaling]:
        return [s for s in (self.strong, self.weak) if s is not None]

    def table(self) -> str:
        note = (f"this host has {self.cores} CPU cores; CPU engines run {self.kinds[0].measurements[0].threads} "
                "torch thread(s) each")
        return "\n\n".join([s.table(self.cores) for s in self.kinds] + [note])

    def figure(self):
        from nbdist.viz.scaling import scaling_figure

        return scaling_figure([s.panel() for s in self.kinds], title="Measured speed-up against the fitted laws")

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__


# -- the sweep (real clusters) ----------------------------------------------------------------------------------------


def sweep(model_fn: Callable, data_fn: Callable, loss_fn: Callable, optimizer_fn: Callable,
          engines: Sequence[int] = (1, 2, 4), batch_size: int | None = None, per_rank: int | None = None,
          steps: int = 10, warmup: int = 3, threads: int | None = 1, seed: int = 0,
          cluster_options: dict | None = None, trainer_options: dict | None = None) -> Sweep:
    """Train on each engine count and measure (see the module docstring). `batch_size`: strong scaling with this
    global batch; `per_rank`: weak scaling with this batch per rank; give one or both (both are measured on the
    same cluster). `threads`: torch threads per engine while measuring (1: n engines use n cores, Amdahl's n
    processors; None keeps nbdist's default, which gives a lone engine every core). `cluster_options` go to
    nbdist.start, `trainer_options` to nbdist.Trainer (e.g. precision)."""
    counts = _check_engines(engines)
    batches = _check_batches(counts, batch_size, per_rank)
    options = _check_cluster_options(cluster_options or {})
    whole_number(steps, "steps")
    whole_number(warmup, "warmup", 0)
    if threads is not None:
        whole_number(threads, "threads")
    measured: dict[str, list[Measurement]] = {kind: [] for kind in batches}
    for n in _visit_order(counts, options):
        cluster = _cluster_with(n, options)
        for kind, batch in batches.items():
            measured[kind].append(_measure(cluster, n, batch(n), (model_fn, data_fn, loss_fn, optimizer_fn),
                                           steps, warmup, threads, seed, dict(trainer_options or {})))
        print(f"{n} engine(s): " + "; ".join(f"{kind} {m[-1].samples_per_second:.1f} samples/s (step "
                                              f"{m[-1].step_seconds * 1e3:.1f} ms)" for kind, m in measured.items()))
    print(f"the cluster left running has {cluster.world_size} engine(s)")
    done = {kind: Scaling(kind, tuple(sorted(ms, key=lambda m: m.engines))) for kind, ms in measured.items()}
    return Sweep(strong=done.get("strong"), weak=done.get("weak"), cores=os.cpu_count() or 1)


def _check_engines(engines: Sequence[int]) -> list[int]:
    counts = list(engines) if isinstance(engines, (list, tuple)) else None
    if not counts or not all(is_whole(n) and n >= 1 for n in counts) or len(set(counts)) != len(counts):
        raise DistUsageError(f"engines must be distinct whole numbers of engines, e.g. (1, 2, 4), got {engines!r}")
    if 1 not in counts or len(counts) < 2:
        raise DistUsageError(f"engines must include 1 (speed-ups are against one engine) and at least one more "
                             f"count, got {engines!r}")
    return sorted(counts)


def _check_batches(counts: list[int], batch_size: int | None, per_rank: int | None) -> dict[str, Callable]:
    if batch_size is None and per_rank is None:
        raise DistUsageError("give batch_size= (strong scaling: one global batch) and / or per_rank= (weak "
                             "scaling: a batch per rank)")
    batches: dict[str, Callable[[int], int]] = {}
    if batch_size is not None:
        whole_number(batch_size, "batch_size")
        uneven = [n for n in counts if batch_size % n]
        if uneven:
            raise DistUsageError(f"batch_size {batch_size} does not split evenly over {uneven[0]} engines: choose a "
                                 f"multiple of every engine count in {tuple(counts)}")
        batches["strong"] = lambda n: batch_size
    if per_rank is not None:
        whole_number(per_rank, "per_rank")
        batches["weak"] = lambda n: per_rank * n
    return batches


def _check_cluster_options(options: dict) -> dict:
    from nbdist.cluster.options import ClusterOptions

    unknown = sorted(set(options) - ClusterOptions.names())
    if unknown:
        raise DistUsageError(f"unknown cluster option(s) {', '.join(unknown)}: choose from "
                             f"{', '.join(sorted(ClusterOptions.names()))}")
    return {k: tuple(v) if k == "mpi_args" else v for k, v in options.items()}


def _visit_order(counts: list[int], options: dict) -> list[int]:
    """The running cluster's size first when it can be kept (one start fewer), then the others smallest first."""
    running = _running()
    if running is not None and running.world_size in counts and _same_options(running, running.world_size, options):
        return [running.world_size] + [n for n in counts if n != running.world_size]
    return counts


def _running():
    """The current cluster (nbdist.current()), or None when none runs."""
    from nbdist.cluster.api import current

    try:
        return current()
    except DistUsageError:
        return None


def _same_options(cluster, n: int, options: dict) -> bool:
    from nbdist.cluster.options import ClusterOptions

    return cluster.options == ClusterOptions(n=n, **options).resolved()


def _cluster_with(n: int, options: dict):
    """The current cluster if it has n engines and the options asked for, else a fresh one (nbdist.start)."""
    from nbdist.cluster.api import start

    running = _running()
    if running is not None and running.world_size == n and _same_options(running, n, options):
        return running
    return start(n, restart=True, **options)


def _measure(cluster, n: int, batch: int, functions: tuple, steps: int, warmup: int, threads: int | None,
             seed: int, trainer_options: dict) -> Measurement:
    """Warm-up steps, then `steps` measured ones, of a fresh data-parallel Trainer on `cluster`; the engines' torch
    threads as they were afterwards (also when it fails, without hiding the failure)."""
    import torch

    before = cluster.run(torch.get_num_threads)[0]
    trainer = None
    try:
        if threads is not None:
            cluster.run(torch.set_num_threads, threads)
        trainer = _trainer(cluster, functions, batch, seed, trainer_options)
        if warmup:
            trainer.fit(steps=warmup)
        with _OtherLoad(cluster) as others:
            trainer.fit(steps=steps)
        rows = trainer.history.records[warmup:]
        if len(rows) != steps:
            raise DistInterrupt(f"the sweep stopped: the run on {n} engine(s) ended after {len(rows)} of {steps} "
                                "measured steps")
        device = "cuda" if any(d.startswith("cuda") for d in cluster.devices) else "cpu"
        measurement = Measurement.from_history(rows, n, device, threads or before)
    except BaseException:
        with contextlib.suppress(Exception):
            _tidy(cluster, trainer, before)
        raise
    _tidy(cluster, trainer, before)
    return dataclasses.replace(measurement, other_cores=others.cores)


def _trainer(cluster, functions: tuple, batch: int, seed: int, options: dict):
    from nbdist.training.trainer import Trainer

    return Trainer(*functions, plan=None, batch_size=batch, seed=seed, live=False, cluster=cluster, **options)


def _tidy(cluster, trainer, threads: int) -> None:
    import torch

    if trainer is not None:
        trainer.close()
    cluster.run(torch.set_num_threads, threads)


class _OtherLoad:
    """How many of this host's cores programs other than this kernel and the cluster kept busy while measuring:
    a busy machine slows some engine counts more than others (n engines need n free cores), which no fit can
    tell apart from poor scaling. The host's busy CPU time (psutil) minus what our own processes used."""

    def __init__(self, cluster):
        import psutil

        self.ours = [psutil.Process()] + cluster.processes()
        self.cores: float | None = None

    def __enter__(self) -> _OtherLoad:
        self.started = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        (t0, busy0, own0), (t1, busy1, own1) = self.started, self._sample()
        self.cores = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0)) if t1 > t0 else None

    def _sample(self) -> tuple[float, float, float]:
        import psutil

        t = psutil.cpu_times()
        not_busy = t.idle + getattr(t, "iowait", 0.0) + getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        own = 0.0
        for process in self.ours:
            try:
                times = process.cpu_times()
                own += times.user + times.system
            except psutil.Error:
                pass
        return time.monotonic(), sum(t) - not_busy, own

#!/usr/bin/env python
"""nbdist's cluster life cycle and cell round trip, measured against plain ipyparallel in the same run.

What is measured (both sides in one process, one run, interleaved; medians):

1. start to ready: `nbdist.start(2)` (controller + 2 MPI engines, torch.distributed/gloo initialised on each,
   client connected) against plain `ipyparallel.Cluster(engines="mpi", n=2).start_and_connect_sync()` with its
   defaults (returns once both engines have registered). Both packages are imported before any timing; each side
   is timed from the call to a ready cluster/client. Target: nbdist / ipyparallel <= 0.4.
2. stop: nbdist's `Cluster.stop()` (returns when every process is gone) against ipyparallel's
   `stop_cluster_sync()` on the cluster of (1). Target: nbdist <= 1.5 s (ipyparallel is shown alongside).
3. round trip of a trivial cell (`a = 1`) inside an IPython InteractiveShell: `%%dist` against ipyparallel's
   `%%px` on the very same engines (nbdist's DirectView in rank order, blocking, activated as start_and_connect's
   `activate=True` does). Both go through `shell.run_cell_magic`, so the shell's own cost is the same on each side.
   After a warm-up, calls alternate in blocks (e.g. 20 `%%dist`, 20 `%%px`, ...). Target: %%dist / %%px <= 1.2.

Start/stop repetitions alternate which side goes first, after one untimed warm-up cycle of each (page cache,
imports); a short pause between cycles lets the machine settle. Every cluster is stopped in a `finally`, and the
run ends by checking that no process it started (mpiexec, hydra proxies, controllers, engines) is left.

Run (the machine's mpiexec must be on PATH, or beside this Python as with the `mpich` wheel):

    python benchmarks/bench_cluster.py [--repeats 3] [--calls 200] [--json results.json]

ipyparallel logs its own progress to stderr; the table goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable



from common import ProcessWatch, put_mpiexec_on_path, quantile  # noqa: E402 (benchmarks/ is on sys.path)

put_mpiexec_on_path()

import ipyparallel as ipp  # noqa: E402 - imported before any timing, after PATH is set

import nbdist  # noqa: E402

N_ENGINES = 2


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class Measure:
    """One row of the table: samples of both sides and the target they are judged by."""

    name: str
    unit: str
    nbdist_samples: list[float]
    anchor_samples: list[float]
    target_kind: str  # "ratio": nbdist/anchor <= limit; "absolute": nbdist <= limit (in `unit`)
    limit: float
    notes: dict = field(default_factory=dict)

    @property
    def nbdist(self) -> float:
        return statistics.median(self.nbdist_samples)

    @property
    def anchor(self) -> float:
        return statistics.median(self.anchor_samples)

    @property
    def ratio(self) -> float:
        return self.nbdist / self.anchor

    @property
    def target(self) -> str:
        return f"ratio <= {self.limit:g}" if self.target_kind == "ratio" else f"nbdist <= {self.limit:g} {self.unit}"

    @property
    def passed(self) -> bool:
        value = self.ratio if self.target_kind == "ratio" else self.nbdist
        return value <= self.limit

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "unit": self.unit,
            "nbdist_median": self.nbdist,
            "anchor_median": self.anchor,
            "ratio": self.ratio,
            "target": self.target,
            "passed": self.passed,
            "nbdist_samples": self.nbdist_samples,
            "anchor_samples": self.anchor_samples,
            **self.notes,
        }


# -- process bookkeeping ------------------------------------------------------------------------------------------


class Tracker(ProcessWatch):
    """Everything this run started (nbdist clusters and plain ipyparallel ones), to stop it all and check."""

    def __init__(self) -> None:
        super().__init__()
        self.plain: list[ipp.Cluster] = []

    def stop_all(self) -> None:
        nbdist.stop()
        for cluster in self.plain:
            try:
                cluster.stop_cluster_sync()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"warning: stopping plain ipyparallel cluster {cluster.cluster_id} failed: {e}", file=sys.stderr)
        self.plain.clear()


# -- 1 and 2: start and stop --------------------------------------------------------------------------------------


def nbdist_cycle(tracker: Tracker) -> dict[str, float]:
    """Start nbdist's cluster, then stop it; seconds for each, and nbdist's own startup_seconds."""
    started = time.perf_counter()
    cluster = nbdist.start(N_ENGINES)
    start_s = time.perf_counter() - started
    tracker.track(cluster)
    assert cluster.world_size == N_ENGINES
    boot = max(row.get("boot_seconds", float("nan")) for row in cluster.status().rows)  # untimed
    started = time.perf_counter()
    cluster.stop()
    stop_s = time.perf_counter() - started
    return {"start": start_s, "stop": stop_s, "own_startup": cluster.startup_seconds, "engine_boot": boot}


def plain_cycle(tracker: Tracker) -> dict[str, float]:
    """Start plain ipyparallel MPI engines with its defaults, then stop them; seconds for each."""
    cluster = ipp.Cluster(engines="mpi", n=N_ENGINES)
    tracker.plain.append(cluster)
    tracker.cluster_ids.add(cluster.cluster_id)
    started = time.perf_counter()
    client = cluster.start_and_connect_sync()
    start_s = time.perf_counter() - started
    assert len(client.ids) == N_ENGINES
    client.close()
    started = time.perf_counter()
    cluster.stop_cluster_sync()
    stop_s = time.perf_counter() - started
    tracker.plain.remove(cluster)
    return {"start": start_s, "stop": stop_s}


def measure_life_cycle(tracker: Tracker, repeats: int, warmup: int, settle: float) -> list[Measure]:
    """Alternate nbdist and plain cycles (alternating who goes first); the warm-up cycles are not recorded."""
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    for i in range(warmup + repeats):
        pair: list[tuple[Callable, list]] = [(nbdist_cycle, ours), (plain_cycle, theirs)]
        for cycle, samples in pair if i % 2 == 0 else reversed(pair):
            result = cycle(tracker)
            if i >= warmup:
                samples.append(result)
            time.sleep(settle)
        _progress(i, warmup, ours, theirs)
    notes = {"nbdist_own_startup_seconds": [r["own_startup"] for r in ours],
             "nbdist_engine_boot_seconds": [r["engine_boot"] for r in ours]}
    start = Measure("start to ready", "s", [r["start"] for r in ours], [r["start"] for r in theirs], "ratio", 0.4,
                    notes)
    stop = Measure("stop", "s", [r["stop"] for r in ours], [r["stop"] for r in theirs], "absolute", 1.5)
    return [start, stop]


def _progress(i: int, warmup: int, ours: list[dict], theirs: list[dict]) -> None:
    if i < warmup:
        print(f"  warm-up cycle {i + 1}/{warmup} done", flush=True)
        return
    a, b = ours[-1], theirs[-1]
    print(f"  repetition {i - warmup + 1}: start nbdist {a['start']:.2f} s, ipyparallel {b['start']:.2f} s; "
          f"stop nbdist {a['stop']:.3f} s, ipyparallel {b['stop']:.2f} s", flush=True)


# -- 3: %%dist against %%px ---------------------------------------------------------------------------------------


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


def _timed_calls(call: Callable[[], object], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


CELL = "a = 1"


def _interleaved(sides: dict[str, Callable[[], object]], calls: int, block: int) -> tuple[dict, list[float]]:
    """Alternate blocks of `block` calls of each side (who goes first alternates too); seconds per call per side,
    and each block's ratio of the first side's median to the second's."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    ratios: list[float] = []
    names = list(sides)
    for i in range(max(1, calls // block)):
        medians = {}
        for name in names if i % 2 == 0 else names[::-1]:
            got = _timed_calls(sides[name], block)
            samples[name] += got
            medians[name] = statistics.median(got)
        ratios.append(medians[names[0]] / medians[names[1]])
    return samples, ratios


def measure_round_trip(tracker: Tracker, calls: int, block: int, warmup: int) -> Measure:
    """%%dist vs %%px of CELL on the same engines, both through run_cell_magic; milliseconds per call."""
    shell = _shell()
    cluster = nbdist.start(N_ENGINES)
    tracker.track(cluster)
    try:
        view = cluster._view(list(range(cluster.world_size)))
        view.block = True  # as ipyparallel's own start_and_connect(activate=True) does
        view.activate()
        sides = {
            "dist": lambda: shell.run_cell_magic("dist", "", CELL),
            "px": lambda: shell.run_cell_magic("px", "", CELL),
        }
        for call in sides.values():
            _timed_calls(call, warmup)
        samples, ratios = _interleaved(sides, calls, block)
        if view.pull("a") != [1] * cluster.world_size:
            raise RuntimeError(f"{CELL!r} did not run on every engine")
    finally:
        cluster.stop()
    ours, theirs = ([x * 1e3 for x in samples[side]] for side in ("dist", "px"))
    notes = {"calls_per_side": len(ours), "block": block, "block_ratios": ratios,
             "nbdist_p90": quantile(ours, 0.9), "anchor_p90": quantile(theirs, 0.9)}
    return Measure(f"'{CELL}' cell: %%dist vs %%px", "ms", ours, theirs, "ratio", 1.2, notes)




# -- report -------------------------------------------------------------------------------------------------------


def table(measures: list[Measure]) -> str:
    header = ["measure", "nbdist", "ipyparallel", "ratio", "target", "result"]
    rows = [[m.name + f" ({m.unit})", _fmt(m.nbdist, m.unit), _fmt(m.anchor, m.unit), f"{m.ratio:.2f}", m.target,
             "PASS" if m.passed else "MISS"] for m in measures]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: float, unit: str) -> str:
    return f"{value:.2f}" if unit == "ms" or value >= 1 else f"{value:.3f}"


def spreads(measures: list[Measure]) -> str:
    lines = []
    for m in measures:
        for side, xs in (("nbdist", m.nbdist_samples), ("ipyparallel", m.anchor_samples)):
            if m.unit == "s":
                lines.append(f"{m.name} {side}: " + ", ".join(f"{x:.3f}" for x in xs)
                             + f" s (spread {max(xs) - min(xs):.3f} s)")
            else:
                lines.append(f"{m.name} {side}: median {statistics.median(xs):.2f} ms, p90 {quantile(xs, 0.9):.2f} ms,"
                             f" min {min(xs):.2f} ms over {len(xs)} calls")
        if "nbdist_own_startup_seconds" in m.notes:
            own = m.notes["nbdist_own_startup_seconds"]
            lines.append("nbdist's own startup_seconds: " + ", ".join(f"{x:.3f}" for x in own) + " s")
            boot = m.notes["nbdist_engine_boot_seconds"]
            lines.append("  of which engine boot (mpi4py, import torch, process group; slowest rank): "
                         + ", ".join(f"{x:.3f}" for x in boot) + " s")
        if "block_ratios" in m.notes:
            r = m.notes["block_ratios"]
            spread = f"min {min(r):.2f}, median {statistics.median(r):.2f}, max {max(r):.2f}"
            lines.append(f"per-block ratio %%dist/%%px: {spread}")
    return "\n".join(lines)


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "ipyparallel": ipp.__version__,
        "nbdist": nbdist.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "engines": N_ENGINES,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed start/stop cycles per side (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed start/stop cycles per side first (default 1)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds of pause after each cycle (default 1)")
    p.add_argument("--calls", type=int, default=200, help="timed round trips per side (default 200)")
    p.add_argument("--block", type=int, default=20, help="round trips per side in one block (default 20)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.calls < 1 or args.block < 1:
        p.error("--repeats, --calls and --block must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tracker = Tracker()
    try:
        print(f"start/stop: {args.warmup} warm-up + {args.repeats} timed cycles per side, interleaved", flush=True)
        measures = measure_life_cycle(tracker, args.repeats, args.warmup, args.settle)
        print(f"round trips: {args.calls} per side in blocks of {args.block}, interleaved", flush=True)
        measures.append(measure_round_trip(tracker, args.calls, args.block, warmup=20))
    finally:
        tracker.stop_all()
        left = tracker.leftovers()
        if left:
            print("warning: processes left running:\n  " + "\n  ".join(left), file=sys.stderr)
    print()
    print(table(measures))
    print()
    print(spreads(measures))
    print("leftover processes: " + ("none" if not left else "\n  " + "\n  ".join(left)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "measures": [m.as_dict() for m in measures],
                       "leftover_processes": left}, f, indent=2)
        print(f"results written to {args.json}")
    return 0 if all(m.passed for m in measures) and not left else 1


if __name__ == "__main__":
    sys.exit(main())

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
import os
import statistics
import sys
import time
from typing import Callable

import ipyparallel as ipp  # imported before any timing
from common import Measure, Run

import nbdist
from nbdist.cluster.launching import launch
from nbdist.cluster.options import find_mpiexec

N_ENGINES = 2
CELL = "a = 1"


def put_mpiexec_on_path() -> None:
    """Plain ipyparallel runs `mpiexec` from PATH; give it the one nbdist uses (the `mpich` wheel puts it beside
    this Python, which need not be on PATH)."""
    found = find_mpiexec()
    if found:
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(found), os.environ.get("PATH", "")])


class ClusterRun(Run):
    """This run's clusters: nbdist's (timed here, so started directly) and plain ipyparallel ones, whose processes
    the library's `launch.processes` lists as it does an nbdist cluster's."""

    def __init__(self) -> None:
        super().__init__()
        self.plain: list[ipp.Cluster] = []

    def stop_all(self) -> None:
        for cluster in self.plain:
            try:
                self.track(launch.processes(cluster))
                cluster.stop_cluster_sync()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"warning: stopping plain ipyparallel cluster {cluster.cluster_id} failed: {e}", file=sys.stderr)
        self.plain.clear()
        super().stop_all()


# -- 1 and 2: start and stop --------------------------------------------------------------------------------------


def nbdist_cycle(run: ClusterRun) -> dict[str, float]:
    """Start nbdist's cluster, then stop it; seconds for each, and nbdist's own startup_seconds."""
    started = time.perf_counter()
    cluster = nbdist.start(N_ENGINES)
    start_s = time.perf_counter() - started
    run.track(cluster.processes())  # untimed, as what follows until the stop
    assert cluster.world_size == N_ENGINES
    boot = max(row.get("boot_seconds", float("nan")) for row in cluster.status().rows)  # untimed
    started = time.perf_counter()
    cluster.stop()
    stop_s = time.perf_counter() - started
    return {"start": start_s, "stop": stop_s, "own_startup": cluster.startup_seconds, "engine_boot": boot}


def plain_cycle(run: ClusterRun) -> dict[str, float]:
    """Start plain ipyparallel MPI engines with its defaults, then stop them; seconds for each."""
    cluster = ipp.Cluster(engines="mpi", n=N_ENGINES)
    run.plain.append(cluster)
    started = time.perf_counter()
    client = cluster.start_and_connect_sync()
    start_s = time.perf_counter() - started
    run.track(launch.processes(cluster))  # untimed
    assert len(client.ids) == N_ENGINES
    client.close()
    started = time.perf_counter()
    cluster.stop_cluster_sync()
    stop_s = time.perf_counter() - started
    run.plain.remove(cluster)
    return {"start": start_s, "stop": stop_s}


def measure_life_cycle(run: ClusterRun, repeats: int, warmup: int, settle: float) -> list[Measure]:
    """Alternate nbdist and plain cycles (alternating who goes first); the warm-up cycles are not recorded."""
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    for i in range(warmup + repeats):
        pair: list[tuple[Callable, list]] = [(nbdist_cycle, ours), (plain_cycle, theirs)]
        for cycle, samples in pair if i % 2 == 0 else reversed(pair):
            result = cycle(run)
            if i >= warmup:
                samples.append(result)
            time.sleep(settle)
        if i < warmup:
            run.log(f"  warm-up cycle {i + 1}/{warmup} done")
        else:
            a, b = ours[-1], theirs[-1]
            run.log(f"  repetition {i - warmup + 1}: start nbdist {a['start']:.2f} s, ipyparallel {b['start']:.2f} s;"
                    f" stop nbdist {a['stop']:.3f} s, ipyparallel {b['stop']:.2f} s")
    notes = {"nbdist_own_startup_seconds": [r["own_startup"] for r in ours],
             "nbdist_engine_boot_seconds": [r["engine_boot"] for r in ours]}
    start = Measure(f"start to ready, {N_ENGINES} engines", "s", [r["start"] for r in ours],
                    [r["start"] for r in theirs], "ratio<=", 0.4, anchor_name="ipyparallel", notes=notes)
    stop = Measure("stop", "s", [r["stop"] for r in ours], [r["stop"] for r in theirs], "abs<=", 1.5,
                   anchor_name="ipyparallel")
    return [start, stop]


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


def measure_round_trip(run: ClusterRun, calls: int, block: int, warmup: int) -> Measure:
    """%%dist vs %%px of CELL on the same engines, both through run_cell_magic; milliseconds per call."""
    shell = _shell()
    cluster = nbdist.start(N_ENGINES)
    run.track(cluster.processes())
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
    return Measure(f"'{CELL}' cell: %%dist vs %%px", "ms", ours, theirs, "ratio<=", 1.2, anchor_name="%%px",
                   repetitions=ratios, per=f"block ({block} calls)", notes={"block": block})


def details(measures: list[Measure]) -> str:
    notes = measures[0].notes
    return ("nbdist's own startup_seconds: " + ", ".join(f"{x:.3f}" for x in notes["nbdist_own_startup_seconds"])
            + " s\n  of which engine boot (mpi4py, import torch, process group; slowest rank): "
            + ", ".join(f"{x:.3f}" for x in notes["nbdist_engine_boot_seconds"]) + " s")


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
    put_mpiexec_on_path()
    with ClusterRun() as run:
        run.log(f"start/stop: {args.warmup} warm-up + {args.repeats} timed cycles per side, interleaved")
        measures = measure_life_cycle(run, args.repeats, args.warmup, args.settle)
        run.log(f"round trips: {args.calls} per side in blocks of {args.block}, interleaved")
        measures.append(measure_round_trip(run, args.calls, args.block, warmup=20))
    settings = {"engines": N_ENGINES, "repeats": args.repeats, "calls": args.calls, "block": args.block}
    return run.finish(measures, details(measures), True, args.json, settings)


if __name__ == "__main__":
    sys.exit(main())

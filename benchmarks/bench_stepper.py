#!/usr/bin/env python
"""How long does one `Stepper.next()` tick take beyond the tick's own compute (target: 50 ms at most)?

A person clicking Step waits for one round trip: the notebook asks every rank to run its next tick, each rank wakes
up, passes the pipeline's barrier, runs that tick's actions and reports its spans. What the person waits for beyond
the compute is nbdist's cost: wall time of the call minus the tick's compute on its slowest rank (per rank, the
compute spans of the actions that call ran, `Timeline.busy_time` of the spans the ranks report with that call's
index). Median over every tick of a few whole steps, after one untimed step.

Two MPI engines from `nbdist.start(2)`; the package's MLP `nbdist.models.mlp(w, L)` (L x Linear(w, w), a ReLU
between consecutive ones; until the benchmarks used nbdist.models they built their own L x (Linear(w, w) + ReLU): the
same Linear layers, plus a ReLU after the last, torch's default init) split by nbdist, m = 8 micro-batches, MSE loss;
schedules "gpipe" and "1f1b"; transport "mpi" (the CPU default: counted) and "torch" (gloo: shown). A tick
that does not return within --timeout seconds is interrupted (nbdist interrupts the ranks) and reported as
HANG/FAIL; the MPI transport runs last, because an interrupted tick can leave a message half-sent on the engines.

    python benchmarks/bench_stepper.py [--size 512x8/256] [--steppers 3] [--timeout 15]
"""
from __future__ import annotations

import _thread
import argparse
import statistics
import sys
import threading
import time

from common import Measure, Run, quantile
from torch import nn
from workloads import Mlp

import nbdist
from nbdist.schedules.simulate import Timeline

SCHEDULES = ("gpipe", "1f1b")
TRANSPORTS = ("torch", "mpi")  # the default ("mpi", what "auto" picks on CPU) last
DEFAULT_TRANSPORT = "mpi"
MICROBATCHES = 8
LOSS = nn.functional.mse_loss
TICK_MS = 50.0


class Hung(Exception):
    """A tick did not return in time."""


def timed_tick(stepper, timeout: float) -> float:
    """Wall seconds of one stepper.next(); interrupted (and Hung raised) after `timeout` seconds."""
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        _thread.interrupt_main()

    timer = threading.Timer(timeout, interrupt)
    timer.start()
    started = time.perf_counter()
    try:
        stepper.next()
    except BaseException as e:
        if not fired.is_set():
            raise
        raise Hung(f"tick {stepper.tick + 1} of {stepper.total_ticks} did not return within {timeout:g} s "
                   f"({type(e).__name__}: {str(e)[:160]})") from None
    finally:
        timer.cancel()
    return time.perf_counter() - started


def tick_compute(stepper, calls: int) -> list[float]:
    """Per call of the step: the compute of the slowest rank in it (seconds), from the spans the ranks reported."""
    per_rank = stepper.spans()
    return [max(Timeline.from_spans({r: [s for s in spans if s[4] == call]}).busy_time[r]
                for r, spans in per_rank.items()) for call in range(calls)]


def measure_one(pipe, x, y, steppers: int, timeout: float) -> tuple[dict, str]:
    """Walls, compute and overhead (seconds) of every tick of `steppers` whole steps (one more first, untimed)."""
    out: dict = {"wall": [], "compute": [], "overhead": []}
    for i in range(steppers + 1):
        stepper = pipe.stepper(x, y, LOSS)
        walls = []
        try:
            while not stepper.done:
                walls.append(timed_tick(stepper, timeout))
        except Hung as e:
            return out, str(e)
        if i:
            compute = tick_compute(stepper, len(walls))
            out["wall"] += walls
            out["compute"] += compute
            out["overhead"] += [w - c for w, c in zip(walls, compute)]
    return out, ""


def measure(cluster: nbdist.Cluster, size: Mlp, args, log) -> list[Measure]:
    x, y = size.batch_tensors()
    rows = []
    for transport in TRANSPORTS:
        hung = ""
        for schedule in SCHEDULES:
            name = f"{size} {schedule} Stepper.next() beyond compute, [{transport}]"
            counts = transport == DEFAULT_TRANSPORT
            if hung:
                rows.append(Measure(name, "ms", [], [], "abs<=", TICK_MS, counts=counts,
                                    failed="not run: an earlier stepper on this transport hung"))
                continue
            pipe = nbdist.pipeline(size.builder(), stages=2, schedule=schedule, microbatches=MICROBATCHES,
                                   cluster=cluster, transport=transport)
            pipe.step(x, y, LOSS)  # warm-up at full speed first
            got, hung = measure_one(pipe, x, y, args.steppers, args.timeout)
            log(f"  {schedule} [{transport}]: " + (hung or f"{len(got['overhead'])} ticks"))
            ms = {k: [1e3 * v for v in vs] for k, vs in got.items()}
            notes = {"tick_wall_ms_median": statistics.median(ms["wall"]) if ms["wall"] else None,
                     "tick_compute_ms_median": statistics.median(ms["compute"]) if ms["compute"] else None,
                     "tick_overhead_ms_p90": quantile(ms["overhead"], 0.9) if ms["overhead"] else None,
                     "ticks": len(ms["overhead"])}
            rows.append(Measure(name, "ms", ms["overhead"], [], "abs<=", TICK_MS, counts=counts, failed=hung,
                                notes=notes))
            if not hung:
                pipe.close()
    return rows


def details(measures: list[Measure]) -> str:
    lines = ["per tick (medians): wall, of which the slowest rank's compute:"]
    for m in measures:
        if m.nbdist_samples:
            n = m.notes
            lines.append(f"  {m.name}: wall {n['tick_wall_ms_median']:.2f} ms, compute "
                         f"{n['tick_compute_ms_median']:.2f} ms, overhead p90 {n['tick_overhead_ms_p90']:.2f} ms "
                         f"over {n['ticks']} ticks")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512x8/256", help="the MLP, WIDTHxLAYERS/BATCH (default 512x8/256)")
    p.add_argument("--steppers", type=int, default=3, help="timed whole steps per schedule and transport (default 3)")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds before a tick counts as hung (default 15)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    args.mlp = Mlp.parse(args.size)
    if args.steppers < 1 or args.timeout <= 0 or args.mlp.batch % MICROBATCHES:
        p.error(f"--steppers must be at least 1, --timeout positive, the batch split into {MICROBATCHES}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with Run() as run:
        run.log(f"2 engines: starting (stepper, {args.mlp})")
        measures = measure(run.start(2), args.mlp, args, run.log)
    settings = {"microbatches": MICROBATCHES, "steppers": args.steppers, "size": args.size}
    return run.finish(measures, details(measures), True, args.json, settings)


if __name__ == "__main__":
    sys.exit(main())

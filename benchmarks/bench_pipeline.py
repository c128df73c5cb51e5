#!/usr/bin/env python
"""nbdist's pipeline parallelism measured against torch.distributed.pipelining on the same engines, in one run.

What is measured (2 MPI engines from `nbdist.start(2)`, torch.distributed/gloo initialised by nbdist; the model is
an MLP of L x (Linear(w, w) + ReLU), every rank builds it with the same seed and keeps its slice `build()[a:b]`,
with nbdist's own split `pipe.ranges` used for torch too; m = 8 micro-batches; MSE loss; no optimizer, gradients
cleared before every step on both sides):

1. throughput (samples/s) of one training step (forward + backward of every micro-batch), "gpipe" and "1f1b":
   nbdist's `Pipeline` (transport "mpi", the CPU default, and "torch", i.e. gloo) against torch's `ScheduleGPipe` /
   `Schedule1F1B` over `PipelineStage(stage_module, rank, 2, device=cpu)`, measured two ways:
   (a) engine-side loops: one `cluster.run_each` call per side runs k steps back to back on every rank (nbdist:
       `nbdist.pipeline_parallel.executor.step` with the args `Pipeline._step_args` gives; torch: `schedule.step`),
       timed from a barrier to the last rank's end, after warm-up;
   (b) per-step calls from this process: `pipe.step(x, y, loss)` against `cluster.run_each(torch_step, ...)` with
       the same per-rank arguments (inputs to rank 0, targets to the last rank): the same round trip on each side.
   Sides alternate within each repetition (who goes first rotates). Target: nbdist / torch >= 1.0 (the rows of the
   default transport decide the exit status; transport "torch" rows are shown for comparison).
   Sanity: on the same batch, torch's loss and gradients equal nbdist's.
2. bubble fraction, p = 2 (and p = 4 on a 4-engine cluster, informative only: 4 engines on 2 cores): measured
   from nbdist's spans (`Timeline.bubble_fraction`) against `pipe.schedule.simulate(forward=F, backward=B)` where F
   and B are that step's mean measured forward/backward durations; median over steps. Two measured timelines:
   engine-side steps that start together (an MPI barrier before each), and `pipe.timeline` after `pipe.step()` from
   here (what a notebook user sees: the ranks start when ipyparallel's request reaches them). Target: within 5
   percentage points of the simulation. For diagnosis each step is also replayed through the schedule with every
   action's own measured compute time and nothing else (no message time, nothing between actions): measured minus
   replayed is what communication, MPI progress and Python cost; replayed minus simulated is stage imbalance and
   compute noise. torch's implied bubble (1 - nbdist's compute per rank / torch's step time) is shown alongside.
3. one `Stepper.next()` tick: wall time of the call minus the tick's own compute (per rank, the compute spans of
   the actions whose tick it is; the slowest rank), median over every tick of a few steps. Target <= 50 ms.
   Measured with the default transport (MPI) and with transport "torch"; a tick that does not return within
   --stepper-timeout seconds is interrupted and reported as a hang.
Also reported: one-way point-to-point latency of nbdist's two transports (ping-pong of one activation between
the engines, interleaved), the receive waits inside nbdist's steps, how long a message takes to reach a receiver
that is already waiting for it (receive end - send end, from the spans), and where each nbdist step's time goes.

Run (the mpich wheel's mpiexec beside this Python, or one on PATH):

    python benchmarks/bench_pipeline.py [--sizes 256x8/128,512x8/256] [--repeats 5] [--steps 10] [--json out.json]
    python benchmarks/bench_pipeline.py --no-p4          # skip the 4-engine bubble check

A run takes about 1-2 minutes on 2 cores. The exit status is 0 when every counted target is met, the sanity checks
hold and no process was left running. ipyparallel logs to stderr; the tables go to stdout.
"""

from __future__ import annotations

import _thread
import argparse
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field



from common import ClusterTracker, put_mpiexec_on_path, quantile  # noqa: E402 (benchmarks/ is on sys.path)

put_mpiexec_on_path()

import torch
from torch import nn

import nbdist
from nbdist.pipeline_parallel.api import portable
from nbdist.pipeline_parallel.stages import unsplit_key
from nbdist.schedules.simulate import Timeline, measured_durations, requirements, ticks

SCHEDULES = ("gpipe", "1f1b")
TRANSPORTS = ("mpi", "torch")  # nbdist's; "mpi" is what transport="auto" picks for CPU tensors
DEFAULT_TRANSPORT = "mpi"
MICROBATCHES = 8
LOSS = nn.functional.mse_loss
BUBBLE_PP = 5.0  # percentage points
TICK_MS = 50.0
P2P_TAGS = (32000, 32001)  # far from the pipeline's own tags


# -- the model --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    width: int
    layers: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> Size:
        shape, _, batch = text.partition("/")
        width, _, layers = shape.partition("x")
        return cls(int(width), int(layers), int(batch))

    def __str__(self) -> str:
        return f"{self.width}x{self.layers}/{self.batch}"

    def builder(self) -> Callable[[], nn.Sequential]:
        width, layers = self.width, self.layers

        def build_model() -> nn.Sequential:
            torch.manual_seed(0)
            return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

        return build_model

    def batch_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.width, generator=g), torch.randn(self.batch, self.width, generator=g)

    @property
    def message_kib(self) -> float:
        return self.batch // MICROBATCHES * self.width * 4 / 1024


# -- engine-side functions ---------------------------------------------------------------------------------------
# ipyparallel sends a function defined in __main__ as its code only (its globals on the engine are the engine's
# namespace), so each of these imports what it needs and shares state through a module it puts in sys.modules.
# Keep their imports inside them (a linter's "redefinition" fix would break them on the engines).


def _engine_torch_setup(
    key: str, build_bytes: bytes, ranges: list, schedule: str, microbatches: int, loss_bytes: bytes
) -> str:
    """Build this rank's torch PipelineStage and schedule, and a step function, under `key`."""
    import sys
    import types

    import cloudpickle
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    store = sys.modules.setdefault("_bench_pipeline_engine", types.ModuleType("_bench_pipeline_engine")).__dict__
    rank, p = dist.get_rank(), len(ranges)
    a, b = ranges[rank]
    module = torch.nn.Sequential(*list(cloudpickle.loads(build_bytes)())[a:b])
    stage = PipelineStage(module, rank, p, device=torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=microbatches, loss_fn=cloudpickle.loads(loss_bytes))

    def step(x, y):
        module.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x, return_outputs=False)
            return None
        if rank == p - 1:
            losses = []
            sched.step(target=y, losses=losses, return_outputs=False)
            return float(torch.stack(losses).mean())
        sched.step(return_outputs=False)
        return None

    store[key] = {"step": step, "module": module, "first_layer": a}
    return type(sched).__name__


def _engine_torch_step(key: str, x, y):
    import sys

    return sys.modules["_bench_pipeline_engine"].__dict__[key]["step"](x, y)


def _engine_torch_grads(key: str) -> dict:
    import sys

    entry = sys.modules["_bench_pipeline_engine"].__dict__[key]
    return {
        "first_layer": entry["first_layer"],
        "grads": {k: p.grad.detach().clone() for k, p in entry["module"].named_parameters()},
    }


def _engine_torch_loop(key: str, x, y, k: int) -> dict:
    import sys
    import time

    import torch.distributed as dist

    step = sys.modules["_bench_pipeline_engine"].__dict__[key]["step"]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(k):
        loss = step(x, y)
    return {"start": start, "end": time.perf_counter(), "loss": loss}


def _engine_nbdist_loop(args: tuple, k: int, barrier_each: bool) -> dict:
    """k full-speed nbdist steps (executor.step, as Pipeline.step runs it); with barrier_each an MPI barrier
    before every step, so that each step's ranks start together (for timelines)."""
    import time

    import torch.distributed as dist
    from mpi4py import MPI

    from nbdist.pipeline_parallel import executor

    comm = MPI.COMM_WORLD
    dist.barrier()
    spans, loss = [], None
    start = time.perf_counter()
    for _ in range(k):
        if barrier_each:
            comm.Barrier()
        result = executor.step(*args)
        spans.append(result["spans"])
        loss = result["loss"]
    return {"start": start, "end": time.perf_counter(), "loss": loss, "spans": spans}


def _engine_pingpong(transport: str, shape: tuple, count: int, tags: tuple) -> list:
    """Round trips of one tensor between ranks 0 and 1 through nbdist's transport; seconds, on rank 0."""
    import time

    import torch
    import torch.distributed as dist

    from nbdist.pipeline_parallel.transport import make_transport

    t = make_transport(transport, torch.device("cpu"))
    rank = dist.get_rank()
    buf = torch.ones(shape)
    dist.barrier()
    out = []
    for _ in range(count):
        started = time.perf_counter()
        if rank == 0:
            t.isend(buf, 1, tags[0]).wait()
            t.irecv(buf, 1, tags[1]).wait()
        elif rank == 1:
            t.irecv(buf, 0, tags[0]).wait()
            t.isend(buf, 0, tags[1]).wait()
        out.append(time.perf_counter() - started)
    return out if rank == 0 else []


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class Measure:
    """One row: samples of nbdist and of the anchor (may be empty), judged by `kind`:
    "ratio>=": nbdist/anchor >= limit; "diff<=": |nbdist - anchor| <= limit (in unit); "abs<=": nbdist <= limit."""

    name: str
    unit: str
    nbdist_samples: list[float]
    anchor_samples: list[float]
    kind: str
    limit: float
    counts: bool = True  # decides the exit status
    anchor_name: str = ""
    notes: dict = field(default_factory=dict)
    failed: str = ""  # set when nbdist could not be measured (e.g. it hung)

    @property
    def nbdist(self) -> float:
        return statistics.median(self.nbdist_samples) if self.nbdist_samples else float("nan")

    @property
    def anchor(self) -> float:
        return statistics.median(self.anchor_samples) if self.anchor_samples else float("nan")

    @property
    def compared(self) -> float:
        if self.kind == "ratio>=":
            return self.nbdist / self.anchor
        if self.kind == "diff<=":
            return self.nbdist - self.anchor
        return self.nbdist

    @property
    def target(self) -> str:
        return {
            "ratio>=": f"ratio >= {self.limit:g}",
            "diff<=": f"|diff| <= {self.limit:g} {self.unit}",
            "abs<=": f"<= {self.limit:g} {self.unit}",
        }[self.kind]

    @property
    def passed(self) -> bool:
        if self.failed or not self.nbdist_samples:
            return False
        value = self.compared
        return value >= self.limit if self.kind == "ratio>=" else abs(value) <= self.limit

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "unit": self.unit,
            "nbdist_median": self.nbdist,
            "anchor": self.anchor_name,
            "anchor_median": self.anchor,
            "compared": self.compared,
            "target": self.target,
            "passed": self.passed,
            "counts": self.counts,
            "failed": self.failed,
            "nbdist_samples": self.nbdist_samples,
            "anchor_samples": self.anchor_samples,
            **self.notes,
        }


# -- process bookkeeping ------------------------------------------------------------------------------------------


Tracker = ClusterTracker


# -- timelines ----------------------------------------------------------------------------------------------------


def step_timeline(per_rank_spans: dict) -> Timeline:
    return Timeline.from_spans(per_rank_spans)


def mean_compute(tl: Timeline) -> tuple[float, float, dict]:
    """Mean F and B span durations over all ranks, and per stage {stage: (F, B)} (seconds)."""
    per_kind: dict[str, list[float]] = {"F": [], "B": []}
    per_stage: dict[int, dict[str, list[float]]] = {}
    for row in tl.spans.values():
        for s in row:
            if s.action.kind in per_kind:
                per_kind[s.action.kind].append(s.busy)
                per_stage.setdefault(s.action.stage, {"F": [], "B": []})[s.action.kind].append(s.busy)
    stage_means = {st: (statistics.fmean(d["F"]), statistics.fmean(d["B"])) for st, d in sorted(per_stage.items())}
    return statistics.fmean(per_kind["F"]), statistics.fmean(per_kind["B"]), stage_means


def breakdown(tl: Timeline) -> dict:
    """Per rank, milliseconds: compute, waiting in receives, the rest (send/recv handling, Python between actions,
    idle before the rank's first action) within the step's makespan."""
    out = {}
    for rank, row in tl.spans.items():
        busy = sum(s.busy for s in row)
        wait = sum(s.wait for s in row)
        out[rank] = {"compute": busy * 1e3, "recv_wait": wait * 1e3, "other": (tl.makespan - busy - wait) * 1e3}
    return out


def recv_waits(tl: Timeline) -> list[float]:
    return [s.wait for row in tl.spans.values() for s in row if s.action.kind in ("RECV_F", "RECV_B")]


def delivery_delays(tl: Timeline) -> list[float]:
    """Per message whose receiver was already blocked in its receive when the send was posted: receive end - send
    end (seconds), i.e. how long the message really took inside a step (transfer, plus any wait for the sender to
    drive MPI's progress again: a large MPI message moves only while the sender is inside an MPI call)."""
    sent = {
        s.action.matching(): s.end for row in tl.spans.values() for s in row if s.action.kind in ("SEND_F", "SEND_B")
    }
    return [
        s.end - sent[s.action]
        for row in tl.spans.values()
        for s in row
        if s.action in sent and s.wait > 0 and s.start < sent[s.action]
    ]


def replayed_bubble(schedule, tl: Timeline) -> float:
    """The bubble (%) the schedule would have with exactly this step's measured compute durations, action by
    action, and nothing else (messages instantaneous, no time between actions): measured minus this is what
    communication, MPI progress and Python between actions cost; this minus the simulation is stage imbalance
    and noise in the compute itself."""
    duration = {s.action: s.busy for row in tl.spans.values() for s in row if s.action.is_compute}
    last = schedule.stages - 1
    clock = {rank: 0.0 for rank in schedule.program}
    finished: dict = {}
    for runnable in ticks(schedule):
        for rank, a in runnable:
            ready_at = max(
                (max(finished[x] for x in alternatives if x in finished) for alternatives in requirements(a, last)),
                default=0.0,
            )
            clock[rank] = finished[a] = max(clock[rank], ready_at) + duration.get(a, 0.0)
    makespan = max(clock.values())
    return 100 * (1 - sum(duration.values()) / (len(clock) * makespan)) if makespan else 0.0


def bubble_samples(pipe, timelines: list[Timeline], per_stage: bool) -> tuple[list[float], list[float], dict]:
    """Per step: measured bubble (%) and simulated bubble (%): with that step's mean F and B over all stages and
    no message time, or (per_stage) with each stage's own mean F and B and the measured message latency
    (`measured_durations`, what `Pipeline.ideal()` simulates)."""
    measured, simulated, stage_means = [], [], []
    for tl in timelines:
        f, b, stage_mean = mean_compute(tl)
        measured.append(100 * tl.bubble_fraction)
        if per_stage:
            durations = measured_durations(tl, pipe.schedule.stages, pipe.schedule.chunks)
        else:
            durations = {"forward": f, "backward": b}
        simulated.append(100 * pipe.schedule.simulate(**durations).bubble_fraction)
        stage_means.append(stage_mean)
    stages = sorted(stage_means[0])
    means = {
        st: {
            "F_ms": 1e3 * statistics.median(s[st][0] for s in stage_means),
            "B_ms": 1e3 * statistics.median(s[st][1] for s in stage_means),
        }
        for st in stages
    }
    return measured, simulated, means


# -- the measurements ---------------------------------------------------------------------------------------------


class Bench:
    """One cluster, one model size: nbdist pipelines (per schedule and transport) and torch schedules."""

    def __init__(self, cluster: nbdist.Cluster, size: Size, p: int, with_torch: bool):
        self.cluster, self.size, self.p = cluster, size, p
        self.x, self.y = size.batch_tensors()
        build = size.builder()
        self.pipes = {
            (s, t): nbdist.pipeline(
                build, stages=p, schedule=s, microbatches=MICROBATCHES, cluster=cluster, transport=t
            )
            for s in SCHEDULES
            for t in TRANSPORTS
        }
        self.ranges = self.pipes[(SCHEDULES[0], DEFAULT_TRANSPORT)].ranges
        self.torch_keys = {}
        if with_torch:
            for s in SCHEDULES:
                key = f"torch-{s}-{size}"
                self.cluster.run(
                    _engine_torch_setup, key, portable(build), self.ranges, s, MICROBATCHES, portable(LOSS)
                )
                self.torch_keys[s] = key

    # per-rank arguments: inputs to rank 0, targets to the last rank (as Pipeline._step_args does)
    def torch_args(self, key: str, *extra) -> dict:
        last = self.p - 1
        return {r: (key, self.x if r == 0 else None, self.y if r == last else None, *extra) for r in range(self.p)}

    def nbdist_args(self, pipe, *extra) -> dict:
        return {r: (args, *extra) for r, args in pipe._step_args(self.x, self.y, LOSS).items()}

    # -- engine-side loops

    def nbdist_loop(self, schedule: str, transport: str, k: int, barrier_each: bool = False) -> tuple[float, list]:
        pipe = self.pipes[(schedule, transport)]
        results = self.cluster.run_each(_engine_nbdist_loop, self.nbdist_args(pipe, k, barrier_each))
        elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
        timelines = [step_timeline({rank: results[rank]["spans"][i] for rank in range(self.p)}) for i in range(k)]
        return k * self.size.batch / elapsed, timelines

    def torch_loop(self, schedule: str, k: int) -> float:
        results = self.cluster.run_each(_engine_torch_loop, self.torch_args(self.torch_keys[schedule], k))
        elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
        return k * self.size.batch / elapsed

    # -- per-step calls from here

    def nbdist_calls(self, schedule: str, transport: str, k: int) -> tuple[float, list]:
        pipe, timelines = self.pipes[(schedule, transport)], []
        started = time.perf_counter()
        for _ in range(k):
            pipe.step(self.x, self.y, LOSS)
            timelines.append(pipe.timeline)
        return k * self.size.batch / (time.perf_counter() - started), timelines

    def torch_calls(self, schedule: str, k: int) -> float:
        args = self.torch_args(self.torch_keys[schedule])
        started = time.perf_counter()
        for _ in range(k):
            self.cluster.run_each(_engine_torch_step, args)
        return k * self.size.batch / (time.perf_counter() - started)

    # -- sanity: same loss and gradients on both sides

    def sanity(self, schedule: str) -> dict:
        key = self.torch_keys[schedule]
        torch_loss = next(v for v in self.cluster.run_each(_engine_torch_step, self.torch_args(key)) if v is not None)
        torch_grads = {}
        for part in self.cluster.run(_engine_torch_grads, key):
            torch_grads.update({unsplit_key(part["first_layer"], k): g for k, g in part["grads"].items()})
        out = {"torch_loss": torch_loss}
        for transport in TRANSPORTS:
            pipe = self.pipes[(schedule, transport)]
            loss = pipe.step(self.x, self.y, LOSS)
            grads = pipe.grads()
            same_keys = set(grads) == set(torch_grads)
            diff = max((grads[k] - torch_grads[k]).abs().max().item() for k in grads) if same_keys else float("inf")
            out[f"nbdist_{transport}_loss"] = loss
            out[f"nbdist_{transport}_max_grad_diff"] = diff
        out["ok"] = all(
            abs(out[f"nbdist_{t}_loss"] - torch_loss) <= 1e-5 * max(1.0, abs(torch_loss))
            and out[f"nbdist_{t}_max_grad_diff"] <= 1e-5
            for t in TRANSPORTS
        )
        return out


def rotated(items: list, i: int) -> list:
    i %= len(items)
    return items[i:] + items[:i]


def measure_throughput(bench: Bench, repeats: int, steps: int, warmup: int, log) -> tuple[list[Measure], dict, dict]:
    """Engine-side loops and per-step calls, sides alternating; returns the rows, the nbdist timelines and torch's
    median seconds per step in the engine loops (per schedule)."""
    size = bench.size
    sides = [("nbdist", t) for t in TRANSPORTS] + [("torch", None)]
    loop_samples: dict = {}
    call_samples: dict = {}
    timelines: dict = {}  # (schedule, transport, way) -> [Timeline]
    for schedule in SCHEDULES:  # warm-up: both ways, every side
        for who, transport in sides:
            if who == "nbdist":
                bench.nbdist_loop(schedule, transport, warmup)
                bench.nbdist_calls(schedule, transport, warmup)
            else:
                bench.torch_loop(schedule, warmup)
                bench.torch_calls(schedule, warmup)
    for rep in range(repeats):
        for j, schedule in enumerate(SCHEDULES):
            for who, transport in rotated(sides, rep + j):
                if who == "nbdist":
                    tput, tls = bench.nbdist_loop(schedule, transport, steps)
                    timelines.setdefault((schedule, transport, "loop"), []).extend(tls)
                else:
                    tput = bench.torch_loop(schedule, steps)
                loop_samples.setdefault((schedule, who, transport), []).append(tput)
            for who, transport in rotated(sides, rep + j + 1):
                if who == "nbdist":
                    tput, tls = bench.nbdist_calls(schedule, transport, steps)
                    timelines.setdefault((schedule, transport, "calls"), []).extend(tls)
                else:
                    tput = bench.torch_calls(schedule, steps)
                call_samples.setdefault((schedule, who, transport), []).append(tput)
        log(
            f"  {size}: repetition {rep + 1}/{repeats}: "
            + ", ".join(
                f"{s} loop nbdist/torch "
                f"{loop_samples[(s, 'nbdist', DEFAULT_TRANSPORT)][-1] / loop_samples[(s, 'torch', None)][-1]:.2f}"
                for s in SCHEDULES
            )
        )
    rows = []
    for way, samples in (("engine loop", loop_samples), ("per-step call", call_samples)):
        for schedule in SCHEDULES:
            for transport in TRANSPORTS:
                ours, theirs = samples[(schedule, "nbdist", transport)], samples[(schedule, "torch", None)]
                per_rep = [a / b for a, b in zip(ours, theirs)]
                rows.append(
                    Measure(
                        f"{size} {schedule} {way}, nbdist[{transport}]",
                        "samples/s",
                        ours,
                        theirs,
                        "ratio>=",
                        1.0,
                        counts=transport == DEFAULT_TRANSPORT,
                        anchor_name=f"torch {'ScheduleGPipe' if schedule == 'gpipe' else 'Schedule1F1B'}",
                        notes={"per_repetition_ratio": per_rep, "steps_per_sample": steps, "size": str(size)},
                    )
                )
    torch_step_s = {s: size.batch / statistics.median(loop_samples[(s, "torch", None)]) for s in SCHEDULES}
    return rows, timelines, torch_step_s


def measure_bubble(
    bench: Bench, timelines: dict, steps: int, counts: bool, label: str, torch_step_s: dict | None = None
) -> list[Measure]:
    """Measured vs simulated bubble (percent) from barrier-synchronised engine-side steps and from pipe.step().

    Each step is also replayed with its measured compute durations (see replayed_bubble). With torch's seconds per
    step (engine loops), also torch's implied bubble: 1 - nbdist's median compute per rank and step in its loops
    (interleaved with torch's) / torch's step time (torch's stages run the same modules, the same compute)."""
    rows = []
    for schedule in SCHEDULES:
        pipe = bench.pipes[(schedule, DEFAULT_TRANSPORT)]
        if (schedule, DEFAULT_TRANSPORT, "synced") not in timelines:
            bench.nbdist_loop(schedule, DEFAULT_TRANSPORT, 2, barrier_each=True)
            timelines[(schedule, DEFAULT_TRANSPORT, "synced")] = bench.nbdist_loop(
                schedule, DEFAULT_TRANSPORT, steps, barrier_each=True
            )[1]
        if (schedule, DEFAULT_TRANSPORT, "calls") not in timelines:
            bench.nbdist_calls(schedule, DEFAULT_TRANSPORT, 2)
            timelines[(schedule, DEFAULT_TRANSPORT, "calls")] = bench.nbdist_calls(schedule, DEFAULT_TRANSPORT, steps)[
                1
            ]
        ways = [
            (way, what, per_stage)
            for way, what in (("synced", "engine steps, barrier before each"), ("calls", "pipe.step() timeline"))
            for per_stage in (True, False)
        ]
        for way, what, per_stage in ways:
            tls = timelines[(schedule, DEFAULT_TRANSPORT, way)]
            measured, simulated, stage_means = bubble_samples(pipe, tls, per_stage)
            replayed = [replayed_bubble(pipe.schedule, t) for t in tls]
            torch_notes = {}
            loop_tls = timelines.get((schedule, DEFAULT_TRANSPORT, "loop"))
            if torch_step_s and loop_tls and way == "synced":  # compute measured interleaved with torch's loops
                compute_s = statistics.median(sum(t.busy_time.values()) / t.ranks for t in loop_tls)
                torch_notes = {
                    "torch_step_ms": 1e3 * torch_step_s[schedule],
                    "nbdist_compute_per_rank_ms": 1e3 * compute_s,
                    "torch_implied_bubble_pct": 100 * (1 - compute_s / torch_step_s[schedule]),
                }
            basis = "per-stage F, B + latency" if per_stage else "one mean F, B (info)"
            rows.append(
                Measure(
                    f"{label} {schedule} bubble, {what}, sim: {basis}",
                    "pp",
                    measured,
                    simulated,
                    "diff<=",
                    BUBBLE_PP,
                    counts=counts and per_stage,
                    anchor_name="Pipeline.ideal(): simulate(per-stage F, B, comm)"
                    if per_stage
                    else "schedule.simulate(mean F, mean B)",
                    notes={
                        "per_step_diff_pp": [a - b for a, b in zip(measured, simulated)],
                        "replayed_pct": replayed,
                        "stage_means_ms": stage_means,
                        "makespan_ms": [1e3 * t.makespan for t in tls],
                        "breakdown_ms_median_step": breakdown(sorted(tls, key=lambda t: t.makespan)[len(tls) // 2]),
                        **torch_notes,
                    },
                )
            )
    return rows


def _tick_overheads(pipe, walls: list[float]) -> tuple[list[float], list[float]]:
    """Per tick: wall - the slowest rank's compute in that tick (seconds), and that compute."""
    spans = {r["rank"]: r["spans"] for r in pipe.last_results}
    compute = [0.0] * len(walls)
    for rank, row in spans.items():
        per_tick = [0.0] * len(walls)
        ticks = pipe.ticks[rank]
        if len(ticks) != len(row):
            raise RuntimeError(f"rank {rank}: {len(row)} spans for {len(ticks)} actions")
        for tick, span in zip(ticks, Timeline.from_spans({rank: row}).spans[rank]):
            per_tick[tick] += span.busy
        compute = [max(a, b) for a, b in zip(compute, per_tick)]
    return [w - c for w, c in zip(walls, compute)], compute


def measure_stepper(bench: Bench, steppers: int, timeout: float, log) -> list[Measure]:
    """Stepper.next() round trips beyond compute, per schedule and transport; a hang is interrupted and reported.
    The default transport goes last: an interrupted step may leave a message half-sent on the engines."""
    rows = []
    for transport in sorted(TRANSPORTS, key=lambda t: t == DEFAULT_TRANSPORT):
        for schedule in SCHEDULES:
            pipe = bench.pipes[(schedule, transport)]
            overheads, walls_all, computes, failed = [], [], [], ""
            for i in range(steppers + 1):  # the first stepper is a warm-up
                stepper = pipe.stepper(bench.x, bench.y, LOSS)
                walls = []
                while not stepper.done:
                    fired = threading.Event()

                    def interrupt(fired: threading.Event = fired) -> None:
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
                        failed = (
                            f"tick {stepper.tick + 1} of {stepper.total_ticks} did not return within "
                            f"{timeout:g} s ({type(e).__name__}: {str(e)[:160]})"
                        )
                        break
                    finally:
                        timer.cancel()
                    walls.append(time.perf_counter() - started)
                if failed:
                    log(f"  stepper {schedule} [{transport}]: {failed}")
                    break
                if i:
                    over, comp = _tick_overheads(pipe, walls)
                    overheads += over
                    walls_all += walls
                    computes += comp
            rows.append(
                Measure(
                    f"{bench.size} {schedule} Stepper.next() beyond compute, [{transport}]",
                    "ms",
                    [1e3 * o for o in overheads],
                    [],
                    "abs<=",
                    TICK_MS,
                    counts=transport == DEFAULT_TRANSPORT,
                    anchor_name="-",
                    failed=failed,
                    notes={
                        "tick_wall_ms_median": 1e3 * statistics.median(walls_all) if walls_all else None,
                        "tick_compute_ms_median": 1e3 * statistics.median(computes) if computes else None,
                        "tick_overhead_ms_p90": quantile([1e3 * o for o in overheads], 0.9)
                        if len(overheads) > 2
                        else None,
                        "ticks": len(overheads),
                    },
                )
            )
            if failed:
                return rows + [
                    Measure(
                        f"{bench.size} {s} Stepper.next() beyond compute, [{transport}]",
                        "ms",
                        [],
                        [],
                        "abs<=",
                        TICK_MS,
                        counts=transport == DEFAULT_TRANSPORT,
                        anchor_name="-",
                        failed="not run: an earlier stepper on this transport hung",
                    )
                    for s in SCHEDULES[SCHEDULES.index(schedule) + 1 :]
                ]
    return rows


def measure_p2p(cluster: nbdist.Cluster, sizes: list[Size], count: int, repeats: int) -> dict:
    """One-way latency (RTT/2, microseconds) of nbdist's transports for one micro-batch's activation."""
    out = {}
    for size in sizes:
        shape = (size.batch // MICROBATCHES, size.width)
        samples: dict = {t: [] for t in TRANSPORTS}
        for t in TRANSPORTS:
            cluster.run(_engine_pingpong, t, shape, 20, P2P_TAGS)  # warm-up
        for rep in range(repeats):
            for t in rotated(list(TRANSPORTS), rep):
                samples[t] += [x / 2 * 1e6 for x in cluster.run(_engine_pingpong, t, shape, count, P2P_TAGS)[0]]
        out[str(size)] = {
            "message_kib": size.message_kib,
            **{
                t: {"median_us": statistics.median(v), "p10_us": quantile(v, 0.1), "p90_us": quantile(v, 0.9)}
                for t, v in samples.items()
            },
        }
    return out


def waits_summary(timelines: dict) -> dict:
    """Receive waits and per-step split of nbdist's engine-loop steps, per schedule and transport."""
    out = {}
    for (schedule, transport, way), tls in sorted(timelines.items()):
        if way != "loop":
            continue
        waits = [w * 1e3 for tl in tls for w in recv_waits(tl)]
        delays = [d * 1e3 for tl in tls for d in delivery_delays(tl)]
        makespans = [tl.makespan * 1e3 for tl in tls]
        median_tl = sorted(tls, key=lambda t: t.makespan)[len(tls) // 2]
        out[f"{schedule} [{transport}]"] = {
            "recv_wait_ms_median": statistics.median(waits),
            "recv_wait_ms_p90": quantile(waits, 0.9),
            "delivery_ms_median": statistics.median(delays) if delays else float("nan"),
            "delivery_ms_p90": quantile(delays, 0.9),
            "delivery_messages": len(delays),
            "makespan_ms_median": statistics.median(makespans),
            "bubble_pct_median": statistics.median(100 * t.bubble_fraction for t in tls),
            "median_step_breakdown_ms": breakdown(median_tl),
        }
    return out




# -- report -------------------------------------------------------------------------------------------------------


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.0f}" if unit == "samples/s" else f"{value:.2f}" if unit in ("ms", "pp") else f"{value:.4g}"


def table(measures: list[Measure]) -> str:
    header = ["measure", "unit", "nbdist", "anchor", "ratio/diff", "target", "result"]
    rows = []
    for m in measures:
        compared = (
            "-"
            if m.kind == "abs<=" or not m.nbdist_samples
            else (f"{m.compared:.2f}" if m.kind == "ratio>=" else f"{m.compared:+.2f}")
        )
        result = ("HANG/FAIL" if m.failed else "PASS" if m.passed else "MISS") + ("" if m.counts else " (info)")
        rows.append([m.name, m.unit, _fmt(m.nbdist, m.unit), _fmt(m.anchor, m.unit), compared, m.target, result])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def spreads(measures: list[Measure]) -> str:
    lines = []
    for m in measures:
        if m.failed:
            lines.append(f"{m.name}: {m.failed}")
            continue
        if not m.nbdist_samples:
            continue
        if m.unit == "samples/s":
            r = m.notes["per_repetition_ratio"]
            lines.append(
                f"{m.name}: nbdist {min(m.nbdist_samples):.0f}..{max(m.nbdist_samples):.0f}, torch "
                f"{min(m.anchor_samples):.0f}..{max(m.anchor_samples):.0f} samples/s; per-repetition ratio "
                + ", ".join(f"{x:.2f}" for x in r)
            )
        elif m.unit == "pp":
            d = m.notes["per_step_diff_pp"]
            stage = ", ".join(
                f"stage {s}: F {v['F_ms']:.2f} B {v['B_ms']:.2f} ms" for s, v in m.notes["stage_means_ms"].items()
            )
            bd = "; ".join(
                f"rank {r}: compute {v['compute']:.1f}, recv wait {v['recv_wait']:.1f}, other {v['other']:.1f}"
                for r, v in m.notes["breakdown_ms_median_step"].items()
            )
            lines.append(
                f"{m.name}: measured {min(m.nbdist_samples):.1f}..{max(m.nbdist_samples):.1f} %, "
                f"simulated {min(m.anchor_samples):.1f}..{max(m.anchor_samples):.1f} %, per-step diff "
                f"{min(d):+.1f}..{max(d):+.1f} pp; makespan median {statistics.median(m.notes['makespan_ms']):.1f} ms; "
                f"{stage}\n    replayed with each action's measured compute and nothing else: median "
                f"{statistics.median(m.notes['replayed_pct']):.1f} %\n    median step (ms): {bd}"
            )
            if "torch_step_ms" in m.notes:
                lines.append(
                    f"    torch's engine loops (interleaved with nbdist's): {m.notes['torch_step_ms']:.1f} ms per "
                    f"step; nbdist's compute per rank in its loops {m.notes['nbdist_compute_per_rank_ms']:.1f} ms,"
                    f" so torch's implied bubble is {m.notes['torch_implied_bubble_pct']:.1f} %"
                )
        elif m.unit == "ms":
            lines.append(
                f"{m.name}: overhead median {m.nbdist:.2f} ms, p90 {m.notes['tick_overhead_ms_p90']:.2f} ms "
                f"over {m.notes['ticks']} ticks; tick wall median {m.notes['tick_wall_ms_median']:.2f} ms, "
                f"compute median {m.notes['tick_compute_ms_median']:.2f} ms"
            )
    return "\n".join(lines)


def environment(args) -> dict:
    import ipyparallel
    import mpi4py

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ipyparallel": ipyparallel.__version__,
        "mpi4py": mpi4py.__version__,
        "nbdist": nbdist.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "microbatches": MICROBATCHES,
        "repeats": args.repeats,
        "steps": args.steps,
        "sizes": args.sizes,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes",
        default="256x8/128,512x8/256",
        help="model sizes WIDTHxLAYERS/BATCH, comma-separated; the last one is used for bubble and "
        "stepper (default 256x8/128,512x8/256)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per side (default 5)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed sample (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side and way first (default 3)")
    p.add_argument("--steppers", type=int, default=3, help="timed Stepper runs (whole steps) per schedule (default 3)")
    p.add_argument("--stepper-timeout", type=float, default=15.0, help="seconds before a tick counts as hung")
    p.add_argument("--no-p4", action="store_true", help="skip the 4-engine bubble check")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    args.size_list = [Size.parse(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeats < 1 or args.steps < 1 or not args.size_list:
        p.error("--repeats and --steps must be at least 1, and --sizes must name a size")
    for s in args.size_list:
        if s.batch % MICROBATCHES:
            p.error(f"batch {s.batch} does not split into {MICROBATCHES} micro-batches")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tracker = Tracker()
    measures: list[Measure] = []
    sanity: dict = {}
    extra: dict = {}
    left: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        tracker.note_foreign(text.strip()[:60])

    torch.set_num_threads(1)  # this process only cuts models on the meta device; leave the cores to the engines
    try:
        log("2 engines: starting")
        cluster = tracker.start(2)
        main_size = args.size_list[-1]
        main_bench = None
        all_timelines = {}
        for size in args.size_list:
            log(f"size {size} (one activation message {size.message_kib:g} KiB): setting up")
            bench = Bench(cluster, size, 2, with_torch=True)
            log(f"  layer ranges per stage: {bench.ranges}")
            sanity[str(size)] = {s: bench.sanity(s) for s in SCHEDULES}
            log(
                "  sanity: "
                + ", ".join(
                    f"{s}: torch loss {v['torch_loss']:.6f} nbdist[mpi] {v['nbdist_mpi_loss']:.6f} ok={v['ok']}"
                    for s, v in sanity[str(size)].items()
                )
            )
            rows, timelines, torch_step_s = measure_throughput(bench, args.repeats, args.steps, args.warmup, log)
            measures += rows
            all_timelines[str(size)] = timelines
            if size == main_size:
                main_bench, main_torch_step_s = bench, torch_step_s
        log(f"bubble, p=2, {main_size}")
        measures += measure_bubble(
            main_bench, all_timelines[str(main_size)], args.steps, True, "p=2", main_torch_step_s
        )
        log("point-to-point latency")
        extra["p2p_one_way_latency"] = measure_p2p(cluster, args.size_list, 200, 3)
        extra["nbdist_step_waits"] = {s: waits_summary(t) for s, t in all_timelines.items()}
        log(f"stepper, {main_size}")
        measures += measure_stepper(main_bench, args.steppers, args.stepper_timeout, log)
        cluster.stop()
        if not args.no_p4:
            log(f"4 engines on {os.cpu_count()} cores: bubble, p=4, {main_size}")
            cluster4 = tracker.start(4)
            bench4 = Bench(cluster4, main_size, 4, with_torch=False)
            measures += measure_bubble(bench4, {}, args.steps, False, "p=4")
            cluster4.stop()
    finally:
        tracker.stop_all()
        left = tracker.leftovers()
        if left:
            print("warning: processes left running:\n  " + "\n  ".join(left), file=sys.stderr)
    sane = all(v["ok"] for per_size in sanity.values() for v in per_size.values())
    print()
    print(table(measures))
    print()
    print(spreads(measures))
    print()
    print("sanity (same batch, same init): " + ("torch's loss and gradients equal nbdist's" if sane else "MISMATCH"))
    for size, per in sanity.items():
        for s, v in per.items():
            print(
                f"  {size} {s}: loss torch {v['torch_loss']:.7f}, nbdist[mpi] {v['nbdist_mpi_loss']:.7f}, "
                f"nbdist[torch] {v['nbdist_torch_loss']:.7f}; max |grad diff| mpi {v['nbdist_mpi_max_grad_diff']:.2e},"
                f" torch {v['nbdist_torch_max_grad_diff']:.2e}"
            )
    print("one-way latency of one activation (ping-pong / 2, nbdist's transports):")
    for size, v in extra.get("p2p_one_way_latency", {}).items():
        print(
            f"  {size} ({v['message_kib']:g} KiB): "
            + ", ".join(
                f"{t} median {v[t]['median_us']:.0f} us (p10 {v[t]['p10_us']:.0f}, p90 {v[t]['p90_us']:.0f})"
                for t in TRANSPORTS
            )
        )
    print("nbdist engine-loop steps (median step; ms):")
    for size, per in extra.get("nbdist_step_waits", {}).items():
        for key, v in per.items():
            bd = "; ".join(
                f"rank {r}: compute {x['compute']:.1f}, recv wait {x['recv_wait']:.1f}, other {x['other']:.1f}"
                for r, x in v["median_step_breakdown_ms"].items()
            )
            print(
                f"  {size} {key}: makespan {v['makespan_ms_median']:.1f}, bubble {v['bubble_pct_median']:.1f} %, "
                f"recv wait per message median {v['recv_wait_ms_median']:.2f} (p90 {v['recv_wait_ms_p90']:.2f}); "
                f"delivery to a waiting receiver median {v['delivery_ms_median']:.2f} (p90 {v['delivery_ms_p90']:.2f},"
                f" {v['delivery_messages']} messages)\n    {bd}"
            )
    print("leftover processes: " + ("none" if not left else "\n  " + "\n  ".join(left)))
    if tracker.foreign:
        print(
            f"warning: {len(tracker.foreign)} process(es) of another nbdist/ipyparallel run shared the machine "
            "during this run (figures skewed; rerun when it is quiet):"
        )
        for line, when in list(tracker.foreign.items())[:8]:
            print(f"  {line[:100]}  (first seen at: {when})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": environment(args),
                    "measures": [m.as_dict() for m in measures],
                    "sanity": sanity,
                    **extra,
                    "leftover_processes": left,
                    "foreign_processes_seen": tracker.foreign,
                },
                f,
                indent=2,
                default=str,
            )
        print(f"results written to {args.json}")
    counted = [m for m in measures if m.counts]
    return 0 if all(m.passed for m in counted) and sane and not left else 1


if __name__ == "__main__":
    sys.exit(main())

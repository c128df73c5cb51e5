#!/usr/bin/env python
"""From a fresh kernel to the first training step: nbdist against accelerate's notebook_launcher (issue 21).

Is a notebook's first data-parallel step (2 CPU processes, DDP) as soon with nbdist as with accelerate? Each side is
a notebook executed top to bottom in a fresh Jupyter kernel (nbclient), the same model, data, optimizer and global
batch on each (nbdist.models.mlp, nbdist.data.regression_dataset, Adam, `--batch` samples over 2 processes):

- nbdist: `import nbdist; nbdist.start(2, cpu=True)`, then `nbdist.Trainer(...)` and `fit(steps)` (its defaults: the
  dashboard is shown); a second Trainer in the same kernel is the second run.
- accelerate: `from accelerate import notebook_launcher; notebook_launcher(train_fn, args, num_processes=2)`, where
  train_fn builds the same model and data with `Accelerator(cpu=True)`, `prepare`s them and steps; a second launch
  in the same kernel is the second run.

Each run is timed in the kernel, from the start of its cell to the end of the first step on rank 0 (the ranks'
perf_counter is the kernel's clock: one host, CLOCK_MONOTONIC): nbdist's from the first step's record, accelerate's
from the time rank 0 writes to a file as its first step ends. The call's return (all steps done) is shown too.
Repetitions are interleaved, who goes first rotates, the first round is a warm-up (page cache), medians. The kernels
and their processes keep compiled modules (.pyc) in a folder of this run (PYTHONPYCACHEPREFIX), also where
PYTHONDONTWRITEBYTECODE is set, as an installation does: the warm-up round fills it.

Target: nbdist's first run / accelerate's <= 1.0 (counted); the second run's ratio is shown.

Also shown, to say where the first run's time goes: CPU seconds by process (nbdist's warm process, controller,
ranks, launcher and the kernel; accelerate's workers and kernel), as nbdist.start returns and after the first run.
nbdist loads torch._dynamo (which DDP and torch's optimizers import, ~1.1 s here) once, in the warm process, and
forks the ranks after it; accelerate's workers each load it, side by side, before they rendezvous.

    python benchmarks/bench_first_step.py [--repeats 3] [--steps 20] [--processes 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import nbformat
import psutil
from bench_cluster import ClusterRun, put_mpiexec_on_path
from common import Measure, bytecode_kept, rotated
from nbclient import NotebookClient

N = 2
SETTLE = 2.0  # seconds of quiet before each notebook: the previous side's processes take a moment to go

SETUP = """\
import json, os, resource, time
from functools import partial

import psutil
import torch
from nbdist import data, models


def own_cpu(who=resource.RUSAGE_SELF):
    used = resource.getrusage(who)
    return used.ru_utime + used.ru_stime


def cpu_by_role(processes):
    roles = {{}}
    for p in processes:
        try:
            line, used = " ".join(p.cmdline()), p.cpu_times()
        except psutil.Error:
            continue
        role = ("warm process" if "ranks.zygote" in line else "ranks" if "ranks.main" in line else
                "controller" if "cluster.controller" in line else "launcher")
        roles[role] = roles.get(role, 0.0) + used.user + used.system
    return roles


model_fn = partial(models.mlp, width={width}, layers={layers}, inputs={inputs}, outputs=1, seed=0)
data_fn = partial(data.regression_dataset, samples={samples}, inputs={inputs})
loss_fn = torch.nn.functional.mse_loss
optimizer_fn = partial(torch.optim.Adam, lr=1e-3)
BATCH, STEPS, OUT = {batch}, {steps}, {out!r}
results = {{"pids": [os.getpid()]}}
"""

NBDIST_RUN = """\
_t0, _cpu0 = time.perf_counter(), own_cpu()
{start}trainer = nbdist.Trainer(model_fn, data_fn, loss_fn, optimizer_fn, batch_size=BATCH)
_ready = time.perf_counter()
trainer.fit(steps=STEPS)
_end = time.perf_counter()
_first = trainer.history.records[0]["ranks"][0]
results[{name!r}] = {{"first_step": _first["ended"] - _t0, "returned": _end - _t0, "trainer_ready": _ready - _t0,
                     "first_step_started": _first["started"] - _t0, "loss": trainer.history.records[-1]["loss"],
                     "cpu": {{**cpu_by_role(cluster.processes()), "kernel": own_cpu() - _cpu0}}}}
"""
NBDIST_START = """\
import nbdist
cluster = nbdist.start({n}, cpu=True)
_started = time.perf_counter() - _t0
_cpu_started = {{**cpu_by_role(cluster.processes()), "kernel": own_cpu() - _cpu0}}
"""
NBDIST_END = """\
results["first"]["started"] = _started
results["first"]["cpu_started"] = _cpu_started
results["pids"] += [p.pid for p in cluster.processes()]
cluster.stop()
json.dump(results, open(OUT, "w"))
"""

ACCELERATE_TRAIN = """\
def train_fn(stamp, steps, batch):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = model_fn()
    optimizer = optimizer_fn(model.parameters())
    loader = torch.utils.data.DataLoader(data_fn(), batch_size=batch // accelerator.num_processes, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            loss.item()
            if done == 0 and accelerator.is_main_process:
                with open(stamp, "w") as f:
                    f.write(repr(time.perf_counter()))
            done += 1
            if done == steps:
                break
"""
ACCELERATE_RUN = """\
_t0, _cpu0, _workers0 = time.perf_counter(), own_cpu(), own_cpu(resource.RUSAGE_CHILDREN)
from accelerate import notebook_launcher
notebook_launcher(train_fn, (OUT + ".{name}", STEPS, BATCH), num_processes={n})
_end = time.perf_counter()
results[{name!r}] = {{"first_step": float(open(OUT + ".{name}").read()) - _t0, "returned": _end - _t0,
                     "cpu": {{"workers": own_cpu(resource.RUSAGE_CHILDREN) - _workers0, "kernel": own_cpu() - _cpu0}}}}
"""
ACCELERATE_END = "json.dump(results, open(OUT, 'w'))\n"


def notebook(side: str, settings: dict, out: str) -> nbformat.NotebookNode:
    """The side's notebook: set-up (untimed), the first run, the second run, its results written to `out`."""
    setup = SETUP.format(out=out, **{k: v for k, v in settings.items() if k != "processes"})
    n = settings["processes"]
    if side == "nbdist":
        cells = [setup, NBDIST_RUN.format(start=NBDIST_START.format(n=n), name="first"),
                 NBDIST_RUN.format(start="", name="second"), NBDIST_END]
    else:
        cells = [setup, ACCELERATE_TRAIN, ACCELERATE_RUN.format(n=n, name="first"),
                 ACCELERATE_RUN.format(n=n, name="second"), ACCELERATE_END]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    return nb


def execute(run: ClusterRun, side: str, settings: dict, folder: str, timeout: float) -> dict:
    """Run the side's notebook in a fresh kernel; its results (seconds from each run's cell start)."""
    out = os.path.join(folder, f"{side}-{time.monotonic_ns()}.json")
    NotebookClient(notebook(side, settings, out), timeout=timeout, kernel_name="python3").execute()
    with open(out) as f:
        results = json.load(f)
    run.track([p for p in map(_process, results.pop("pids")) if p is not None])
    return results


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def measure(run: ClusterRun, repeats: int, settings: dict, timeout: float) -> list[Measure]:
    samples: dict[str, list[dict]] = {"nbdist": [], "accelerate": []}
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as folder:
        for i in range(repeats + 1):  # the first round warms the page cache and the imports' files
            for side in rotated(list(samples), i):
                run.leftovers(grace=10)  # the previous side's processes gone (they would share the cores)
                time.sleep(SETTLE)
                result = execute(run, side, settings, folder, timeout)
                if i:
                    samples[side].append(result)
            if i:
                a, b = samples["nbdist"][-1], samples["accelerate"][-1]
                run.log(f"  repetition {i}: first step nbdist {a['first']['first_step']:.2f} s, accelerate "
                        f"{b['first']['first_step']:.2f} s; second run {a['second']['first_step']:.2f} s, "
                        f"{b['second']['first_step']:.2f} s")
            else:
                run.log("  warm-up round done")

    def rows(side: str, run_name: str, key: str = "first_step") -> list[float]:
        return [r[run_name][key] for r in samples[side]]

    ours = samples["nbdist"]
    notes = {f"nbdist_{k}": [r["first"][k] for r in ours]
             for k in ("started", "trainer_ready", "first_step_started")}
    notes["nbdist_second_trainer_ready"] = [r["second"]["trainer_ready"] for r in ours]
    notes["nbdist_loss"] = [r[name]["loss"] for r in ours for name in ("first", "second")]
    notes["cpu"] = {"nbdist, as nbdist.start returned": [r["first"]["cpu_started"] for r in ours],
                    f"nbdist, first run ({settings['steps']} steps)": [r["first"]["cpu"] for r in ours],
                    f"accelerate, first run ({settings['steps']} steps)": [r["first"]["cpu"] for r in
                                                                          samples["accelerate"]]}
    return [
        Measure("first run: cell start to first step done", "s", rows("nbdist", "first"),
                rows("accelerate", "first"), "ratio<=", 1.0, anchor_name="accelerate", notes=notes),
        Measure("second run (same kernel): to first step done", "s", rows("nbdist", "second"),
                rows("accelerate", "second"), "ratio<=", 1.0, counts=False, anchor_name="accelerate"),
        Measure(f"first run: cell start to return ({settings['steps']} steps)", "s",
                rows("nbdist", "first", "returned"), rows("accelerate", "first", "returned"), "ratio<=", 1.0,
                counts=False, anchor_name="accelerate"),
        Measure(f"second run: cell start to return ({settings['steps']} steps)", "s",
                rows("nbdist", "second", "returned"), rows("accelerate", "second", "returned"), "ratio<=", 1.0,
                counts=False, anchor_name="accelerate"),
    ]


def details(measures: list[Measure]) -> str:
    """Where nbdist's first run goes: start, the Trainer's set-up, the first step."""
    notes = measures[0].notes

    def listed(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs) + " s"

    set_up = [b - a for a, b in zip(notes["nbdist_started"], notes["nbdist_trainer_ready"])]
    return ("nbdist's first run, per repetition: nbdist.start returned at " + listed(notes["nbdist_started"])
            + "; Trainer set-up " + listed(set_up) + "; cell start to the first step's start "
            + listed(notes["nbdist_first_step_started"]) + "\nsecond Trainer's set-up: "
            + listed(notes["nbdist_second_trainer_ready"]) + "\n" + cpu_used(notes["cpu"]))


def cpu_used(by_phase: dict[str, list[dict]]) -> str:
    """CPU seconds by process role (medians over the repetitions): nbdist's warm process loads torch._dynamo once
    for every rank, and the ranks start only after it; accelerate's workers each load it, side by side."""
    lines = [f"CPU seconds by process (median over repetitions; {os.cpu_count()} cores here):"]
    for phase, rows in by_phase.items():
        roles = sorted({role for row in rows for role in row})
        parts = [f"{role} {statistics.median(row.get(role, 0.0) for row in rows):.2f}" for role in roles]
        total = statistics.median(sum(row.values()) for row in rows)
        lines.append(f"  {phase}: " + ", ".join(parts) + f"; total {total:.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--processes", type=int, default=N, help="engines / accelerate's processes (4 on 2 cores: "
                        "the laptop case)")
    parser.add_argument("--batch", type=int, default=64, help="the global batch (over the processes)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300, help="seconds a cell may take")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    put_mpiexec_on_path()
    try:
        import accelerate
    except ImportError:
        sys.exit("this benchmark needs accelerate: pip install -e '.[bench]' (or pip install accelerate)")
    settings = {"width": args.width, "layers": args.layers, "inputs": 32, "samples": 4096, "batch": args.batch,
                "steps": args.steps, "processes": args.processes}
    with ClusterRun() as run, bytecode_kept("bench-first-step-pyc-"):  # for the kernels and what they start
        measures = measure(run, args.repeats, settings, args.timeout)
    trained = all(math.isfinite(loss) for loss in measures[0].notes["nbdist_loss"])  # every Trainer trained
    return run.finish(measures, details(measures), sane=trained, json_path=args.json,
                      settings={"repeats": args.repeats, "accelerate": accelerate.__version__, **settings})


if __name__ == "__main__":
    sys.exit(main())

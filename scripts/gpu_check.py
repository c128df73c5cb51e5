#!/usr/bin/env python
"""GPU smoke check: nbdist's promises on one real GPU, checked in one run of a few minutes.

No GPU has run nbdist's CUDA, NCCL and NVML paths in CI, so this script is what to run the day a GPU machine is
lent. It starts a one-engine cluster the way a user does and checks, through nbdist's own functions only:

    engine_on_device                  the engine computes on cuda:0 with nccl (status rows)
    kernel_no_cuda_context            the notebook kernel (this process) holds no CUDA context: torch never
                                      initialised CUDA here, and NVML's compute processes do not list our pid
    collectives_cuda_tensors          all_reduce / all_gather / broadcast of CUDA tensors give the exact result
    collectives_cpu_tensors           the same with CPU tensors on the same process group (cpu:gloo beside cuda:nccl)
    collectives_benchmark             nbdist.collectives.benchmark on nccl, every result checked, small sizes
    ddp_hooks                         DDP on the engine's device with every hook nbdist offers equals the same model
                                      run without DDP (CPU-only hooks must refuse in one line instead)
    pipeline_equals_serial            a pipeline step (1 stage; 2 chunks of interleaved-1f1b on 1 rank) equals the
                                      model run whole on CPU in this process
    pipeline_timeline_vs_wall         the measured timeline's makespan lies within the step's wall time on the rank
                                      (GPU idle before and after: torch.cuda.synchronize), and is not far below it
    stuck_cell_freed_by_timeout       a cell stuck in a GPU kernel (torch.cuda._sleep) is freed by the cell
                                      timeout, and the cluster is usable (or restartable) after
    kernel_no_cuda_context_at_end     the kernel still has no CUDA context after every check above
    engines_gone_after_stop           stop leaves no process of the cluster
    gpu_free_after_stop               nvidia-smi lists none of the engines' pids after stop
    one_gpu_two_engines_message       `-n 2` on one GPU is refused in one line naming NCCL's one GPU per rank

Each check is recorded with its name, status, seconds and detail; one failing check does not stop the others.
The summary (torch, CUDA, GPU, the checks) is written as JSON to --out and printed; the exit status is 1 when any
check failed, else 0.

    python scripts/gpu_check.py                        # a machine with a GPU (about 3-8 minutes)
    python scripts/gpu_check.py --out $OUT/gpu.json    # elsewhere (the device machine: results come back in $OUT)
    python scripts/gpu_check.py --on-cpu               # CPU engines (mpi4py): every check with a CPU meaning runs,
                                                       # the CUDA-only ones are recorded "skipped: no GPU"
    python scripts/gpu_check.py --only ddp_hooks,pipeline_equals_serial   # rerun some checks

Without a visible GPU (and without --on-cpu) it prints one line saying so and exits 0. Nothing here assumes one
torch version: CUDA features are tested for before use (the GPU machine may have its own torch build).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing nbdist

import nbdist
from nbdist.cluster.options import ClusterOptions, visible_gpus

DEFAULT_OUT = REPO / "out" / "gpu_check.json"
SKIPPED_NO_GPU = "skipped: no GPU"
START_TIMEOUT = 180.0  # seconds a cluster start may take (a cold GPU machine imports torch and CUDA for a while)
STUCK_CELL_TIMEOUT = 8.0  # the stuck cell's --timeout
SLEEP_CYCLES = 2**42  # torch.cuda._sleep spins this many GPU clock cycles: over half an hour at 2 GHz
STUCK_MPI_TAG = 31337  # the CPU stand-in for a stuck kernel waits for a message with this tag, which no one sends
LEFTOVER_WAIT = 10.0  # seconds nvidia-smi may take to stop listing a stopped engine
EXACT_ATOL = 1e-6  # gradients that should be bit-equal: room for a GPU's reordered sums, nothing more
PIPELINE_ATOL = {"cpu": 1e-5, "cuda": 1e-4}  # pipeline (on the rank's device) against a serial run on CPU
MIN_MAKESPAN_SHARE = 0.5  # the timeline must cover at least this share of the synchronised wall time


@dataclass
class Run:
    """What the checks share: the mode, the cluster, and what was seen of the GPU while the engines ran."""

    gpu: bool
    cluster: Any = None  # nbdist.Cluster
    started: dict = field(default_factory=dict)  # how the cluster's start went: seconds, or the error
    engine_pids: set[int] = field(default_factory=set)  # every engine pid seen, restarts included
    gpu_pids_visible: bool | None = None  # did nvidia-smi list a running engine's pid (same pid namespace)?
    gpu_memory_mib: dict[str, float | None] = field(default_factory=dict)  # "before", "running": memory.used

    @property
    def device_kind(self) -> str:
        return "cuda" if self.gpu else "cpu"


@dataclass
class Check:
    name: str
    run: Callable[[Run], dict]  # returns the detail; raises (AssertionError, DistError, ...) to fail
    needs_gpu: bool  # meaningless on CPU engines: recorded as skipped there
    limit_seconds: int  # the check is abandoned (and the cluster restarted) after this long


class CheckFailed(AssertionError):
    """A check's claim did not hold; `detail` says what was seen."""

    def __init__(self, message: str, detail: dict | None = None):
        super().__init__(message)
        self.detail = detail or {}


class Overran(Exception):
    """A check ran past its limit (raised from SIGALRM)."""


# -- the run ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = visible_gpus()  # NVML, as nbdist counts them: no CUDA context in this process
    if not args.on_cpu and gpus == 0:
        print("gpu_check: no GPU visible on this machine (NVML finds none); nothing to check "
              "(--on-cpu runs the checks that have a CPU meaning on CPU engines)")
        return 0
    run = Run(gpu=not args.on_cpu)
    started = time.perf_counter()
    summary = {"mode": "gpu" if run.gpu else "cpu (--on-cpu: CPU engines, mpi4py)", **environment(run)}
    summary["checks"] = run_checks(run, selected(args.only))
    summary["cluster_start"] = run.started
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["passed"] = not any(c["status"] == "failed" for c in summary["checks"])
    write_summary(summary, Path(args.out))
    return 0 if summary["passed"] else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON summary (default {DEFAULT_OUT})")
    parser.add_argument("--on-cpu", action="store_true",
                        help="CPU engines (mpi4py, the CPU default): run the checks with a CPU meaning, skip the CUDA-only ones")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    return parser.parse_args(argv)


def selected(only: str) -> list[Check]:
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - {c.name for c in CHECKS})
    if unknown:
        raise SystemExit(f"gpu_check: unknown check(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(c.name for c in CHECKS)}")
    return [c for c in CHECKS if not names or c.name in names]


def environment(run: Run) -> dict:
    """Versions and the GPU, read without a CUDA context in this process (torch.version, NVML)."""
    import torch

    env = {"torch": torch.__version__, "cuda": getattr(torch.version, "cuda", None), "python": platform.python_version(),
           "host": platform.node(), "gpus_visible": visible_gpus(), "gpu": None, "driver": None}
    if run.gpu:
        env.update(nvml_gpu())
        run.gpu_memory_mib["before"] = gpu_memory_used_mib()
    return env


def run_checks(run: Run, checks: list[Check]) -> list[dict]:
    """Start the cluster, run each check (recording it whatever happens), stop everything at the end."""
    records = []
    try:
        start_error = start_cluster(run)
        print(f"gpu_check: cluster start: {start_error or 'ready'}", flush=True)
        for check in checks:
            if check.needs_gpu and not run.gpu:
                records.append(record(check.name, SKIPPED_NO_GPU, 0.0, {"why": "needs CUDA; this run is --on-cpu"}))
            elif start_error and check.name not in NEEDS_NO_CLUSTER:
                records.append(record(check.name, "failed", 0.0, {"error": f"the cluster did not start: {start_error}"}))
            else:
                records.append(run_one(run, check))
            print(one_line(records[-1]), flush=True)
    finally:
        if run.cluster is not None:
            run.cluster.stop()
    return records


def start_cluster(run: Run) -> str | None:
    """The one-engine cluster the checks use, started as a user starts one; None, or why it did not start."""
    started = time.perf_counter()
    try:
        run.cluster = nbdist.start(1, cpu=not run.gpu, timeout=START_TIMEOUT, restart=True)
        note_engines(run)
        run.started = {"seconds": round(time.perf_counter() - started, 2),
                       "engines_ready_seconds": run.cluster.startup_seconds}
        return None
    except Exception as e:  # noqa: BLE001 - recorded, and every check that needs the cluster says so
        run.started = {"seconds": round(time.perf_counter() - started, 2), "error": f"{type(e).__name__}: {e}"}
        return run.started["error"]


def note_engines(run: Run) -> list[dict]:
    """The status rows of the running engines; their pids join the pids the leftover checks look for."""
    rows = run.cluster.status().rows
    run.engine_pids.update(row["pid"] for row in rows)
    return rows


def run_one(run: Run, check: Check) -> dict:
    """One check, limited in time; a check that overran leaves ranks busy, so the engines are restarted."""
    started = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _overran)
    signal.alarm(check.limit_seconds)
    try:
        detail = check.run(run)
        status = "passed"
    except Overran:
        status, detail = "failed", {"error": f"ran past its limit of {check.limit_seconds} s"}
        restart_after_overrun(run, detail)
    except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on (Ctrl-C still stops it)
        status = "failed"
        detail = {"error": f"{type(e).__name__}: {e}", **getattr(e, "detail", {})}
        if not isinstance(e, CheckFailed):
            detail["traceback"] = traceback.format_exc(limit=-3)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return record(check.name, status, time.perf_counter() - started, detail)


def _overran(signum, frame) -> None:
    raise Overran()


def restart_after_overrun(run: Run, detail: dict) -> None:
    if run.cluster is None or not run.cluster.running:
        return
    try:
        run.cluster.restart()
        note_engines(run)
        detail["after"] = "the engines were restarted"
    except Exception as e:  # noqa: BLE001
        detail["after"] = f"restarting the engines failed too: {type(e).__name__}: {e}"


def record(name: str, status: str, seconds: float, detail: dict) -> dict:
    return {"name": name, "status": status, "passed": status == "passed", "seconds": round(seconds, 2),
            "detail": detail}


def require_device(want: str, device: str, detail: dict) -> None:
    """A GPU check that ran on CPU proves nothing about the GPU (and the other way round): fail it."""
    if not device.startswith(want):
        raise CheckFailed(f"ran on {device}, not on {want}", detail)


def one_line(rec: dict) -> str:
    said = rec["detail"].get("error") or rec["detail"].get("summary") or rec["detail"].get("why") or ""
    return f"[{rec['status']}] {rec['name']} ({rec['seconds']:.1f} s){': ' + said if said else ''}"


def write_summary(summary: dict, out: Path) -> None:
    text = json.dumps(summary, indent=2, default=str)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    failed = [c["name"] for c in summary["checks"] if c["status"] == "failed"]
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'every check that ran passed'}; "
          f"summary in {out}")


# -- 1. the engine's device, the kernel without CUDA ----------------------------------------------------------------


def check_engine_on_device(run: Run) -> dict:
    """The status table says where the engine computes: cuda:0 and nccl on GPU; cpu and mpi4py (the CPU default)
    with --on-cpu."""
    rows = note_engines(run)
    seen = [{k: row[k] for k in ("rank", "device", "backend", "pid")} for row in rows]
    versions = run.cluster.run(on_rank_versions, timeout=60)[0]
    want_device, want_backend = ("cuda:0", "nccl") if run.gpu else ("cpu", "mpi4py")
    wrong = [r for r in seen if r["device"] != want_device or want_backend not in r["backend"]]
    if wrong:
        raise CheckFailed(f"expected device {want_device} with {want_backend}, the status rows say {wrong}",
                          {"rows": seen, "engine": versions})
    return {"summary": f"rank 0 on {seen[0]['device']}, backend {seen[0]['backend']}", "rows": seen,
            "engine": versions}


def check_kernel_has_no_cuda_context(run: Run) -> dict:
    """The kernel never touches CUDA: torch did not initialise it here, and NVML's list of the GPU's compute
    processes (which must show the engine, else the list proves nothing) does not hold this process."""
    import torch

    engine_pid = observe_running_gpu(run)
    listed = nvml_compute_pids()
    libcuda = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcuda.so" in line]
    detail = {"kernel_pid": os.getpid(), "engine_pid": engine_pid, "nvml_compute_pids": sorted(listed),
              "torch_cuda_initialized_in_kernel": torch.cuda.is_initialized(),
              "libcuda_mapped_in_kernel": sorted(set(libcuda)), "nvidia_smi_shows_engine": run.gpu_pids_visible}
    if torch.cuda.is_initialized():
        raise CheckFailed("torch.cuda.is_initialized() is True in the kernel", detail)
    if os.getpid() in listed:
        raise CheckFailed(f"NVML lists the kernel's pid {os.getpid()} among the GPU's compute processes", detail)
    if engine_pid not in listed and libcuda:
        raise CheckFailed("NVML does not list the engine's pid (another pid namespace?), so its list proves nothing, "
                          "and the kernel has libcuda mapped", detail)
    how = "NVML lists the engine but not the kernel" if engine_pid in listed else \
        "NVML lists no pid of ours (pid namespace), and libcuda is not even loaded in the kernel"
    return {"summary": f"no CUDA context in the kernel: torch not initialised, {how}", **detail}


def observe_running_gpu(run: Run) -> int:
    """With the engine surely holding a CUDA context, note whether nvidia-smi shows its pid and how much GPU memory
    is in use: what the after-stop check compares against. Returns the engine's pid."""
    engine_pid = run.cluster.run(on_rank_touch_cuda, timeout=60)[0]["pid"]
    run.gpu_pids_visible = engine_pid in (gpu_pids_by_nvidia_smi() or set())
    run.gpu_memory_mib["running"] = gpu_memory_used_mib()
    return engine_pid


# -- 2. collectives on CUDA and CPU tensors -------------------------------------------------------------------------


def check_collectives_cuda(run: Run) -> dict:
    """CUDA tensors on the engine's process group (NCCL), exact results."""
    return _collectives(run, "engine")


def check_collectives_cpu(run: Run) -> dict:
    """CPU tensors on the engine's process group: with nccl alone torch has no backend for them."""
    return _collectives(run, "cpu")


def _collectives(run: Run, where: str) -> dict:
    report = run.cluster.run(on_rank_collectives, where, timeout=60)[0]
    require_device(run.device_kind if where == "engine" else "cpu", report["device"], report)
    failed = {op: outcome for op, outcome in report["ops"].items() if outcome != "ok"}
    if failed:
        raise CheckFailed(f"on {report['device']} with backend {report['backend']}: "
                          + "; ".join(f"{op}: {why}" for op, why in failed.items()), report)
    return {"summary": f"{', '.join(report['ops'])} exact on {report['device']} (backend {report['backend']})",
            **report}


# -- 3. the collectives benchmark -----------------------------------------------------------------------------------


def check_collectives_benchmark(run: Run) -> dict:
    """The project's own sweep, every op, small sizes, every result checked by the benchmark itself."""
    want = "nccl" if run.gpu else "mpi4py"
    rows = nbdist.collectives.benchmark(sizes=[4096, 2**20], via="torch", cluster=run.cluster, warmup=2,
                                        target_seconds=0.02).to_dicts()
    shown = [{k: r[k] for k in ("op", "size_bytes", "seconds", "busbw", "iters", "checked", "backend", "note")}
             for r in rows]
    # a row's backend is the one that carried its buffers: "nccl" only when they were CUDA tensors
    bad = [r for r in shown if r["backend"] != want or not r["checked"] or not r["seconds"]]
    if bad:
        raise CheckFailed(f"{len(bad)} of {len(rows)} rows not measured and checked on {want}: {bad[0]}",
                          {"rows": shown})
    return {"summary": f"{len(rows)} rows ({len({r['op'] for r in rows})} ops x 2 sizes) checked on {want}",
            "rows": shown}


# -- 4. DDP with every hook -----------------------------------------------------------------------------------------


def check_ddp_hooks(run: Run) -> dict:
    """Every hook nbdist offers, on the engine's device: equal to the same model without DDP (one rank averages
    nothing), compressed hooks within their dtype's rounding; on CUDA the MPI hooks (CPU tensors only) must refuse
    in one line instead. PowerSGD's first two steps are plain all-reduces (start_iter 2): compared there."""
    device, results = run.cluster.run(on_rank_ddp_hooks, 2, EXACT_ATOL, timeout=120)[0]
    detail = {"device": device, "hooks": results}
    require_device(run.device_kind, device, detail)
    ran = [n for n, r in results.items() if r["outcome"] == "equal"]
    refused = {n: r["message"] for n, r in results.items() if r["outcome"] == "refused"}
    wrong = {n: r for n, r in results.items() if r["outcome"] not in ("equal", "refused")}
    bad_refusals = {n: m for n, m in refused.items() if not run.gpu or "CPU" not in m or "\n" in m}
    if wrong or bad_refusals or not ran:
        raise CheckFailed(f"differs or failed: {sorted(wrong)}; refused without cause: {sorted(bad_refusals)}; "
                          f"equal: {ran}", detail)
    refusals = f"; refused (CPU only): {', '.join(refused)}" if refused else ""
    return {"summary": f"equal to serial on {device}: {', '.join(ran)}{refusals}", **detail}


# -- 5. pipeline steps ----------------------------------------------------------------------------------------------


def check_pipeline_equals_serial(run: Run) -> dict:
    """One rank, so one pipeline rank: 1F1B over one stage, and interleaved-1F1B with two chunks of the model on that
    rank (the hand-off between chunks is local); both against the model run whole on CPU in this process."""
    import torch

    x, y = batch(rows=32, inputs=12, outputs=3)
    expected_loss, expected_grads = serial_on_cpu(partial(build_mlp, 12, 16, 6, 3), x, y)
    atol = PIPELINE_ATOL[run.device_kind]
    require_device(run.device_kind, run.cluster.devices[0], {})
    results = {}
    for schedule, chunks in (("1f1b", 1), ("interleaved-1f1b", 2)):
        pipe = nbdist.pipeline(partial(build_mlp, 12, 16, 6, 3), stages=1, schedule=schedule, microbatches=4,
                               chunks=chunks, cluster=run.cluster)
        loss = pipe.step(x, y, torch.nn.functional.mse_loss, timeout=60)
        grads = pipe.grads()
        pipe.close()
        worst = max((grads[k] - expected_grads[k]).abs().max().item() for k in expected_grads)
        results[f"{schedule} v={chunks}"] = {"transport": pipe.transport, "loss": loss, "serial_loss": expected_loss,
                                             "max_grad_difference": worst, "same_keys": set(grads) == set(expected_grads)}
    bad = {k: r for k, r in results.items()
           if not r["same_keys"] or r["max_grad_difference"] > atol or abs(r["loss"] - r["serial_loss"]) > atol}
    detail = {"atol": atol, "device": run.cluster.devices[0], "steps": results}
    if bad:
        raise CheckFailed(f"not equal to the serial CPU run within {atol}: {sorted(bad)}", detail)
    return {"summary": f"{', '.join(results)} equal to serial CPU within {atol} on {detail['device']}", **detail}


def check_pipeline_timeline_vs_wall(run: Run) -> dict:
    """A step big enough that compute dominates, timed on the rank between two points where the GPU is idle
    (torch.cuda.synchronize): the measured timeline's makespan cannot exceed that wall time, and most of the wall
    time is the step's actions. One warm-up step, then three measured."""
    import torch

    require_device(run.device_kind, run.cluster.devices[0], {})
    width, rows = (4096, 8192) if run.gpu else (256, 1024)
    x, y = batch(rows=rows, inputs=64, outputs=8)
    pipe = nbdist.pipeline(partial(build_mlp, 64, width, 8, 8), stages=1, schedule="interleaved-1f1b",
                           microbatches=8, chunks=2, cluster=run.cluster)
    steps = []
    for i in range(4):
        args = pipe.step_args(x, y, torch.nn.functional.mse_loss)
        out = run.cluster.run_each(on_rank_synchronised_step, {r: (a,) for r, a in args.items()}, timeout=120)[0]
        timeline = pipe.measured_timeline({out["report"]["rank"]: out["report"]}, stepped=False)
        if i:
            steps.append({"wall_s": out["wall"], "makespan_s": timeline.makespan,
                          "share": timeline.makespan / out["wall"], **forward_spread(timeline)})
    pipe.close()
    detail = {"model": f"MLP 64 -> {width} x 8 -> 8, batch {rows}, 8 micro-batches", "steps": steps}
    over = [s for s in steps if s["makespan_s"] > s["wall_s"]]
    share = statistics.median(s["share"] for s in steps)
    if over:
        raise CheckFailed(f"makespan exceeds the synchronised wall time: {over[0]}", detail)
    if share < MIN_MAKESPAN_SHARE:
        raise CheckFailed(f"makespan is only {share:.0%} of the wall time (median): the timeline misses work", detail)
    return {"summary": f"makespan {share:.0%} of the synchronised wall time (median of 3), never above it", **detail}


def forward_spread(timeline) -> dict:
    """Shown, not asserted: forward spans of equal micro-batches should last about as long as each other (timing
    only the launch of asynchronous GPU kernels would make them tiny, and one later span huge)."""
    forward = sorted(s.duration for row in timeline.spans.values() for s in row if s.action.kind == "F")
    return {"forward_median_s": statistics.median(forward), "forward_max_s": forward[-1]} if forward else {}


# -- 6. a stuck cell freed by its timeout ---------------------------------------------------------------------------


def check_stuck_cell_freed(run: Run) -> dict:
    """`%%dist --timeout S` on a cell no interrupt can free: on GPU a spinning kernel waited for with
    torch.cuda.synchronize; with --on-cpu a blocking MPI receive no one matches (stuck in C the same way). The cell
    must end soon after S with nbdist's one line, and the cluster must work after (or at least restart)."""
    if run.gpu and not run.cluster.run(on_rank_has_cuda_sleep, timeout=30)[0]:
        raise CheckFailed("this torch has no torch.cuda._sleep: no stuck kernel to make")
    code = (f"import torch\ntorch.cuda._sleep({SLEEP_CYCLES})\ntorch.cuda.synchronize()\n" if run.gpu else
            f"import numpy\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Recv(numpy.empty(1), source=MPI.ANY_SOURCE, "
            f"tag={STUCK_MPI_TAG})\n")
    stuck_pids = {row["pid"] for row in note_engines(run)}
    started = time.perf_counter()
    try:
        run.cluster.execute(code, timeout=STUCK_CELL_TIMEOUT, output="none")
        raise CheckFailed("the stuck cell returned by itself: nothing was stuck")
    except nbdist.DistError as e:
        message, freed_after = str(e), time.perf_counter() - started
    detail = {"stuck": code.strip().splitlines()[-1], "message": message, "returned_after_s": round(freed_after, 2),
              "after": usable_or_restartable(run)}
    if run.gpu:
        detail["stuck_engine_still_on_gpu"] = sorted(wait_off_gpu(stuck_pids, LEFTOVER_WAIT) or [])
    if f"timed out after {STUCK_CELL_TIMEOUT:g} s" not in message or "\n" in message:
        raise CheckFailed("nbdist's message does not say the cell timed out (in one line)", detail)
    if freed_after > STUCK_CELL_TIMEOUT + 60:
        raise CheckFailed(f"freed only after {freed_after:.0f} s", detail)
    if detail["after"].startswith("unusable") or detail.get("stuck_engine_still_on_gpu"):
        raise CheckFailed(f"after the timeout: {detail['after']}", detail)
    return {"summary": f"cell returned {freed_after:.1f} s after it began (timeout {STUCK_CELL_TIMEOUT:g} s); cluster "
                       f"{detail['after']}", **detail}


def usable_or_restartable(run: Run) -> str:
    """'usable' when a collective on the engine's device works at once, 'restartable' when it did after
    Cluster.restart(), else 'unusable: why'."""
    for attempt in ("usable", "restartable"):
        try:
            if attempt == "restartable":
                run.cluster.restart()
            note_engines(run)
            if run.cluster.run(on_rank_collectives, "engine", timeout=60)[0]["ops"]["all_reduce"] == "ok":
                return attempt
        except Exception as e:  # noqa: BLE001
            last = f"{type(e).__name__}: {e}"
    return f"unusable: {last}"


# -- 7. nothing left after stop -------------------------------------------------------------------------------------


def check_kernel_no_cuda_at_end(run: Run) -> dict:
    """Again after everything above: results came back to the kernel (gradients, timelines) as CPU data only."""
    return check_kernel_has_no_cuda_context(run)


def check_engines_gone_after_stop(run: Run) -> dict:
    """Cluster.stop() leaves no process of the cluster (controller, mpiexec, proxies, engines)."""
    import psutil

    members = run.cluster.processes()
    run.cluster.stop()
    _, alive = psutil.wait_procs(members, timeout=5)
    alive = [p for p in alive if running(p)]
    detail = {"processes_before_stop": len(members), "engine_pids": sorted(run.engine_pids)}
    if not members:
        raise CheckFailed("the running cluster showed no processes: nothing to prove", detail)
    if alive:
        raise CheckFailed(f"still running after stop: {[(p.pid, p.name()) for p in alive]}", detail)
    return {"summary": f"all {len(members)} processes gone", **detail}


def check_gpu_free_after_stop(run: Run) -> dict:
    """nvidia-smi lists none of the engines' pids a few seconds after stop. Where nvidia-smi showed no engine pid even
    while one ran (pid namespaces), GPU memory in use must instead be back to what it was before the start."""
    if run.cluster.running:
        if run.gpu_pids_visible is None:  # the kernel checks did not run (--only)
            observe_running_gpu(run)
        run.cluster.stop()
    left = wait_off_gpu(run.engine_pids, LEFTOVER_WAIT)
    memory = {**run.gpu_memory_mib, "after": gpu_memory_used_mib()}
    detail = {"engine_pids": sorted(run.engine_pids), "still_listed": sorted(left or []),
              "nvidia_smi_showed_engines": run.gpu_pids_visible, "memory_used_mib": memory}
    if left is None:
        raise CheckFailed("nvidia-smi could not be run", detail)
    if left:
        raise CheckFailed(f"nvidia-smi still lists engine pid(s) {sorted(left)} {LEFTOVER_WAIT:g} s after stop", detail)
    if run.gpu_pids_visible:
        return {"summary": "no engine pid on the GPU (nvidia-smi listed them while they ran)", **detail}
    if None in (memory.get("before"), memory.get("running"), memory["after"]):
        raise CheckFailed("nvidia-smi shows neither our pids nor memory use: nothing proves the GPU is free", detail)
    if memory["running"] - memory["before"] < 100 or memory["after"] - memory["before"] > 64:
        raise CheckFailed("nvidia-smi shows no engine pid, and memory use does not show the engines leaving", detail)
    return {"summary": "GPU memory back to its level before start (nvidia-smi shows no pids here)", **detail}


# -- 8. -n 2 on one GPU ---------------------------------------------------------------------------------------------


def check_one_gpu_two_engines(run: Run) -> dict:
    """`%dist_start -n 2` where one GPU is visible: refused before anything starts, in one line naming NCCL's one GPU
    per rank (not the memory limit). On a machine with more GPUs, CUDA_VISIBLE_DEVICES shows one."""
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible_gpus() > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        nbdist.Cluster(ClusterOptions(n=2))  # what nbdist.start(2) validates first; starts nothing
        raise CheckFailed("-n 2 on one GPU was accepted")
    except nbdist.DistUsageError as e:
        message = str(e)
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
    detail = {"message": message}
    said = message.lower()
    if "nccl" not in said or not ("per gpu" in said or "gpu per" in said) or "GiB" in message or "\n" in message:
        raise CheckFailed("the refusal is not the one-line NCCL (one GPU per rank) message", detail)
    return {"summary": message, **detail}


CHECKS = [
    Check("engine_on_device", check_engine_on_device, needs_gpu=False, limit_seconds=60),
    Check("kernel_no_cuda_context", check_kernel_has_no_cuda_context, needs_gpu=True, limit_seconds=90),
    Check("collectives_cuda_tensors", check_collectives_cuda, needs_gpu=True, limit_seconds=90),
    Check("collectives_cpu_tensors", check_collectives_cpu, needs_gpu=False, limit_seconds=90),
    Check("collectives_benchmark", check_collectives_benchmark, needs_gpu=False, limit_seconds=120),
    Check("ddp_hooks", check_ddp_hooks, needs_gpu=False, limit_seconds=150),
    Check("pipeline_equals_serial", check_pipeline_equals_serial, needs_gpu=False, limit_seconds=120),
    Check("pipeline_timeline_vs_wall", check_pipeline_timeline_vs_wall, needs_gpu=False, limit_seconds=150),
    Check("stuck_cell_freed_by_timeout", check_stuck_cell_freed, needs_gpu=False, limit_seconds=300),
    Check("kernel_no_cuda_context_at_end", check_kernel_no_cuda_at_end, needs_gpu=True, limit_seconds=90),
    Check("engines_gone_after_stop", check_engines_gone_after_stop, needs_gpu=False, limit_seconds=60),
    Check("gpu_free_after_stop", check_gpu_free_after_stop, needs_gpu=True, limit_seconds=60),
    Check("one_gpu_two_engines_message", check_one_gpu_two_engines, needs_gpu=True, limit_seconds=30),
]
NEEDS_NO_CLUSTER = {"one_gpu_two_engines_message"}


# -- on the rank (sent by value: each imports what it needs, since a rank looks global names up at home) -----------


def on_rank_touch_cuda() -> dict:
    """A CUDA tensor on the rank's device, so that its context surely exists; this engine's pid."""
    import os

    import torch

    from nbdist.cluster.ranks.boot import boot

    torch.ones(1, device=boot().device).sum().item()
    return {"pid": os.getpid()}


def on_rank_versions() -> dict:
    """What the engine runs: torch, its CUDA and NCCL, the device's name (each feature-tested: any torch)."""
    import torch

    from nbdist.cluster.ranks.boot import boot

    out = {"torch": torch.__version__, "cuda": getattr(torch.version, "cuda", None), "device": boot().device}
    if out["device"].startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name(torch.device(out["device"]))
        nccl = getattr(getattr(torch.cuda, "nccl", None), "version", None)
        version = nccl() if callable(nccl) else None  # a tuple on recent torch, an int on old ones
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    return out


def on_rank_has_cuda_sleep() -> bool:
    import torch

    return callable(getattr(torch.cuda, "_sleep", None))


def on_rank_collectives(where: str) -> dict:
    """all_reduce, all_gather and broadcast of rank-dependent values on the default process group, each compared
    exactly with what it must give; `where`: "engine" (the rank's device) or "cpu". One failing op does not stop
    the others."""
    import torch
    import torch.distributed as dist

    from nbdist.cluster.ranks.boot import boot

    device = torch.device(boot().device if where == "engine" else "cpu")
    rank, n = dist.get_rank(), dist.get_world_size()

    def mine(r: int) -> torch.Tensor:
        return torch.arange(4, dtype=torch.float32) + 10 * (r + 1)

    def all_reduce():
        t = mine(rank).to(device)
        dist.all_reduce(t)
        return t, sum(mine(r) for r in range(n))

    def all_gather():
        parts = [torch.full((4,), -1.0, device=device) for _ in range(n)]
        dist.all_gather(parts, mine(rank).to(device))
        return torch.cat(parts), torch.cat([mine(r) for r in range(n)])

    def broadcast():
        t = mine(rank).to(device) if rank == 0 else torch.full((4,), -1.0, device=device)
        dist.broadcast(t, src=0)
        return t, mine(0)

    ops = {}
    for name, op in (("all_reduce", all_reduce), ("all_gather", all_gather), ("broadcast", broadcast)):
        try:
            got, want = op()
            if got.device != device:
                ops[name] = f"result on {got.device}, not {device}"
            else:
                ops[name] = "ok" if torch.equal(got.cpu(), want) else f"got {got.tolist()}, expected {want.tolist()}"
        except Exception as e:  # noqa: BLE001 - reported per op
            ops[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return {"device": str(device), "backend": str(dist.get_backend()), "ranks": n, "ops": ops}


def on_rank_ddp_hooks(steps: int, atol: float) -> dict:
    """hook name -> outcome: "equal" (to the same model run without DDP, `steps` steps, the largest difference),
    "refused" (nbdist's one-line DistUsageError), or "differs" / "error"; and the device it ran on."""
    import copy

    import torch
    from torch import nn

    from nbdist.data_parallel.ranks import hooks
    from nbdist.cluster.ranks.boot import boot
    from nbdist.data_parallel.ranks.ddp import ddp
    from nbdist.errors import DistUsageError

    device = torch.device(boot().device)
    options = {"topk": {"ratio": 1.0}}  # every entry sent: nothing dropped, so the average is exact
    rounding = {"fp16": torch.float16, "bf16": torch.bfloat16}  # compared within one rounding of this dtype
    results = {}
    for name in ["auto", *hooks.HOOKS]:
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).to(device)
        model = copy.deepcopy(serial)
        try:
            wrapped = ddp(model, hook=name, **options.get(name, {}))
        except DistUsageError as e:
            results[name] = {"outcome": "refused", "message": str(e)}
            continue
        try:
            worst = 0.0
            rtol = torch.finfo(rounding[name]).eps if name in rounding else 0.0
            for step in range(steps):
                generator = torch.Generator().manual_seed(step)
                x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)
                x, y = x.to(device), y.to(device)
                for m in (wrapped, serial):
                    m.zero_grad(set_to_none=False)
                    nn.functional.mse_loss(m(x), y).backward()
                for p, q in zip(model.parameters(), serial.parameters()):
                    excess = (p.grad - q.grad).abs() - (atol + rtol * q.grad.abs())
                    worst = max(worst, excess.max().item() + atol)
            state = wrapped.comm_hook_state
            results[name] = {"outcome": "equal" if worst <= atol else "differs", "hook": state.name,
                             "worst_difference_beyond_rounding": worst, "rtol": rtol, "bytes_sent": state.bytes_sent}
        except Exception as e:  # noqa: BLE001 - reported per hook
            results[name] = {"outcome": "error", "message": f"{type(e).__name__}: {e}"}
    return str(device), results


def on_rank_synchronised_step(args: tuple) -> dict:
    """One pipeline step as Pipeline.step runs it (nbdist.pipeline_parallel.ranks.pipeline.step), with the GPU idle before and after
    (torch.cuda.synchronize), so that the wall time includes all of its GPU work."""
    import time

    import torch

    from nbdist.pipeline_parallel.ranks import pipeline
    from nbdist.cluster.ranks.boot import boot

    on_gpu = boot().device.startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    report = pipeline.step(*args)
    if on_gpu:
        torch.cuda.synchronize()
    return {"report": report, "wall": time.perf_counter() - started}


# -- helpers ----------------------------------------------------------------------------------------------------------


def build_mlp(inputs: int, width: int, layers: int, outputs: int):
    """The model every pipeline check cuts: Linear + Tanh layers, seeded, so every rank and the serial run build the
    same weights."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    sizes = [inputs] + [width] * (layers - 1) + [outputs]
    body = []
    for i, (a, b) in enumerate(pairwise(sizes)):
        body += [nn.Linear(a, b)] + ([nn.Tanh()] if i < layers - 1 else [])
    return nn.Sequential(*body)


def batch(rows: int, inputs: int, outputs: int):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, inputs, generator=generator), torch.randn(rows, outputs, generator=generator)


def serial_on_cpu(build: Callable, x, y) -> tuple[float, dict]:
    """The model run whole in this process, on CPU: the loss and each parameter's gradient."""
    import torch

    model = build()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}


def running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def nvml_gpu() -> dict:
    """GPU 0's name and the driver, through NVML (no CUDA context)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        as_text = (lambda v: v.decode() if isinstance(v, bytes) else v)
        return {"gpu": as_text(name), "driver": as_text(driver)}
    except Exception as e:  # noqa: BLE001 - shown in the summary
        return {"gpu": f"unknown ({type(e).__name__}: {e})"}


def nvml_compute_pids() -> set[int]:
    """Pids of the compute processes NVML sees on every GPU (a CUDA context makes a process one)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids.update(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return pids
    finally:
        pynvml.nvmlShutdown()


def nvidia_smi(*query: str) -> list[str] | None:
    """nvidia-smi's CSV lines for a query, or None where it cannot be run."""
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_pids_by_nvidia_smi() -> set[int] | None:
    lines = nvidia_smi("--query-compute-apps=pid")
    return None if lines is None else {int(line) for line in lines if line.isdigit()}


def gpu_memory_used_mib() -> float | None:
    lines = nvidia_smi("--query-gpu=memory.used", "-i", "0")
    try:
        return float(lines[0]) if lines else None
    except ValueError:
        return None


def wait_off_gpu(pids: set[int], seconds: float) -> set[int] | None:
    """Those of `pids` nvidia-smi still lists after up to `seconds` (None: nvidia-smi cannot be run)."""
    deadline = time.monotonic() + seconds
    while True:
        listed = gpu_pids_by_nvidia_smi()
        if listed is None or not (listed & pids) or time.monotonic() > deadline:
            return None if listed is None else listed & pids
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())

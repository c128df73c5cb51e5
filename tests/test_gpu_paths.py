"""nbdist's GPU paths on a one-engine cluster (what scripts/gpu_check.py used to check, continued from
tests/test_gpu.py): a pipeline step equals the model run whole, its measured timeline fits the step's synchronised
wall time, a cell stuck in a GPU kernel is freed by its timeout, the kernel still holds no CUDA context after all
that, and stop leaves no process and nothing on the GPU.

The `cpu` cases run everywhere (CPU engines, mpi4py; on CPU the stuck cell is a blocking MPI receive no one
matches); the `cuda` ones are marked `gpu` and skipped, with the reason, where CUDA is absent.
"""
from __future__ import annotations

import statistics
import time
from functools import partial
from itertools import pairwise

import psutil
import pytest
from gpu_engines import (
    KINDS,
    assert_device,
    assert_no_cuda_context_in_kernel,
    cuda_only,
    gpu_memory_used_mib,
    gpu_pids_by_nvidia_smi,
    on_rank_collectives,
    on_rank_touch_cuda,
    skip_without_cuda,
    start_cluster,
    wait_off_gpu,
)

import nbdist

pytestmark = pytest.mark.cluster  # starts real MPI engines (one-engine clusters of its own)

PIPELINE_ATOL = {"cpu": 1e-5, "cuda": 1e-4}  # pipeline (on the rank's device) against a serial run on CPU
MIN_MAKESPAN_SHARE = 0.5  # the timeline must cover at least this share of the synchronised wall time
STUCK_CELL_TIMEOUT = 8.0  # the stuck cell's --timeout
SLEEP_CYCLES = 2**42  # torch.cuda._sleep spins this many GPU clock cycles: over half an hour at 2 GHz
STUCK_MPI_TAG = 31337  # the CPU stand-in for a stuck kernel waits for a message with this tag, which no one sends


# -- pipeline steps ---------------------------------------------------------------------------------------------------


def test_pipeline_step_equals_the_model_run_whole_on_cpu(engine):
    """One rank, so one pipeline rank: 1F1B over one stage, and interleaved-1F1B with two chunks of the model on that
    rank (the hand-off between chunks is local); both against the model run whole on CPU in this process."""
    import torch

    x, y = batch(rows=32, inputs=12, outputs=3)
    build = partial(build_mlp, 12, 16, 6, 3)
    expected_loss, expected_grads = serial_on_cpu(build, x, y)
    atol = PIPELINE_ATOL[engine.kind]
    assert_device(engine, engine.cluster.devices[0])
    for schedule, chunks in (("1f1b", 1), ("interleaved-1f1b", 2)):
        pipe = nbdist.pipeline(build, stages=1, schedule=schedule, microbatches=4, chunks=chunks,
                               cluster=engine.cluster)
        try:
            loss = pipe.step(x, y, torch.nn.functional.mse_loss, timeout=60)
            grads = pipe.grads()
        finally:
            pipe.close()
        assert set(grads) == set(expected_grads), f"{schedule} v={chunks}: {sorted(grads)}"
        assert abs(loss - expected_loss) <= atol, f"{schedule} v={chunks}: loss {loss}, serial {expected_loss}"
        worst = max((grads[k] - expected_grads[k]).abs().max().item() for k in expected_grads)
        assert worst <= atol, f"{schedule} v={chunks} ({pipe.transport}): gradients differ by {worst} > {atol}"


def test_pipeline_timeline_fits_the_synchronised_wall_time(engine):
    """A step big enough that compute dominates, timed on the rank between two points where the GPU is idle
    (torch.cuda.synchronize): the measured timeline's makespan cannot exceed that wall time, and most of the wall
    time is the step's actions. One warm-up step, then three measured."""
    import torch

    assert_device(engine, engine.cluster.devices[0])
    width, rows = (4096, 8192) if engine.kind == "cuda" else (256, 1024)
    x, y = batch(rows=rows, inputs=64, outputs=8)
    pipe = nbdist.pipeline(partial(build_mlp, 64, width, 8, 8), stages=1, schedule="interleaved-1f1b",
                           microbatches=8, chunks=2, cluster=engine.cluster)
    steps = []
    try:
        for i in range(4):
            args = pipe.step_args(x, y, torch.nn.functional.mse_loss)
            out = engine.cluster.run_each(on_rank_synchronised_step, {r: (a,) for r, a in args.items()},
                                          timeout=120)[0]
            timeline = pipe.measured_timeline({out["report"]["rank"]: out["report"]}, stepped=False)
            if i:
                steps.append({"wall_s": out["wall"], "makespan_s": timeline.makespan,
                              "share": timeline.makespan / out["wall"], **forward_spread(timeline)})
    finally:
        pipe.close()
    assert len(steps) == 3
    assert all(0 < s["makespan_s"] <= s["wall_s"] for s in steps), f"makespan exceeds the wall time: {steps}"
    share = statistics.median(s["share"] for s in steps)
    assert share >= MIN_MAKESPAN_SHARE, f"makespan is only {share:.0%} of the wall time (median): {steps}"


# -- a stuck cell freed by its timeout --------------------------------------------------------------------------------


def test_a_stuck_cell_is_freed_by_its_timeout(engine):
    """`%%dist --timeout S` on a cell no interrupt can free: on a GPU a spinning kernel waited for with
    torch.cuda.synchronize; on CPU a blocking MPI receive no one matches (stuck in C the same way). The cell must end
    soon after S with nbdist's one line, and the cluster must work after (or at least restart)."""
    cluster = engine.cluster
    if engine.kind == "cuda":
        assert cluster.run(on_rank_has_cuda_sleep, timeout=30)[0], "this torch has no torch.cuda._sleep"
        code = f"import torch\ntorch.cuda._sleep({SLEEP_CYCLES})\ntorch.cuda.synchronize()\n"
    else:
        code = (f"import numpy\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Recv(numpy.empty(1), source=MPI.ANY_SOURCE, "
                f"tag={STUCK_MPI_TAG})\n")
    stuck_pids = {row["pid"] for row in cluster.status().rows}
    started = time.perf_counter()
    with pytest.raises(nbdist.DistError) as raised:
        cluster.execute(code, timeout=STUCK_CELL_TIMEOUT, output="none")
    freed_after = time.perf_counter() - started
    message = str(raised.value)
    after = usable_or_restartable(cluster)
    assert f"timed out after {STUCK_CELL_TIMEOUT:g} s" in message and "\n" not in message, message
    assert freed_after <= STUCK_CELL_TIMEOUT + 60, f"freed only after {freed_after:.0f} s: {message}"
    assert after in ("usable", "restartable"), f"after the timeout: {after}"
    if engine.kind == "cuda":
        left = wait_off_gpu(stuck_pids)
        assert not left, f"the stuck engine is still on the GPU: {sorted(left or [])}"


def usable_or_restartable(cluster: nbdist.Cluster) -> str:
    """'usable' when a collective on the engine's device works at once, 'restartable' when it did after
    Cluster.restart(), else 'unusable: why'."""
    last = "the all_reduce was not exact"
    for attempt in ("usable", "restartable"):
        try:
            if attempt == "restartable":
                cluster.restart()
            if cluster.run(on_rank_collectives, "engine", timeout=60)[0]["ops"]["all_reduce"] == "ok":
                return attempt
        except Exception as e:  # noqa: BLE001 - said in the result
            last = f"{type(e).__name__}: {e}"
    return f"unusable: {last}"


# -- nothing left after stop ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_stop_leaves_no_process_of_the_cluster(kind):
    """Cluster.stop() leaves no process of the cluster (controller, mpiexec, proxies, engines)."""
    cluster = start_cluster(kind)
    try:
        engine_pids = {row["pid"] for row in cluster.status().rows}
        members = cluster.processes()
    finally:
        cluster.stop()
    assert members, "the running cluster showed no processes: nothing to prove"
    assert engine_pids <= {p.pid for p in members}, (engine_pids, members)
    _, alive = psutil.wait_procs(members, timeout=5)
    alive = [p for p in alive if running(p)]
    assert not alive, f"still running after stop: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.gpu
def test_stop_leaves_nothing_on_the_gpu():
    """nvidia-smi lists none of the engines' pids a few seconds after stop. Where nvidia-smi showed no engine pid even
    while one ran (pid namespaces), GPU memory in use must instead be back to what it was before the start."""
    skip_without_cuda()
    before = gpu_memory_used_mib()
    cluster = start_cluster("cuda")
    try:
        engine_pid = cluster.run(on_rank_touch_cuda, timeout=60)[0]["pid"]
        shown = engine_pid in (gpu_pids_by_nvidia_smi() or set())
        running_mib = gpu_memory_used_mib()
    finally:
        cluster.stop()
    left = wait_off_gpu({engine_pid})
    memory = {"before": before, "running": running_mib, "after": gpu_memory_used_mib()}
    assert left is not None, "nvidia-smi could not be run"
    assert not left, f"nvidia-smi still lists engine pid(s) {sorted(left)} after stop"
    if not shown:  # no pid of ours in nvidia-smi's list even while the engine ran: memory must show it leaving
        assert None not in memory.values(), f"nvidia-smi shows neither our pids nor memory use: {memory}"
        assert memory["running"] - memory["before"] >= 100, f"memory use does not show the engine at all: {memory}"
        assert memory["after"] - memory["before"] <= 64, f"memory use does not show the engine leaving: {memory}"


@cuda_only
def test_kernel_still_has_no_cuda_context_at_the_end(engine):
    """Again after the checks above (tests/test_gpu.py's too, when run together): results came back to the kernel
    (gradients, timelines) as CPU data only."""
    assert_no_cuda_context_in_kernel(engine.cluster)


# -- on the rank (ipyparallel sends the code; each function imports what it needs) ------------------------------------


def on_rank_has_cuda_sleep() -> bool:
    import torch

    return callable(getattr(torch.cuda, "_sleep", None))


def on_rank_synchronised_step(args: tuple) -> dict:
    """One pipeline step as Pipeline.step runs it (nbdist.pipeline_parallel.ranks.pipeline.step), with the GPU idle
    before and after (torch.cuda.synchronize), so that the wall time includes all of its GPU work."""
    import time

    import torch

    from nbdist.cluster.launching.ranks.boot import boot
    from nbdist.pipeline_parallel.ranks import pipeline

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
    """The model every pipeline test cuts: Linear + Tanh layers, seeded, so every rank and the serial run build the
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


def serial_on_cpu(build, x, y) -> tuple[float, dict]:
    """The model run whole in this process, on CPU: the loss and each parameter's gradient."""
    import torch

    model = build()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}


def forward_spread(timeline) -> dict:
    """Kept with each step for the failure message, not asserted: forward spans of equal micro-batches should last
    about as long as each other (timing only the launch of asynchronous GPU kernels would make them tiny, and one
    later span huge)."""
    forward = sorted(s.duration for row in timeline.spans.values() for s in row if s.action.kind == "F")
    return {"forward_median_s": statistics.median(forward), "forward_max_s": forward[-1]} if forward else {}


def running(process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

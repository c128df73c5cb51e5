"""One engine, one device, on every training path (issue 20): the same tests on a CUDA engine and on a CPU engine.

The claim each test checks: the path keeps every tensor it owns (model, gradients, optimizer state, batches) on
the engine's own device, which is what `%dist_status` shows (Trainer.tensor_devices), measures time on that device,
and trains like one process on CPU. `cuda` cases are marked `gpu` and skipped, with the reason, where CUDA is absent
(scripts/device_check.sh runs them on a GPU machine); `cpu` cases run everywhere, on CPU engines (mpi4py). Paths that
need two ranks (tensor parallel, pipelines over two stages) run on two engines: two GPUs, or the shared 2-engine CPU
cluster.

Each test would have failed on a GPU before issue 20 (models outside a pipeline were never moved there, host clocks
timed queued kernels, clipping copied gradients to the host, the profile measured the CPU).
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch
from gpu_engines import CPU, CUDA, assert_device, start_cluster

import nbdist
from nbdist import data, models
from nbdist.cluster.options import visible_gpus
from nbdist.errors import DistError, DistUsageError
from nbdist.training.ranks.training import seed_everything

pytestmark = pytest.mark.cluster  # starts real MPI engines

ATOL = {"cpu": 1e-5, "cuda": 1e-4}  # against one process on CPU: room for a GPU's reordered sums
BATCH = 8
CONFIG = dict(vocab=256, seq=16, layers=2, hidden=32, heads=4)


def model_fn():
    from nbdist import models

    return models.gpt(vocab=256, seq=16, layers=2, hidden=32, heads=4, seed=0)


def data_fn():
    from nbdist import data

    return data.text_dataset(seq=16, max_bytes=1 << 15)


def adam(params):
    import torch

    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.05)


def serial(steps: int, make=adam, autocast_dtype=None, clip: float | None = None) -> dict:
    """One process on CPU, the whole model and global batch: what every path must reproduce."""
    seed_everything(0)
    model, dataset = model_fn(), data_fn()
    optimizer = make(model.parameters())
    cast = (lambda: torch.autocast("cpu", dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
    for k in range(steps):
        x, y = data.collate(dataset, data.batch_indices(len(dataset), k, BATCH, 0))
        optimizer.zero_grad()
        with cast():
            loss = models.lm_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer(cluster, optimizer=adam, **options) -> nbdist.Trainer:
    return nbdist.Trainer(model_fn, data_fn, models.lm_loss, optimizer, cluster=cluster,
                          **{"batch_size": BATCH, "live": False, **options})


def worst(got: dict, expected: dict) -> float:
    assert set(got) == set(expected)
    return max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)


def assert_on_engine_device(tr: nbdist.Trainer) -> None:
    """Every rank's model and optimizer state on the device the engine reports (what %dist_status shows)."""
    devices = tr.cluster.devices
    assert tr.tensor_devices() == {r: [devices[r]] for r in range(len(devices))}


@pytest.fixture(scope="module", params=[CUDA, CPU])
def pair(request):
    """Two engines of one kind: two GPUs (skipped, with the reason, where fewer are visible: NCCL runs one rank per
    GPU), or the shared 2-engine CPU cluster."""
    if request.param == "cpu":
        yield request.getfixturevalue("cluster")
        return
    gpus = visible_gpus()
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs (NCCL runs one rank per GPU): {gpus} visible")
    started = start_cluster("cuda", n=2)
    yield started
    started.stop()


# -- the Trainer's paths ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", ["local-sgd", "easgd", "ssp"])
def test_each_sync_mode_trains_on_the_engine_device(engine, sync):
    """Whole replicas (one here): local SGD and SSP of one replica are plain SGD; EASGD pulls it to its centre."""
    tr = trainer(engine.cluster, optimizer=sgd, sync=sync)
    try:
        history = tr.fit(steps=3)
        assert_on_engine_device(tr)
        assert all(r["loss"] > 0 for r in history)
        if sync != "easgd":
            assert worst(tr.state_dict(), serial(3, make=sgd)) <= ATOL[engine.kind]
    finally:
        tr.close()


@pytest.mark.parametrize("zero", [None, 1, 2, 3], ids=["default", "zero=1", "zero=2", "zero=3"])
def test_the_default_trainer_and_each_zero_stage_keep_every_tensor_on_the_engine_device(engine, zero):
    """The default Trainer (DDP over the engines: ZeRO-0), and ZeRO-1..3 over one replica, which runs the same code
    as over many (ZeroRedundancyOptimizer, FSDP2 units)."""
    tr = trainer(engine.cluster, plan=None if zero is None else {"dp": 1, "zero": zero})
    try:
        tr.fit(steps=3)
        assert_on_engine_device(tr)
        assert worst(tr.state_dict(), serial(3)) <= ATOL[engine.kind]
    finally:
        tr.close()


@pytest.mark.parametrize("plan", [{"tp": 2}, {"pp": 2, "microbatches": 2},
                                  {"pp": 2, "microbatches": 2, "schedule": "interleaved-1f1b", "chunks": 2}],
                         ids=["tp=2", "1f1b", "interleaved"])
def test_split_plans_train_on_the_engines_devices(pair, plan):
    tr = trainer(pair, plan=plan, clip=0.5)
    try:
        tr.fit(steps=3)
        assert_on_engine_device(tr)
        atol = ATOL["cuda" if pair.devices[0].startswith("cuda") else "cpu"]
        assert worst(tr.state_dict(), serial(3, clip=0.5)) <= atol
    finally:
        tr.close()


def test_clipping_trains_like_one_process_on_the_device(engine):
    tr = trainer(engine.cluster, clip=0.05)
    try:
        tr.fit(steps=3)
        assert worst(tr.state_dict(), serial(3, clip=0.05)) <= ATOL[engine.kind]
    finally:
        tr.close()


def test_a_checkpoint_saves_and_loads_on_the_device(engine, tmp_path):
    first = trainer(engine.cluster, checkpoint_dir=str(tmp_path))
    try:
        first.fit(steps=2)
        path = first.save()
        first.fit(steps=2)
        uninterrupted = first.state_dict()
    finally:
        first.close()
    resumed = trainer(engine.cluster)
    try:
        resumed.resume(path)
        assert resumed.step == 2
        resumed.fit(steps=2)
        assert_on_engine_device(resumed)
        assert worst(resumed.state_dict(), uninterrupted) <= 1e-6
    finally:
        resumed.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_the_device(engine, precision):
    """bf16 autocast, and fp16 with loss scaling: close to fp32, and really in half precision (not fp32)."""
    tr = trainer(engine.cluster, precision=precision)
    try:
        tr.fit(steps=3)
        assert_on_engine_device(tr)
        fp32 = serial(3)
        apart = worst(tr.state_dict(), fp32)
        assert apart < 5e-2, f"{precision}: {apart} from fp32"
        assert apart > 10 * ATOL["cpu"], f"{precision}: equal to fp32, so half precision was not used"
    finally:
        tr.close()


# -- a plan applied and stepped from the notebook ---------------------------------------------------------------------


def on_rank_sharded_devices(name: str) -> list[str]:
    from nbdist.runtime.ranks import placement, registry
    from nbdist.sharding.ranks import sharded

    model = registry.get(sharded.KIND, name)
    return placement.tensor_devices(model.model, model.optimizer)


def test_a_sharded_step_trains_on_the_engine_device(engine):
    dataset = data_fn()
    x, y = data.collate(dataset, data.batch_indices(len(dataset), 0, BATCH, 0))
    model = nbdist.shard(model_fn, dp=1, cluster=engine.cluster).apply(adam)
    try:
        loss = model.step(x, y, models.lm_loss)
        devices = engine.cluster.run(on_rank_sharded_devices, model.id)
        assert devices == [[engine.cluster.devices[0]]]
        reference = model_fn()
        expected = models.lm_loss(reference(x), y)
        expected.backward()
        assert loss == pytest.approx(expected.item(), abs=ATOL[engine.kind])
        grads = model.grads()
        assert max((grads[k] - p.grad).abs().max().item() for k, p in reference.named_parameters()) <= ATOL[
            engine.kind]
    finally:
        model.close()


def build_mlp(width: int = 64, layers: int = 4):
    import torch
    from torch import nn

    torch.manual_seed(0)
    body = []
    for i in range(layers):
        body += [nn.Linear(width, width)] + ([nn.Tanh()] if i < layers - 1 else [])
    return nn.Sequential(*body)


FASTEST_FP32 = 100e12  # FLOP/s: faster than any one device's fp32 matmul (an H200's is 67 TFLOP/s dense, TF32 off)


def test_a_sharded_steps_timeline_is_the_devices_time(engine):
    """A compute-heavy step's time on the device is at least its FLOPs at a speed no device reaches, fits inside the
    wall time of the call, and its forward and backward spans cover most of it. (Host clocks around queued CUDA
    kernels time their launches: about a millisecond for a step of 1.6 TFLOP, 16 ms at least on any GPU.)"""
    width, rows, layers = (4096, 4096, 4) if engine.kind == "cuda" else (512, 2048, 4)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    model = nbdist.shard(lambda: build_mlp(width, layers), dp=1, microbatches=2, cluster=engine.cluster).apply(sgd)
    try:
        model.step(x, y, torch.nn.functional.mse_loss)  # warm-up
        started = time.perf_counter()
        model.step(x, y, torch.nn.functional.mse_loss)
        wall = time.perf_counter() - started
        step = model.step_seconds()
        least = 6 * width * width * rows * layers / FASTEST_FP32  # forward 2, backward 4 FLOPs per weight and row
        compute = sum(span.duration for row in model.timeline.spans.values() for span in row)
        assert least <= step <= wall, f"a step of {step:.4f} s (at least {least:.4f} s) in a call of {wall:.4f} s"
        assert compute >= 0.5 * step, f"spans cover {compute:.4f} s of a {step:.4f} s step"
    finally:
        model.close()


class Hungry(torch.nn.Module):
    """A layer that asks for far more memory than any device has when the batch has `rows` rows."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows

    def forward(self, x):
        if x.shape[0] == self.rows:
            torch.empty(2**50, dtype=torch.uint8, device=x.device)  # 1 PiB
        return x


def hungry_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), Hungry(3), torch.nn.Linear(8, 1))


def test_an_allocation_that_fails_in_a_step_is_named_and_the_engine_stays_usable(engine):
    model = nbdist.shard(hungry_model, dp=1, cluster=engine.cluster).apply(sgd)
    try:
        with pytest.raises(DistError) as failed:  # a rank failed: the error design's one line, naming it
            model.step(torch.randn(3, 8), torch.randn(3, 1), torch.nn.functional.mse_loss)
        line = str(failed.value)
        assert "\n" not in line, line
        device = engine.cluster.devices[0]
        assert (f"rank 0 raised DistUsageError: rank 0 ({device}) ran out of memory during the forward of "
                f"micro-batch 0: an allocation of 1,048,576 GiB failed; ") in line, line
        loss = model.step(torch.randn(4, 8), torch.randn(4, 1), torch.nn.functional.mse_loss)  # the engine goes on
        assert loss > 0
    finally:
        model.close()


def regression_data():
    from nbdist import data

    return data.regression_dataset(samples=64, inputs=8, outputs=1)


@pytest.mark.parametrize("sync", ["allreduce", "local-sgd"])
def test_an_allocation_that_fails_in_a_trainers_step_is_named_and_the_engine_stays_usable(engine, sync):
    """The Trainer's loop on the ranks: a plan's model names the micro-batch's phase, a whole replica the step."""
    def fit(batch_size: int) -> list:
        tr = nbdist.Trainer(hungry_model, regression_data, torch.nn.functional.mse_loss, sgd, cluster=engine.cluster,
                            batch_size=batch_size, live=False, sync=sync)
        try:
            return tr.fit(steps=2)
        finally:
            tr.close()

    with pytest.raises(DistError) as failed:
        fit(batch_size=3)
    phase = "the forward of micro-batch 0" if sync == "allreduce" else "step 0"
    line = str(failed.value)
    assert f"({engine.cluster.devices[0]}) ran out of memory during {phase}: an allocation of 1,048,576 GiB" in line
    assert "\n" not in line
    assert len(fit(batch_size=4)) == 2


def test_a_plan_too_large_for_the_device_is_refused_before_anything_is_built(engine):
    plan = nbdist.shard(model_fn, dp=1, batch=2**26, cluster=engine.cluster)
    with pytest.raises(DistUsageError) as refused:
        plan.apply(adam)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"rank 0 ({engine.cluster.devices[0]}): this plan (predicted:"), line
    assert " needs " in line and " is free there" in line, line


# -- pipelines stepped by hand, measurement, torch's own sharding on one device ---------------------------------------


def test_stepper_clicks_on_the_device_equal_a_full_step(engine):
    x, y = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), torch.randn(32, 64)
    pipe = nbdist.pipeline(build_mlp, stages=1, schedule="1f1b", microbatches=4, cluster=engine.cluster)
    try:
        stepper = pipe.stepper(x, y, torch.nn.functional.mse_loss)
        clicks = 0
        while not stepper.done:
            stepper.next()
            clicks += 1
        assert clicks == stepper.total_ticks > 1
        reference = build_mlp()
        expected = torch.nn.functional.mse_loss(reference(x), y)
        expected.backward()
        assert stepper.loss == pytest.approx(expected.item(), abs=ATOL[engine.kind])
        grads = pipe.grads()
        assert max((grads[k] - p.grad).abs().max().item() for k, p in reference.named_parameters()) <= ATOL[
            engine.kind]
    finally:
        pipe.close()


def on_rank_sample() -> dict:
    from nbdist.runtime.ranks import placement
    from nbdist.training.ranks import telemetry

    sampler = telemetry.Sampler(placement.here())
    placement.to_here(torch.ones(1 << 20))  # something on the device
    return sampler.sample()


def test_telemetry_samples_the_engines_own_device(engine):
    sample = engine.cluster.run(on_rank_sample)[0]
    assert sample["rss_bytes"] > 0
    if engine.kind == "cpu":
        assert not any(k.startswith("gpu") for k in sample), sample
    else:
        assert sample["gpu_memory_bytes"] > 0, sample
        assert sample["gpu_percent"] is None or 0 <= sample["gpu_percent"] <= 100, sample


class Witness(torch.nn.Module):
    """A layer that notes the device of every input it sees (on the rank that runs it)."""

    seen: set = set()

    def forward(self, x):
        Witness.seen.add(str(x.device))
        return x


def witnessed_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), Witness(), torch.nn.Linear(16, 4))


def on_rank_witnessed() -> list[str]:
    return sorted(Witness.seen)


def on_rank_overheads(mesh: str) -> dict:
    from nbdist.sharding.ranks import timing

    return timing.mechanism_costs(mesh, tp=1, zero_stage=0, optimizer="adam", repeats=2)


def test_the_plan_profiles_on_the_engine_device(engine):
    """The layer times and the libraries' overheads a plan predicts from are measured on the engine's device (the
    profile used to time a CPU copy of the model on a GPU engine)."""
    plan = nbdist.shard(witnessed_model, dp=1, cluster=engine.cluster).profile(repeats=2)
    assert all(layer.forward_s > 0 and layer.backward_s >= 0 for layer in plan.layers)
    assert plan.overheads.optimizer_per_param > 0 and plan.predicted_step().total_s > 0
    device = engine.cluster.devices[0]
    assert engine.cluster.run(on_rank_witnessed) == [[device]]
    mesh = engine.cluster.mesh(dp=1, tp=1)
    assert engine.cluster.run(on_rank_overheads, mesh.name)[0]["device"] == device


def on_rank_memory_total() -> int:
    from nbdist.runtime.ranks import placement

    return placement.free_bytes()[1]


def test_the_local_hardware_profile_measures_one_engine_on_its_device(engine):
    profile = nbdist.planner.hardware("local", cluster=engine.cluster)
    assert profile.peak("fp32") > 0 and profile.memory_bandwidth > 0
    assert profile.intra_host.name.startswith("none: one engine")
    if engine.kind == "cuda":
        assert profile.memory_bytes == engine.cluster.run(on_rank_memory_total)[0]
        assert profile.peak("bf16") > profile.peak("fp32")


def on_rank_clip(max_norm: float) -> dict:
    import torch

    from nbdist.runtime.ranks import placement
    from nbdist.training.ranks.training import clip_gradients

    device = placement.here()
    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(5, 3, device=device)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    for a, b in zip(mine, theirs):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    norm = clip_gradients(mine, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    return {"norm_device": str(norm.device), "norm": float(norm), "expected": float(expected),
            "grads_apart": max((a.grad - b.grad).abs().max().item() for a, b in zip(mine, theirs)),
            "grad_devices": sorted({str(p.grad.device) for p in mine})}


def test_clipping_stays_on_the_device_and_matches_torch(engine):
    got = engine.cluster.run(on_rank_clip, 0.5)[0]
    device = engine.cluster.devices[0]
    assert got["norm_device"] == device and got["grad_devices"] == [device], got
    assert got["norm"] == pytest.approx(got["expected"], rel=1e-6) and got["grads_apart"] <= 1e-6, got


def on_rank_torch_sharding() -> dict:
    """FSDP2 (fully_shard) and DTensor tensor parallelism over a one-device mesh on this rank's device, each against
    the same model run plain: forward and gradients."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from nbdist.runtime.ranks import placement
    from nbdist.runtime.ranks.compat import fully_shard

    device = placement.here()
    mesh = init_device_mesh(device.type, (1,))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    x = torch.randn(8, 16, device=device)
    plain(x).sum().backward()
    out = {}
    for name in ("fsdp2", "dtensor"):
        model = copy.deepcopy(plain)
        model.zero_grad(set_to_none=True)
        if name == "fsdp2":
            fully_shard(model, mesh=mesh)
        else:
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model(x).sum().backward()
        apart = 0.0
        for (key, p), q in zip(model.named_parameters(), plain.parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            apart = max(apart, (grad - q.grad).abs().max().item())
            out[f"{name} {key} device"] = str(getattr(p, "_local_tensor", p).device)
        out[name] = apart
    return out


def test_torchs_fsdp2_and_dtensor_on_one_device_equal_the_plain_model(engine):
    got = engine.cluster.run(on_rank_torch_sharding)[0]
    assert got["fsdp2"] <= 1e-6 and got["dtensor"] <= 1e-6, got
    assert {v for k, v in got.items() if k.endswith("device")} == {engine.cluster.devices[0]}, got
    assert_device(engine, engine.cluster.devices[0])

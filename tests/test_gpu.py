"""nbdist's promises on one GPU, checked on a one-engine cluster the way a user starts one (what
scripts/gpu_check.py used to check): the engine computes on cuda:0 with nccl, the kernel holds no CUDA context,
collectives of CUDA and of CPU tensors are exact, the collectives benchmark checks every result, DDP with every hook
equals the model run without DDP, and `-n 2` on one GPU is refused in one line.

Every check with a CPU meaning also runs on a CPU engine (mpi4py): the `cpu` cases run everywhere, the `cuda` ones
are marked `gpu` and skipped, with the reason, where CUDA is absent (`pytest -m gpu` runs them on a GPU machine).
tests/test_gpu_paths.py holds the pipeline, the stuck cell and what is left after stop.
"""
from __future__ import annotations

import pytest
from gpu_engines import (
    assert_device,
    assert_no_cuda_context_in_kernel,
    cuda_only,
    on_rank_collectives,
    skip_without_cuda,
)

import nbdist
from nbdist.cluster.options import ClusterOptions, visible_gpus
from nbdist.data_parallel.ranks.hooks import HOOKS

pytestmark = pytest.mark.cluster  # starts real MPI engines (one-engine clusters of its own)

EXACT_ATOL = 1e-6  # gradients that should be bit-equal: room for a GPU's reordered sums, nothing more
OPS = ("all_reduce", "all_gather", "broadcast")


# -- the engine's device, the kernel without CUDA ---------------------------------------------------------------------


def test_engine_on_device(engine):
    """The status table says where the engine computes: cuda:0 and nccl on a GPU, cpu and mpi4py on CPU."""
    rows = [{k: row[k] for k in ("rank", "device", "backend", "pid")} for row in engine.cluster.status().rows]
    versions = engine.cluster.run(on_rank_versions, timeout=60)[0]
    want_device, want_backend = ("cuda:0", "nccl") if engine.kind == "cuda" else ("cpu", "mpi4py")
    assert len(rows) == 1, rows
    wrong = [r for r in rows if r["device"] != want_device or want_backend not in r["backend"]]
    assert not wrong, f"expected device {want_device} with {want_backend}, the status rows say {rows} ({versions})"
    assert versions["device"] == want_device, versions


@cuda_only
def test_kernel_has_no_cuda_context(engine):
    """The kernel (this process) never initialised CUDA, and NVML lists the engine but not the kernel."""
    assert_no_cuda_context_in_kernel(engine.cluster)


# -- collectives on CUDA and CPU tensors ------------------------------------------------------------------------------


def assert_collectives_exact(engine, where: str) -> None:
    report = engine.cluster.run(on_rank_collectives, where, timeout=60)[0]
    want = engine.kind if where == "engine" else "cpu"
    assert report["device"].startswith(want), f"ran on {report['device']}, not on {want}: {report}"
    assert report["ops"] == dict.fromkeys(OPS, "ok"), f"on {report['device']} with backend {report['backend']}: {report}"


@cuda_only
def test_collectives_of_cuda_tensors_are_exact(engine):
    """CUDA tensors on the engine's process group (NCCL): all_reduce, all_gather, broadcast give the exact result."""
    assert_collectives_exact(engine, "engine")


def test_collectives_of_cpu_tensors_are_exact(engine):
    """CPU tensors on the same process group: with nccl alone torch has no backend for them (cpu:gloo beside
    cuda:nccl)."""
    assert_collectives_exact(engine, "cpu")


# -- the collectives benchmark ----------------------------------------------------------------------------------------


def test_collectives_benchmark_checks_every_result(engine):
    """The project's own sweep, every op, small sizes, every result checked by the benchmark itself, on nccl (CUDA
    tensors) or mpi4py (CPU)."""
    want = "nccl" if engine.kind == "cuda" else "mpi4py"
    rows = nbdist.collectives.benchmark(sizes=[4096, 2**20], via="torch", cluster=engine.cluster, warmup=2,
                                        target_seconds=0.02).to_dicts()
    shown = [{k: r[k] for k in ("op", "size_bytes", "seconds", "busbw", "iters", "checked", "backend", "note")}
             for r in rows]
    assert shown, "the benchmark returned no rows"
    # a row's backend is the one that carried its buffers: "nccl" only when they were CUDA tensors
    bad = [r for r in shown if r["backend"] != want or not r["checked"] or not r["seconds"]]
    assert not bad, f"{len(bad)} of {len(rows)} rows not measured and checked on {want}: {bad}"
    assert {r["size_bytes"] for r in shown} == {4096, 2**20}, shown


# -- DDP with every hook ----------------------------------------------------------------------------------------------


def test_ddp_with_every_hook_equals_the_model_without_ddp(engine):
    """Every hook nbdist offers, on the engine's device: equal to the same model without DDP (one rank averages
    nothing), compressed hooks within their dtype's rounding; on CUDA the MPI hooks (CPU tensors only) must refuse
    in one line instead. PowerSGD's first two steps are plain all-reduces (start_iter 2): compared there."""
    device, results = engine.cluster.run(on_rank_ddp_hooks, 2, EXACT_ATOL, timeout=120)[0]
    assert_device(engine, device)
    assert set(results) == {"auto", *HOOKS}, sorted(results)
    wrong = {n: r for n, r in results.items() if r["outcome"] not in ("equal", "refused")}
    assert not wrong, f"differs or failed on {device}: {wrong}"
    refused = {n: r["message"] for n, r in results.items() if r["outcome"] == "refused"}
    if engine.kind == "cpu":
        assert not refused, f"refused on CPU: {refused}"
    bad_refusals = {n: m for n, m in refused.items() if "CPU" not in m or "\n" in m}
    assert not bad_refusals, f"refused without naming CPU tensors in one line: {bad_refusals}"
    assert any(r["outcome"] == "equal" for r in results.values()), results


# -- -n 2 on one GPU --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_two_engines_on_one_gpu_are_refused_in_one_line(monkeypatch):
    """`%dist_start -n 2` where one GPU is visible: refused before anything starts, in one line naming NCCL's one GPU
    per rank (not the memory limit). On a machine with more GPUs, CUDA_VISIBLE_DEVICES shows one."""
    skip_without_cuda()
    if visible_gpus() > 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(nbdist.DistUsageError) as refused:
        nbdist.Cluster(ClusterOptions(n=2))  # what nbdist.start(2) validates first; starts nothing
    message = str(refused.value)
    said = message.lower()
    assert "nccl" in said and ("per gpu" in said or "gpu per" in said), message
    assert "GiB" not in message and "\n" not in message, message


# -- on the rank ------------------------------------------------------------------------------------------------------


def on_rank_versions() -> dict:
    """What the engine runs: torch, its CUDA and NCCL, the device's name (each feature-tested: any torch)."""
    import torch

    from nbdist.cluster.launching.ranks.boot import boot

    out = {"torch": torch.__version__, "cuda": getattr(torch.version, "cuda", None), "device": boot().device}
    if out["device"].startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name(torch.device(out["device"]))
        nccl = getattr(getattr(torch.cuda, "nccl", None), "version", None)
        version = nccl() if callable(nccl) else None  # a tuple on recent torch, an int on old ones
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    return out


def on_rank_ddp_hooks(steps: int, atol: float) -> tuple[str, dict]:
    """hook name -> outcome: "equal" (to the same model run without DDP, `steps` steps, the largest difference),
    "refused" (nbdist's one-line DistUsageError), or "differs" / "error"; and the device it ran on."""
    import copy

    import torch
    from torch import nn

    from nbdist.cluster.launching.ranks.boot import boot
    from nbdist.data_parallel.ranks import hooks
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

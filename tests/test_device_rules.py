"""The device rules that hold on GPUs this machine does not have, tried here as pure functions of the numbers:
which device the GPU-sync thread waits for (cluster/waiting/ranks/gpu_sync.py), which NVML device a CUDA index is under
any CUDA_VISIBLE_DEVICES (runtime/ranks/devices.py nvml_device, used by boot.py and the training telemetry), what
the telemetry reports where NVML gives no utilisation, the hardware profiles' memory units (cost/hardware.py), and
where FSDP2's fully_shard is found (runtime/ranks/compat.py), and the mpi4py backend's refusal of tensors that are
not in CPU memory (backend/ranks/mpi_data.py on_cpu), on real engines.

Each GPU path has a CPU twin here (NVML and CUDA calls replaced by recorders and a fake NVML), and a check marked
`gpu` that runs the real path on a CUDA engine where there is one.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types

import pynvml
import pytest
import torch
from gpu_engines import cuda_only, skip_without_cuda, start_cluster

from nbdist.cluster.launching.ranks import boot as booting
from nbdist.cluster.waiting.ranks import gpu_sync
from nbdist.cost import hardware
from nbdist.errors import DistUsageError
from nbdist.runtime.ranks import compat, rank
from nbdist.runtime.ranks.devices import nvml_device
from nbdist.training.ranks import telemetry
from nbdist.viz.training import trace_values, training_figure

UUIDS = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-bbbc3333", "GPU-cccc4444"]  # NVML's order: index i is UUIDS[i]

# -- E: the GPU-sync thread waits for the rank's own device -----------------------------------------------------------


def test_the_sync_thread_synchronises_the_device_the_rank_was_bound_to():
    assert gpu_sync.device_to_synchronise("cuda:3") == torch.device("cuda", 3)
    assert gpu_sync.device_to_synchronise("cuda:0") == torch.device("cuda", 0)
    assert gpu_sync.device_to_synchronise("cpu") is None


def booted_on(monkeypatch, device: str) -> None:
    """This process seen as a rank booted on `device` (what boot registers and this_rank() reads)."""
    info = booting.RankInfo(0, 1, 0, "h", 1, device, "cpu:gloo,cuda:nccl", 0.0)
    monkeypatch.setattr(booting, "boot", lambda: info)
    monkeypatch.setattr(rank, "this_rank", lambda: info)


def test_synchronise_names_the_ranks_device_in_its_thread(monkeypatch):
    """CPU twin of a rank bound to cuda:3: a bare torch.cuda.synchronize() in the new thread would wait for cuda:0
    (a thread's current device), so the call must name the rank's device."""
    booted_on(monkeypatch, "cuda:3")
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    assert gpu_sync.synchronise(10.0) is True
    assert calls == [torch.device("cuda", 3)]


def test_synchronise_on_a_cpu_rank_is_true_at_once_and_touches_no_cuda(monkeypatch):
    booted_on(monkeypatch, "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronised CUDA on a CPU rank"))
    started = time.perf_counter()
    assert gpu_sync.synchronise(10.0) is True
    assert time.perf_counter() - started < 0.5


def on_rank_synchronise() -> dict:
    """Synchronise as gpu_sync does after a failure, recording which device the thread was asked to wait for."""
    import time

    import torch

    from nbdist.cluster.launching.ranks.boot import boot
    from nbdist.cluster.waiting.ranks import gpu_sync

    real, asked = torch.cuda.synchronize, []

    def spy(device=None):
        asked.append(None if device is None else str(device))
        return real(device)

    torch.cuda.synchronize = spy
    try:
        started = time.perf_counter()
        done = gpu_sync.synchronise(60.0)
        return {"done": done, "asked": asked, "device": boot().device, "seconds": time.perf_counter() - started}
    finally:
        torch.cuda.synchronize = real


def test_synchronise_on_real_engines_waits_for_the_engines_device(engine):
    report = engine.cluster.run(on_rank_synchronise, timeout=120)[0]
    assert report["done"] is True, report
    if engine.kind == "cpu":
        assert report["asked"] == [] and report["seconds"] < 0.5, report
    else:
        assert report["asked"] == [report["device"]], report


# -- F: CUDA index -> NVML device, under any CUDA_VISIBLE_DEVICES ----------------------------------------------------


@pytest.mark.parametrize(("visible", "expected"), [
    (None, [0, 1, 2, 3]),  # unset: CUDA's order is NVML's
    ("3,1", [3, 1]),  # reordered and hidden: CUDA's 0 is NVML's 3
    ("2", [2]),
    (" 1 , 0", [1, 0]),  # spaces
    ("1gpu2,0", [1, 0]),  # read like strtoul: the leading digits
    ("+2,0", [2, 0]),
    ("0,-1,2", [0]),  # a negative entry ends the list
    ("0,x,2", [0]),  # so does an unreadable one
    ("0,7,1", [0]),  # and an index beyond NVML's count
    ("0,1,0", []),  # a device named twice: none shown
    ("", []),
    ("-1", []),
    ("GPU-bbbc", [2]),  # a UUID prefix naming one GPU
    ("GPU-cccc4444,GPU-aaaa1111", [3, 0]),  # full UUIDs, reordered
    ("GPU-bbb,GPU-aaaa", []),  # an ambiguous prefix ends the list at once
    ("GPU-aaaa,GPU-bbb", [0]),  # ... or where it stands
    ("GPU-aaaa,GPU-zzzz,GPU-cccc", [0]),  # as does one that matches nothing
    ("GPU-aaaa,1", [0]),  # a UUID list ends at the first entry of another form
    ("1,GPU-aaaa", [1]),  # and an ordinal list at a UUID
    ("GPU-aaaa,GPU-aaaa1", []),  # one GPU named twice, by two prefixes
    ("MIG-5f2d-1,MIG-77aa-2", ["MIG-5f2d-1", "MIG-77aa-2"]),  # MIG instances: their own UUIDs, not the parent
    ("MIG-5f2d-1,0", ["MIG-5f2d-1"]),
    ("MIG-5f2d-1,MIG-5f2d-1", []),
])
def test_cuda_index_to_nvml_device(visible, expected):
    got = [nvml_device(i, visible, UUIDS) for i in range(len(expected) + 2)]
    assert got == expected + [None, None], f"CUDA_VISIBLE_DEVICES={visible!r}"
    assert nvml_device(-1, visible, UUIDS) is None


FORMS = [None, "3,1", "2", "1gpu2,0", "0,-1,2", "0,7,1", "0,1,0", "", "-1", "GPU-bbbc", "GPU-cccc4444,GPU-aaaa1111",
         "GPU-bbb,GPU-aaaa", "GPU-aaaa,GPU-zzzz", "GPU-aaaa,1", "1,GPU-aaaa", "GPU-aaaa,GPU-aaaa1", "MIG-x,MIG-y"]


def torch_says(visible: str | None, monkeypatch) -> list:
    """torch's own reading (its private parser, which follows CUDA's): the NVML indices CUDA shows, in order."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    parsed = torch.cuda._parse_visible_devices()
    if parsed and isinstance(parsed[0], str):
        return list(parsed) if parsed[0].startswith("MIG-") else torch.cuda._transform_uuid_to_ordinals(parsed, UUIDS)
    shown = []
    for index in parsed:  # as torch.cuda._device_count_nvml: the list ends at an index NVML does not have
        if index >= len(UUIDS):
            break
        shown.append(index)
    return shown


@pytest.mark.parametrize("visible", FORMS)
def test_the_mapping_agrees_with_torchs_own_parser(visible, monkeypatch):
    if not hasattr(torch.cuda, "_parse_visible_devices") or not hasattr(torch.cuda, "_transform_uuid_to_ordinals"):
        pytest.skip("this torch has no private CUDA_VISIBLE_DEVICES parser to compare with")
    expected = torch_says(visible, monkeypatch)
    assert [nvml_device(i, visible, UUIDS) for i in range(len(expected) + 1)] == expected + [None]


def fake_nvml(processes: dict | None = None) -> types.ModuleType:
    """NVML on a machine whose GPUs have UUIDS; handles are ("index", i) or ("uuid", u); `processes` per handle."""
    fake = types.ModuleType("pynvml")
    fake.__dict__.update(
        NVMLError=pynvml.NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(UUIDS), nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
        nvmlDeviceGetUUID=lambda handle: UUIDS[handle[1]], nvmlDeviceGetHandleByUUID=lambda uuid: ("uuid", uuid),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: (processes or {}).get(handle, []))
    return fake


@pytest.mark.parametrize(("visible", "cuda_index", "handle"), [
    (None, 1, ("index", 1)), ("3,1", 0, ("index", 3)), ("3,1", 1, ("index", 1)), ("3,1", 2, None),
    ("GPU-cccc", 0, ("index", 3)), ("MIG-5f2d-1", 0, ("uuid", "MIG-5f2d-1")),
])
def test_boot_and_telemetry_open_the_same_nvml_device(visible, cuda_index, handle, monkeypatch):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    fake = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert booting.nvml_handle(fake, cuda_index) == handle
    assert telemetry._nvml_handle(torch.device("cuda", cuda_index)) == handle


def test_the_process_bytes_boot_reports_are_those_of_the_ranks_nvml_device(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=3,1 the rank on cuda:0 holds memory on NVML's GPU 3, not on GPU 0."""
    me = types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=7 * 2**20)
    other = types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=99 * 2**20)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({("index", 3): [me], ("index", 0): [other]}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert booting._nvml_process_bytes(0) == 7 * 2**20
    assert booting._nvml_process_bytes(2) is None  # CUDA shows no third device


# -- F: telemetry where NVML gives no utilisation -------------------------------------------------------------------


def test_a_cpu_sampler_reports_no_gpu_figures():
    sample = telemetry.Sampler(torch.device("cpu")).sample()
    assert sample["rss_bytes"] > 0 and "cpu_percent" in sample
    assert not [k for k in sample if k.startswith("gpu")], sample


def nvml_reporting(monkeypatch, utilisation) -> None:
    def rates(handle):
        if isinstance(utilisation, Exception):
            raise utilisation
        return types.SimpleNamespace(gpu=utilisation)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", rates)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: types.SimpleNamespace(used=123 * 2**20))


@pytest.mark.parametrize("error", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_UNKNOWN])
def test_utilisation_nvml_cannot_give_is_none_and_memory_stays(monkeypatch, error):
    """Under MIG (and on some drivers) NVML raises NotSupported for utilisation: None, not 0, not a crash."""
    nvml_reporting(monkeypatch, pynvml.NVMLError(error))
    sampler = telemetry.Sampler(torch.device("cpu"))
    sampler.nvml = ("uuid", "MIG-5f2d-1")  # what a GPU engine under MIG holds (CPU twin)
    sample = sampler.sample()
    assert sample["gpu_percent"] is None and sample["gpu_memory_bytes"] == 123 * 2**20, sample


def test_utilisation_nvml_gives_is_a_float(monkeypatch):
    nvml_reporting(monkeypatch, 42)
    assert telemetry.gpu_figures(("index", 0)) == {"gpu_percent": 42.0, "gpu_memory_bytes": 123 * 2**20}


def test_the_dashboard_draws_a_rank_whose_utilisation_is_unknown():
    records = [{"step": s, "loss": 1.0 / (s + 1), "samples": 8, "seconds": 0.1, "ranks": {
        r: {"compute_s": 0.06, "comm_s": 0.03, "idle_s": 0.01, "started": s, "ended": s + 0.1} for r in (0, 1)}}
        for s in range(3)]
    figures = {0: {"cpu_percent": 90.0, "rss_bytes": 1, "gpu_percent": None, "gpu_memory_bytes": 5 * 2**30},
               1: {"cpu_percent": 90.0, "rss_bytes": 1, "gpu_percent": 55.0, "gpu_memory_bytes": 6 * 2**30}}
    busy, held = trace_values(records, figures)[-2:]
    assert busy["y"] == [None, 55.0] and held["y"] == [5 * 2**30, 6 * 2**30]
    figure = json.loads(training_figure(records, figures).to_json())
    assert [t["name"] for t in figure["data"]][-2:] == ["GPU %", "GPU memory"]


def on_rank_nvml_identity() -> dict:
    """Which GPU the telemetry's and boot's NVML handles name, against the UUID CUDA gives the rank's device."""
    import pynvml
    import torch

    from nbdist.cluster.launching.ranks.boot import nvml_handle
    from nbdist.runtime.ranks import placement
    from nbdist.training.ranks import telemetry

    device = placement.here()
    sampler = telemetry.Sampler(device)
    pynvml.nvmlInit()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return {"cuda": None if uuid is None else str(uuid), "sample": sampler.sample(),
            "telemetry": pynvml.nvmlDeviceGetUUID(sampler.nvml),
            "boot": pynvml.nvmlDeviceGetUUID(nvml_handle(pynvml, device.index))}


def gpu_uuids() -> list[str]:
    pynvml.nvmlInit()
    try:
        return [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["last ordinal", "last uuid prefix"])
def test_a_gpu_engine_reads_its_own_gpu_under_cuda_visible_devices(form, monkeypatch):
    """An engine shown only the machine's last GPU (CUDA's 0 is NVML's last) reads that GPU's figures."""
    skip_without_cuda()
    uuids = gpu_uuids()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(len(uuids) - 1) if form == "last ordinal" else uuids[-1][:12])
    cluster = start_cluster("cuda")
    try:
        seen = cluster.run(on_rank_nvml_identity, timeout=120)[0]
    finally:
        cluster.stop()
    assert seen["telemetry"] == seen["boot"] == uuids[-1], seen
    assert seen["cuda"] is None or uuids[-1].endswith(seen["cuda"]), seen
    assert seen["sample"]["gpu_memory_bytes"] > 0, seen


# -- I: the mpi4py backend refuses tensors not in CPU memory ----------------------------------------------------------

def refuses_tensors_not_in_cpu_memory() -> dict:
    """On each of 2 ranks: the check itself on several argument shapes, then every operation of the default
    (mpi4py) group given a "meta" tensor (not in CPU memory, as a CUDA tensor is not), then an all-reduce on the
    same group, which must be in step still: every refusal came before anything was posted."""
    import torch
    import torch.distributed as dist

    from nbdist.backend.ranks import mpi_data
    from nbdist.errors import DistUsageError

    meta, r = torch.ones(2, device="meta"), dist.get_rank()
    peer, cpu = 1 - r, (lambda: torch.ones(2))

    def refusal(call) -> str | None:
        try:
            call()
        except DistUsageError as refused:
            return str(refused)
        return None

    shapes = {"tensor": (meta,), "list": ([cpu(), meta],), "list of lists": ([cpu()], [[cpu(), meta]]),
              "cpu only": ([cpu()], [[cpu(), cpu()]], cpu(), [])}
    ops = {
        "all_reduce": lambda: dist.all_reduce(meta),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([cpu(), meta]),
        "reduce": lambda: dist.reduce(meta, 0),
        "reduce_scatter": lambda: dist.reduce_scatter(cpu(), [meta, meta]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(cpu(), torch.ones(4, device="meta")),
        "broadcast": lambda: dist.broadcast(meta, 0),
        "all_gather": lambda: dist.all_gather([cpu(), cpu()], meta),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.ones(4, device="meta"), cpu()),
        "gather": lambda: dist.gather(meta, [cpu(), cpu()] if r == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(meta, [cpu(), cpu()] if r == 0 else None, src=0),
        "all_to_all_single": lambda: dist.all_to_all_single(meta, cpu()),
        "all_to_all": lambda: dist.all_to_all([cpu(), cpu()], [meta, meta]),
        "send": lambda: dist.send(meta, peer),
        "recv": lambda: dist.recv(meta, peer),
    }
    after = torch.ones(2) * (r + 1)
    refused = {op: refusal(call) for op, call in ops.items()}
    dist.all_reduce(after)
    # What torch asks a new group bound to a GPU (see test_cuda_tensors_on_an_mpi4py_group_are_refused) before any
    # tensor: its backend on that device, and whether it splits. Here the question, on CPU.
    group = dist.distributed_c10d._get_default_group()
    asked = [group._get_backend(torch.device(d)) is group for d in ("cuda:0", "meta", "cpu")]
    return {"backend": dist.get_backend(), "after": after.tolist(), "refused": refused,
            "its own backend, no split": asked + [group._get_backend(torch.device("cuda:0")).supports_splitting],
            "shapes": {name: refusal(lambda a=a: mpi_data.on_cpu("all_gather", a)) for name, a in shapes.items()}}


def cuda_tensors_on_an_mpi4py_group() -> dict:
    """On a GPU engine: CUDA tensors given to an mpi4py group. Unchecked, an all-gather into another buffer has
    MPI copy from a device pointer as host memory (a crash, or garbage)."""
    import torch
    import torch.distributed as dist

    from nbdist.backend.ranks import mpi_backend
    from nbdist.errors import DistUsageError

    mpi_backend.register()
    group = dist.new_group(list(range(dist.get_world_size())), backend="mpi4py")
    n, said = dist.get_world_size(), {}
    calls = {"all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
        torch.empty(2 * n, device="cuda"), torch.ones(2, device="cuda"), group=group),
        "all_reduce": lambda: dist.all_reduce(torch.ones(2, device="cuda"), group=group)}
    try:
        for op, call in calls.items():
            try:
                call()
                said[op] = "accepted"
            except DistUsageError as refused:
                said[op] = str(refused)
    finally:
        dist.destroy_process_group(group)
    return said


NOT_CPU = ("the mpi4py backend moves CPU tensors only (its MPI is not CUDA-aware); use the nccl backend (GPU engines "
           "start with it by default), or move the tensor to CPU first (.cpu())")


def test_tensors_not_in_cpu_memory_are_refused_in_one_line_by_every_operation(cluster):
    for rank, seen in enumerate(cluster.run(refuses_tensors_not_in_cpu_memory, timeout=120)):
        assert seen["backend"] == "mpi4py", seen
        assert seen["shapes"].pop("cpu only") is None, seen
        for shape, message in seen["shapes"].items():
            assert message == f"mpi4py all_gather: a tensor on meta, but {NOT_CPU}", (rank, shape)
        for op, message in seen["refused"].items():
            assert message == f"mpi4py {op}: a tensor on meta, but {NOT_CPU}", (rank, op)
        assert seen["after"] == [3.0, 3.0], f"rank {rank}: the group is out of step after the refusals"
        assert seen["its own backend, no split"] == [True, True, True, False], (rank, seen)


@cuda_only
def test_cuda_tensors_on_an_mpi4py_group_are_refused(engine):
    said = engine.cluster.run(cuda_tensors_on_an_mpi4py_group, timeout=120)[0]
    for op, message in said.items():
        assert message == f"mpi4py {op}: a tensor on cuda:0, but {NOT_CPU}", said


# -- J: memory units of the hardware profiles; where fully_shard lives ------------------------------------------------

# What the cards report (bytes), each a little under its datasheet capacity (the driver keeps some): CUDA's total on
# an A100-SXM4-80GB and an A100 40GB, nvidia-smi's total (MiB) on an H100 80GB and an H200.
REPORTED = {"a100-80gb": 85_056_798_720, "a100-40gb": 42_405_855_232, "h100-sxm": 81559 * 2**20,
            "h200": 143771 * 2**20}


def test_every_profiles_memory_is_its_datasheet_figure_in_its_unit():
    assert set(hardware.MEMORY_GB) == set(hardware.PROFILES)
    for name, profile in hardware.PROFILES.items():
        assert profile.memory_bytes == hardware.MEMORY_GB[name] * 2**30, name  # datasheet GB of memory = GiB


@pytest.mark.parametrize("name", sorted(REPORTED))
def test_a_profile_holds_what_the_card_reports_plus_less_than_a_gib(name):
    """A GB read as 1e9 would put the H200 at 131 GiB, below the 140.4 GiB the card reports."""
    assert 0 <= hardware.PROFILES[name].memory_bytes - REPORTED[name] < 2**30, name


def test_fully_shard_is_found_on_the_public_path_first():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    assert compat.fully_shard is fully_shard and compat.FSDPModule is FSDPModule


def test_fully_shard_falls_back_to_the_private_path_of_torch_before_2_6(monkeypatch):
    public, private = types.ModuleType("fake_public_fsdp"), types.ModuleType("fake_private_fsdp")
    private.fully_shard = object()
    monkeypatch.setitem(sys.modules, "fake_public_fsdp", public)
    monkeypatch.setitem(sys.modules, "fake_private_fsdp", private)
    assert compat.fsdp2("fully_shard", ("fake_public_fsdp", "fake_private_fsdp")) is private.fully_shard


def test_no_fully_shard_anywhere_is_one_line_naming_the_torch_and_the_minimum():
    with pytest.raises(DistUsageError) as refused:
        compat.fsdp2("fully_shard", ("nbdist_no_such_module", "nbdist_no_such_module.fsdp"))
    message = str(refused.value)
    assert "\n" not in message and torch.__version__ in message and ">= 2.4" in message, message
    with pytest.raises(AttributeError):
        compat.not_a_torch_name  # noqa: B018


def test_zero_takes_fully_shard_from_compat():
    import inspect

    from nbdist.data_parallel.ranks import zero

    assert "from nbdist.runtime.ranks.compat import fully_shard" in inspect.getsource(zero.shard)

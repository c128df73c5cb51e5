"""Devices and backends (nbdist/runtime/ranks/devices.py, boot.py, cluster/options.py): one GPU per engine, "cpu:gloo,cuda:nccl"
on GPU engines, honest refusals.

No GPU here, so the GPU rules are checked with the GPU count injected (they are pure functions of it), and what
CPU allows runs for real: a 2-engine cluster's CPU collectives and status row, a process group initialised with
torch's device-map form ("cpu:gloo") on the real engines, read by every backend-name check nbdist makes, the
renamed DDP hook ("torch", formerly "gloo") equal to serial training, and an engine-side refusal reaching the
kernel from real engines.
"""
import inspect
import re

import pynvml
import pytest
import torch
import torch.distributed as dist
from test_hooks import assert_params_close, build_model, serial

import nbdist
from nbdist.cluster.api import Status
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistError, DistUsageError
from nbdist.runtime.ranks import devices
from nbdist.runtime.ranks.devices import (
    CPU_BACKEND,
    CPU_ENGINE,
    GPU_BACKEND,
    MPI_ENGINE,
    Binding,
    backend_for,
    bind,
    check_world,
)

# -- which device, which backend (GPU count injected) ------------------------------------------------------------


@pytest.mark.parametrize("cpu", [False, True])
def test_gloo_means_a_cpu_engine_on_gloo_whatever_the_gpus(cpu):
    for gpus in (0, 1, 8):
        assert bind("gloo", cpu, local_rank=0, ranks_on_host=2, gpus=gpus, host="h") == Binding("cpu", "gloo")


def test_cpu_means_a_cpu_engine_on_the_mpi_backend_whatever_the_gpus():
    for gpus in (0, 1, 8):
        assert bind("auto", True, local_rank=0, ranks_on_host=2, gpus=gpus, host="h") == MPI_ENGINE


def test_mpi_means_a_cpu_engine_on_nbdists_mpi_backend_whatever_the_gpus():
    for gpus in (0, 1, 8):
        assert bind("mpi", False, local_rank=0, ranks_on_host=2, gpus=gpus, host="h") == Binding("cpu", "mpi4py")


def test_auto_without_gpus_is_a_cpu_engine_on_the_mpi_backend():
    """The CPU default is nbdist's torch.distributed over MPI (backend/ranks/mpi_backend.py), gloo only when asked for."""
    assert bind("auto", False, local_rank=1, ranks_on_host=2, gpus=0, host="h") == MPI_ENGINE == Binding("cpu", "mpi4py")
    assert MPI_ENGINE.gpu_index is None and CPU_ENGINE.gpu_index is None and CPU_BACKEND == "gloo"


@pytest.mark.parametrize("requested", ["auto", "nccl"])
def test_gpu_engines_get_one_gpu_per_local_rank_and_keep_gloo_for_cpu_tensors(requested):
    chosen = [bind(requested, False, local_rank=r, ranks_on_host=4, gpus=4, host="h") for r in range(4)]
    assert [b.device for b in chosen] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [b.gpu_index for b in chosen] == [0, 1, 2, 3]
    assert {b.backend for b in chosen} == {"cpu:gloo,cuda:nccl"} == {GPU_BACKEND}
    assert bind(requested, False, local_rank=0, ranks_on_host=1, gpus=8, host="h").device == "cuda:0"


@pytest.mark.parametrize("requested", ["auto", "nccl"])
def test_more_ranks_than_gpus_on_a_host_is_refused_naming_host_and_counts(requested):
    with pytest.raises(DistUsageError) as refused:
        bind(requested, False, local_rank=2, ranks_on_host=3, gpus=2, host="node7")
    assert str(refused.value) == (
        "host node7 runs 3 ranks but has 2 GPU(s) visible: NCCL runs one rank per GPU; start at most 2 engine(s) "
        "there, or use --cpu / --backend gloo for CPU engines")


@pytest.mark.parametrize("requested, cpu, gpus, message", [
    ("nccl", False, 0, "--backend nccl needs GPUs and host node7 has none visible; use --backend gloo"),
    ("nccl", True, 4, "--cpu and --backend nccl contradict each other: NCCL needs GPUs"),
    ("ucc", False, 4, "unknown backend 'ucc': choose one of auto, gloo, nccl, mpi"),
])
def test_impossible_requests_are_refused_in_one_line(requested, cpu, gpus, message):
    with pytest.raises(DistUsageError, match=f"^{re.escape(message)}$"):
        bind(requested, cpu, local_rank=0, ranks_on_host=1, gpus=gpus, host="node7")


def test_one_refusal_stops_every_rank_with_the_same_line():
    gpu = Binding("cuda:0", GPU_BACKEND)
    refusal = "host b runs 2 ranks but has 1 GPU(s) visible: NCCL runs one rank per GPU; ..."
    with pytest.raises(DistUsageError, match=f"^{re.escape(refusal)}$"):
        check_world([gpu, gpu, refusal, refusal], ["a", "a", "b", "b"])
    check_world([gpu, Binding("cuda:1", GPU_BACKEND)], ["a", "a"])  # agreed: no error
    check_world([CPU_ENGINE] * 3, ["a", "b", "c"])


def test_a_world_with_gpus_on_some_hosts_only_is_refused():
    with pytest.raises(DistUsageError, match=r"^rank 0 on a has a GPU but rank 2 on b has none: all ranks must use "
                                             r"one backend; use --cpu / --backend gloo"):
        check_world([Binding("cuda:0", GPU_BACKEND), Binding("cuda:1", GPU_BACKEND), CPU_ENGINE], ["a", "a", "b"])


def test_gpu_engines_bind_their_device_in_init_process_group_where_torch_accepts_it():
    accepted = inspect.signature(dist.init_process_group).parameters  # what boot.py passes: this torch's own
    assert "device_id" in accepted  # torch 2.13: eager NCCL communicator creation is available
    assert devices.init_options(Binding("cuda:1", GPU_BACKEND), accepted) == {"device_id": torch.device("cuda", 1)}
    assert devices.init_options(Binding("cuda:1", GPU_BACKEND), {"backend", "store"}) == {}  # an older torch
    assert devices.init_options(CPU_ENGINE, accepted) == {}


@pytest.mark.parametrize("backend, cpu, cuda", [
    ("cpu:gloo,cuda:nccl", "gloo", "nccl"),
    ("gloo", "gloo", "gloo"),
    ("nccl", None, "nccl"),
    ("cpu:gloo", "gloo", None),
])
def test_backend_for_says_which_backend_serves_each_device_type(backend, cpu, cuda):
    assert (backend_for(backend, "cpu"), backend_for(backend, "cuda")) == (cpu, cuda)


# -- GPU memory: NVML's figure for this process, else torch's cache ----------------------------------------------


def nvml_entry(pid: int, used: int | None):
    """One entry as pynvml's nvmlDeviceGetComputeRunningProcesses builds it (its struct, its None for 'n/a')."""
    raw = pynvml.c_nvmlProcessInfo_v3_t(pid=pid, usedGpuMemory=used if used is not None else
                                        pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value)
    entry = pynvml.nvmlStructToFriendlyObject(raw)
    if entry.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        entry.usedGpuMemory = None
    return entry


def test_gpu_memory_is_what_nvml_lists_for_this_process_or_nothing():
    listed = [nvml_entry(11, 500 * 2**20), nvml_entry(42, 812 * 2**20), nvml_entry(42, 4 * 2**20)]
    assert devices.process_gpu_bytes(listed, 42) == 816 * 2**20
    assert devices.process_gpu_bytes(listed, 7) is None  # not listed: e.g. a container's PID namespace
    assert devices.process_gpu_bytes([nvml_entry(42, None)], 42) is None  # the driver cannot account per process
    assert devices.process_gpu_bytes([], 42) is None


def test_status_says_whose_gpu_figure_it_shows():
    row = {"rank": 0, "host": "h", "pid": 1, "device": "cuda:0", "backend": GPU_BACKEND, "rss_mib": 900.0}
    nvml = Status._cells({**row, "gpu_mib": 1234.4, "gpu_memory": "nvml"})
    torch_cache = Status._cells({**row, "gpu_mib": 512.0, "gpu_memory": "torch"})
    assert nvml[3:] == ["cuda:0", "cpu:gloo,cuda:nccl", "900 MiB (+1234 MiB GPU)"]
    assert torch_cache[5] == "900 MiB (+512 MiB GPU, torch's cache only)"


# -- options, in the kernel (GPU count injected) -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_two_engines_on_one_gpu_are_refused_for_the_real_reason(backend):
    with pytest.raises(DistUsageError) as refused:
        ClusterOptions(n=2, backend=backend).resolved(gpus=1)
    assert str(refused.value) == ("-n 2 but 1 GPU visible: NCCL runs one rank per GPU; use -n 1, or --cpu / "
                                  "--backend gloo for CPU engines")
    with pytest.raises(DistUsageError, match=r"^-n 3 but 2 GPUs visible: NCCL runs one rank per GPU; use -n 2,"):
        ClusterOptions(n=3, backend=backend).resolved(gpus=2)


def test_gpu_counts_decide_the_default_and_cpu_engines_ignore_them():
    assert ClusterOptions().resolved(gpus=4).n == 4
    assert ClusterOptions(n=2).resolved(gpus=2).n == 2
    assert ClusterOptions(n=2, backend="gloo").resolved(gpus=1).n == 2  # CPU engines: memory is the limit
    assert ClusterOptions(n=2, cpu=True).resolved(gpus=1).n == 2
    assert ClusterOptions(backend="gloo").resolved(gpus=4).n == 2  # CPU engines: their default count
    with pytest.raises(DistUsageError, match="more engines than this machine can hold"):
        ClusterOptions(n=100_000, backend="gloo").resolved(gpus=1)


def test_option_contradictions_and_missing_gpus_are_refused():
    with pytest.raises(DistUsageError, match="^--cpu and --backend nccl contradict each other: NCCL needs GPUs$"):
        ClusterOptions(cpu=True, backend="nccl").resolved(gpus=1)
    with pytest.raises(DistUsageError, match="^--backend nccl needs GPUs and none are visible here; use --backend"):
        ClusterOptions(backend="nccl").resolved(gpus=0)


@pytest.mark.parametrize("mpi_args", [("-f", "hosts.txt"), ("--hostfile=hosts.txt",), ("-hosts", "a,b")])
def test_several_hosts_without_n_are_refused_asking_for_n(mpi_args):
    message = ("give -n when the engines run on several hosts (--hosts, --hostfile or hosts in --mpi-args): nbdist "
               "counts the GPUs of this host only, not those of the others")
    for cpu in (False, True):
        with pytest.raises(DistUsageError, match=f"^{re.escape(message)}$"):
            ClusterOptions(mpi_args=mpi_args, cpu=cpu).resolved(gpus=1)
    assert ClusterOptions(n=4, mpi_args=mpi_args).resolved(gpus=1).n == 4  # the other hosts' GPUs: engines check


# -- on real engines ------------------------------------------------------------------------------------------------


def _cpu_tensors_and_backend() -> dict:
    import torch
    import torch.distributed as dist

    from nbdist.cluster.launching.ranks.boot import boot

    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {"sum": t, "reported": boot().backend, "torch": str(dist.get_backend()), "device": boot().device,
            "cuda_initialised": torch.cuda.is_initialized()}


def test_a_cpu_cluster_reduces_cpu_tensors_and_shows_its_backend(cluster):
    results = cluster.run(_cpu_tensors_and_backend)
    for r in results:
        assert torch.equal(r["sum"], torch.tensor([3.0, 3.0]))
        assert r["reported"] == r["torch"] == "mpi4py" and r["device"] == "cpu" and not r["cuda_initialised"]
    status = cluster.status()
    assert [(row["device"], row["backend"]) for row in status.rows] == [("cpu", "mpi4py")] * 2
    assert all("gpu_mib" not in row for row in status.rows)
    lines = str(status).splitlines()
    assert lines[0].split() == ["rank", "host", "pid", "device", "backend", "memory"]
    assert [line.split()[3:5] for line in lines[1:3]] == [["cpu", "mpi4py"], ["cpu", "mpi4py"]]


def test_backend_mpi_starts_cpu_engines_whose_process_group_is_nbdists_mpi_backend():
    """`%dist_start --backend mpi`: every torch.distributed call of a cell goes through MPI (backend/ranks/mpi_backend.py)."""
    with nbdist.Cluster(ClusterOptions(n=2, backend="mpi")).start() as mpi_cluster:
        for r in mpi_cluster.run(_cpu_tensors_and_backend):
            assert torch.equal(r["sum"], torch.tensor([3.0, 3.0]))
            assert r["reported"] == r["torch"] == "mpi4py" and r["device"] == "cpu" and not r["cuda_initialised"]
        assert [row["backend"] for row in mpi_cluster.status().rows] == ["mpi4py"] * 2


def _device_map_group() -> dict:
    """On every rank: a process group initialised with torch's device-map form ("cpu:gloo", the CPU half of GPU
    engines' "cpu:gloo,cuda:nccl"), then each nbdist check that reads a backend name, applied to it."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.collectives.ranks.collective_timing import Collective
    from nbdist.data_parallel.ranks import hooks
    from nbdist.errors import DistUsageError
    from nbdist.runtime.ranks.devices import backend_for

    group = dist.new_group(backend="cpu:gloo")  # collective: every rank
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=group)
    bench = Collective("reduce_scatter", "torch", 1024, dist.get_world_size(), dist.get_rank(), group)
    bench.fill()
    bench.call()
    several_buckets = DistributedDataParallel(build_model(), process_group=group, bucket_cap_mb=0.01)
    try:
        hooks.register_hook(several_buckets, "powersgd")
        powersgd = "accepted"
    except DistUsageError as e:
        powersgd = f"{type(e).__name__}: {e}"
    return {"backend": dist.get_backend(group), "serves_cpu": backend_for(dist.get_backend(group), "cpu"),
            "sum": t, "bench": (str(bench.device), bench.backend, bench.note), "powersgd": powersgd}


def test_a_device_map_process_group_works_like_gloo_on_real_engines(cluster):
    from nbdist.collectives.ops import GLOO_REDUCE_SCATTER_NOTE

    for r in cluster.run(_device_map_group):
        assert r["backend"] == "cpu:gloo" and r["serves_cpu"] == "gloo"  # the string differs from "gloo" ...
        assert torch.equal(r["sum"], torch.tensor([3.0, 3.0, 3.0]))
        assert r["bench"] == ("cpu", "gloo", GLOO_REDUCE_SCATTER_NOTE)  # ... but every check reads it as gloo
        assert r["powersgd"].startswith("DistUsageError: PowerSGD on gloo fails (hangs or aborts)")


def _train_with_old_hook_name(steps: int) -> dict:
    import warnings

    from test_hooks import _train

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train("gloo", steps)
    out["warned"] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    return out


OLD_NAME_WARNING = ("hook 'gloo' is now called 'torch' (torch.distributed's all-reduce: gloo on CPU, nccl on GPUs); "
                    "'gloo' will go")


def test_the_torch_hook_trains_like_serial_and_its_old_name_still_works(cluster):
    steps = 3  # crosses DDP's bucket regrouping after the first step
    from test_hooks import _train

    renamed = cluster.run(_train, "torch", steps)
    old = cluster.run(_train_with_old_hook_name, steps)
    expected = serial(steps)
    full = 4 * sum(p.numel() for p in build_model().parameters())
    for rank in range(cluster.world_size):
        assert_params_close(renamed[rank]["params"], expected)
        assert_params_close(old[rank]["params"], renamed[rank]["params"])
        assert renamed[rank]["bytes"] == [full] * steps
        assert old[rank]["warned"] == [OLD_NAME_WARNING]


def test_an_engine_side_refusal_reaches_the_kernel_in_one_line():
    """--backend nccl on hosts named in --mpi-args passes the kernel (it cannot see other hosts' GPUs), so the
    engines refuse it themselves: here the one host is this GPU-less one. Every rank stops with the same line."""
    options = ClusterOptions(n=2, backend="nccl", mpi_args=("-hosts", "localhost"), timeout=20)
    with pytest.raises(DistError) as failed:
        nbdist.Cluster(options).start()
    host = __import__("socket").gethostname()
    line = f"DistUsageError: --backend nccl needs GPUs and host {host} has none visible; use --backend gloo"
    assert line in str(failed.value)

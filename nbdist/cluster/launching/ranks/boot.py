"""Engine start-up: MPI rank and local rank, device binding, torch.distributed rendezvous.

Runs in every engine process *before* it registers with the ipyparallel controller, so that importing torch and
initialising the process group overlap with the controller's own start-up. Settings arrive as environment
variables (ipyparallel gives every rank the same environment; per-rank choices are made here, from the rank).
"""
from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict

from nbdist.cluster.launching import mpi_segments
from nbdist.cluster.launching.ranks.warm_stub import LAUNCHER_NET_ENV
from nbdist.errors import DistUsageError
from nbdist.runtime.ranks import devices
from nbdist.runtime.ranks.rank import KEY, RankInfo

BACKEND_ENV = "NBDIST_BACKEND"  # "mpi" | "gloo" | "nccl" | "auto": what was asked; devices.bind decides
DEVICE_ENV = "NBDIST_DEVICE"  # "cpu" forces CPU engines even where GPUs exist; "auto" binds GPUs by local rank
PG_TIMEOUT_ENV = "NBDIST_PG_TIMEOUT"  # seconds a collective may wait before torch.distributed gives up
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"  # torch's flight recorder for gloo and NCCL: calls kept (0: off)
ENGINE_PROFILE_PREFIX = "engine-profile-"  # + the pid: an engine's own ipyparallel profile on another host
STAND_IN_ENV = "NBDIST_STAND_IN_PID"  # in a rank forked from the kernel: the pid of the process mpiexec started
FLIGHT_RECORDER_CALLS = 512  # kept by default, as nbdist's own recorder keeps (the hang view reads both)


def _rendezvous_store(comm, single_host: bool, timeout: datetime.timedelta):
    """torch.distributed's key-value store for the rendezvous. torch's stores have no authentication (whoever
    reaches one may read, set and delete its keys), so no socket is opened for it: with every rank on the kernel's
    host, a FileStore in the cluster's own folder (0700); elsewhere (other hosts, several hosts) a store carried over
    MPI's world, which only the cluster's ranks are part of (cluster/hosts/ranks/mpi_store.py). Rank 0 chooses and tells
    everyone over MPI."""
    from torch.distributed import FileStore

    from nbdist.cluster.hosts.ranks import mpi_store

    path = _file_store_path() if comm.rank == 0 and single_host else None
    path = comm.bcast(path, root=0)
    if path is not None:
        return FileStore(path, -1)  # -1: torch never removes the file itself; the cluster's stop does
    return mpi_store.over_mpi(comm, timeout)


def _file_store_path() -> str | None:
    """A new file, readable and writable by this user alone, in the cluster's own folder; None where that folder
    is not here."""
    folder = private_folder()
    if folder is None:
        return None
    handle, path = tempfile.mkstemp(prefix="rendezvous-", dir=folder)
    os.close(handle)
    return path


def private_folder() -> str | None:
    """The cluster's own folder, where this engine runs on the kernel's host: ipyparallel's profile directory,
    which nbdist makes for the cluster (0700) and removes at its stop. None on another host (the path there is not
    the cluster's), and where the folder is not this user's alone."""
    from nbdist.cluster.hosts import lifeline
    from nbdist.cluster.launching.ranks import pmi_relay

    return pmi_relay.private_folder(os.environ.get(lifeline.PROFILE_ENV)) if lifeline.on_kernel_host() else None


def _keep_to_this_host(inherited: list[int]) -> list[str]:
    """Every rank on one host: gloo and NCCL listen on the loopback interface (unless the user named one), MPICH on
    no port (the kernel gave the engines addresses.ONE_HOST_TRANSPORTS), and mpiexec and the ranks are in a
    network namespace of their own (cluster/launching/privacy.py), whose loopback no other user reaches. Where the
    OS refused that namespace, the listening sockets this engine inherited (Hydra's control port, on every
    interface: Hydra cannot be told otherwise) are kept to this host by a socket filter
    (addresses.only_from_this_host). Returns what stays open, in words, as measured here: the namespaces this
    process and its launcher are in, against the kernel's."""
    from nbdist.cluster.hosts.ranks import addresses
    from nbdist.cluster.launching.ranks import private_net

    interface = addresses.loopback_interface()
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, interface)
    kernel_net = os.environ.get(private_net.KERNEL_NET_ENV)
    if not kernel_net:  # started outside nbdist's launch: nothing to compare with
        return []
    why = os.environ.get(private_net.REFUSED_ENV, "the OS refused it")
    launcher_net = os.environ.get(LAUNCHER_NET_ENV) or private_net.namespace_of()  # Hydra's (a forked rank's
    # stand-in says where it is)
    left_open = []
    if private_net.namespace_of() == kernel_net:
        left_open.append(f"the ranks' ports on loopback (gloo's, MPICH's abstract sockets) answer every local user "
                         f"(no private network namespace: {why})")
    if launcher_net in (kernel_net, None):
        for fd in inherited:
            filtered = addresses.only_from_this_host(fd)
            left_open.append(f"Hydra's control port {addresses.port_of(fd)} answers every local user"
                             + ("" if filtered else " and other hosts (the socket filter that keeps it to this host "
                                "needs CAP_NET_ADMIN)")
                             + f": any of them can end the job (no private network namespace: {why})")
    return left_open


def _unlink_shared_memory_files() -> None:
    """Remove MPICH's shared-memory file of this host's ranks from /dev/shm once all of them have mapped it.

    MPICH removes it at MPI_Finalize, which engines, ended by a signal, never reach: each stopped cluster left its
    1-2 MB file in /dev/shm (1.7 GB after a day of tests). The mappings stay valid after the name is gone, and
    MPICH's own removal at finalize then finds nothing and says nothing (tried). A start killed before this point
    leaves the file: cluster/launching/mpi_segments.py removes it later."""
    for path in mpi_segments.mapped_by(os.getpid()):
        try:
            os.unlink(path)
        except OSError:
            pass


def _unlink_hydra_topology_file() -> None:
    """Remove the hwloc XML file (/tmp/hydra_hwloc_xmlfile_*) that this host's Hydra proxy wrote for its ranks, once
    all of them have read it (in MPI_Init). The proxy removes it only when it ends well, which a stopped cluster's
    proxy, killed or cut off from mpiexec, does not: every cluster left one file on every host. Found among the
    proxy's open files; the proxy is the parent of the process mpiexec started (this one, or a forked rank's
    stand-in)."""
    import psutil

    try:
        proxy = psutil.Process(int(os.environ.get(STAND_IN_ENV, os.getpid()))).parent()
        held = [f.path for f in proxy.open_files()] if proxy is not None else []
    except (psutil.Error, ValueError):
        return
    for path in held:
        if os.path.basename(path).startswith("hydra_hwloc_xmlfile_"):
            try:
                os.unlink(path)
            except OSError:
                pass


def _forget_engine_profile() -> None:
    """Remove this engine's own profile directory on another host (ranks/main.py engine_profile_dir) once it has
    registered: nothing reads it after ipyparallel's start, and an engine ended by a signal cannot at its end."""
    path = os.environ.get("IPP_PROFILE_DIR", "")
    if os.path.basename(path) == f"{ENGINE_PROFILE_PREFIX}{os.getpid()}":
        shutil.rmtree(path, ignore_errors=True)


def _visible_gpus(requested: str, cpu: bool) -> int:
    """CUDA devices this engine may use; 0 without looking when the engines are to be CPU engines (--cpu, --backend
    gloo), so that those never initialise CUDA."""
    if not devices.wants_gpus(requested, cpu):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _bind(comm, local_rank: int, ranks_on_host: int) -> devices.Binding:
    """This rank's device and backend, agreed by every rank: each one's choice (or refusal) is gathered, so that a
    refusal anywhere stops every rank with the same one line, before any of them waits in the rendezvous."""
    requested, cpu = os.environ.get(BACKEND_ENV, "auto"), os.environ.get(DEVICE_ENV, "auto") == "cpu"
    host = socket.gethostname()
    try:
        mine: devices.Binding | str = devices.bind(
            requested, cpu, local_rank, ranks_on_host, _visible_gpus(requested, cpu), host)
    except DistUsageError as refusal:
        mine = str(refusal)
    gathered = comm.allgather((host, mine))
    devices.check_world([choice for _, choice in gathered], [h for h, _ in gathered])  # raises on every rank alike
    binding = gathered[comm.rank][1]
    if binding.gpu_index is not None:
        import torch

        torch.cuda.set_device(binding.gpu_index)  # before the process group, so NCCL forms its communicator there
    return binding


def _init_process_group(binding: devices.Binding, store, rank: int, size: int, timeout) -> str:
    """Initialise torch.distributed for `binding`; returns the backend torch reports (`dist.get_backend()`)."""
    import inspect

    import torch.distributed as dist

    accepted = inspect.signature(dist.init_process_group).parameters
    os.environ.setdefault(FLIGHT_RECORDER_ENV, str(FLIGHT_RECORDER_CALLS))  # gloo's and NCCL's own recorder
    if binding.backend == devices.MPI_BACKEND:
        from nbdist.backend.ranks import mpi_backend

        mpi_backend.register()
    dist.init_process_group(binding.backend, store=store, rank=rank, world_size=size, timeout=timeout,
                            **devices.init_options(binding, accepted))
    return str(dist.get_backend())


def boot() -> RankInfo:
    """Join the MPI world, bind a device and initialise torch.distributed. Idempotent."""
    from nbdist.runtime.ranks import registry

    booted = registry.find(registry.RANK, KEY)
    if booted is not None:
        return booted
    started = time.perf_counter()
    from nbdist.cluster.hosts.ranks import addresses

    inherited = addresses.inherited_listeners()  # before MPI and torch open their own
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this host: local rank = GPU index
    local_rank, ranks_on_host = node.rank, node.size
    single_host = ranks_on_host == comm.size
    node.Free()
    from nbdist.backend.ranks import roll_call

    roll_call.open_channel(comm)  # collective: where a timed-out collective asks the others where they are
    left_open = _keep_to_this_host(inherited) if single_host else []
    binding = _bind(comm, local_rank, ranks_on_host)  # a collective: every rank has mapped MPICH's segment
    if local_rank == 0:
        _unlink_shared_memory_files()
        _unlink_hydra_topology_file()
    timeout = datetime.timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "1800")))
    store = _rendezvous_store(comm, single_host, timeout)
    backend = _init_process_group(binding, store, comm.rank, comm.size, timeout)
    from nbdist.cluster.waiting.ranks import inspector

    inspector.start(comm.rank)  # a thread that says what this rank is doing when the notebook asks (%dist_why)
    return registry.put(registry.RANK, KEY, RankInfo(
        rank=comm.rank,
        world_size=comm.size,
        local_rank=local_rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=binding.device,
        backend=backend,
        boot_seconds=time.perf_counter() - started,
        launched_pid=int(os.environ.get(STAND_IN_ENV, os.getpid())),  # cluster/launching/ranks/zygote.py sets it
        left_open=left_open,
    ))


def info() -> dict:
    """This rank's description plus live memory use, for the status table: `gpu_mib` on GPU engines, with
    `gpu_memory` saying whose figure it is ("nvml": all the process holds; "torch": torch's cache only)."""
    import psutil

    from nbdist.backend.ranks import idle_progress

    idle_progress.start()  # the kernel's first call runs on the engine's event loop: between cells, MPI moves on
    _forget_engine_profile()  # registered: its profile directory on another host is read no more
    data = asdict(boot())
    data["rss_mib"] = psutil.Process().memory_info().rss / 2**20
    index = devices.Binding(data["device"], data["backend"]).gpu_index
    if index is not None:
        data["gpu_mib"], data["gpu_memory"] = _gpu_memory(index)
    return data


def _gpu_memory(index: int) -> tuple[float, str]:
    """MiB this process holds on GPU `index`. NVML's per-process figure counts everything (the CUDA context, NCCL's
    buffers, torch's caching allocator); torch.cuda.memory_allocated(), used before, counted live tensors only and
    missed the rest, often the larger part. Where NVML cannot say (no pynvml, or a container whose PID namespace
    hides this process from NVML), torch's reserved bytes (its caching allocator, no context or NCCL buffers)."""
    held = _nvml_process_bytes(index)
    if held is not None:
        return held / 2**20, "nvml"
    import torch

    return torch.cuda.memory_reserved(index) / 2**20, "torch"


def _nvml_process_bytes(index: int) -> int | None:
    """What NVML lists for this process on CUDA device `index`, or None where it cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = nvml_handle(pynvml, index)
            if handle is None:
                return None
            return devices.process_gpu_bytes(pynvml.nvmlDeviceGetComputeRunningProcesses(handle), os.getpid())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml, no driver, an NVML call it lacks: torch's figure instead
        return None


def nvml_handle(pynvml, cuda_index: int):
    """NVML's handle of this process's CUDA device `cuda_index` (the caller has initialised NVML), or None where
    CUDA shows no such device. devices.nvml_device maps the index, from CUDA_VISIBLE_DEVICES and the UUIDs NVML
    lists: CUDA's index is NVML's only where that variable is unset (torch's own mapping,
    torch.cuda._get_nvml_device_index, is private and fails on MIG instances). Shared with the training
    telemetry (training/ranks/telemetry.py), so both read the same GPU."""
    target = devices.nvml_device(cuda_index, os.environ.get("CUDA_VISIBLE_DEVICES"), devices.nvml_uuids(pynvml))
    if target is None:
        return None
    if isinstance(target, str):  # a MIG instance, opened by its UUID: that instance alone
        return pynvml.nvmlDeviceGetHandleByUUID(target)
    return pynvml.nvmlDeviceGetHandleByIndex(target)

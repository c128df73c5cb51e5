"""Cluster options and their validation, done in the notebook kernel before any process starts.

The kernel never touches CUDA: GPUs are counted through NVML (nvidia-ml-py), which needs only the driver.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any

import psutil

from nbdist.checks import one_of, positive_seconds, whole_number
from nbdist.errors import DistUsageError
from nbdist.runtime.ranks import devices

BACKENDS = devices.REQUESTS  # "auto": nccl on GPUs, gloo on CPU; "mpi": nbdist's MPI backend (CPU engines)
ENGINE_MEMORY_BYTES = 400 * 2**20  # an idle engine (torch, a process group) holds less (figures: benchmarks/README.md)
DEFAULT_CPU_ENGINES = 2
HOSTFILE_FLAGS = ("-f", "--hostfile", "-hostfile", "--machinefile", "-machinefile", "--host", "-host", "-hosts")
MAX_SECONDS = 10**9  # about 31 years: the longest timeout taken (torch's timedelta overflows far above; inf never ends)
MIN_RUN_SECONDS = 0.1  # the shortest timeout of a run: sending a cell and hearing its answer takes milliseconds, and
# the waiter looks every 50 ms (cluster/waiting/remote.py); below this a timeout could only cut cells that had already
# ended (1e-9 printed the cell's output, then said "timed out"), so it is refused before anything is sent
OWNED_MPI_ARGS = ("-n", "-np", "--n", "--np")  # mpiexec options nbdist sets itself: the number of engines is -n


def seconds(value: Any, what: str) -> float:
    """A timeout: a positive, finite number of seconds (at most MAX_SECONDS), else one line naming `what`."""
    value = positive_seconds(value, what)
    if not value <= MAX_SECONDS:
        raise DistUsageError(f"{what} must be at most {MAX_SECONDS:,} seconds (about 31 years), got {value:g}")
    return value


def run_timeout(value: Any, what: str = "timeout") -> float | None:
    """The timeout of a run on the ranks: None (no limit) or seconds(); refused before anything is sent."""
    if value is None:
        return None
    try:
        value = seconds(value, what)
        if value < MIN_RUN_SECONDS:
            raise DistUsageError(f"{what} {value:g} s is too short to mean anything (a cell takes longer to reach the "
                                 f"ranks and answer): give at least {MIN_RUN_SECONDS:g} s")
        return value
    except DistUsageError as e:
        raise DistUsageError(f"{e} (or None for no limit)") from None


def visible_gpus() -> int:
    """Number of GPUs this process may use, from NVML and CUDA_VISIBLE_DEVICES read as CUDA reads it
    (runtime/ranks/devices.cuda_shows: "0,-1,2" shows one), without creating a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuids = devices.nvml_uuids(pynvml)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0
    return len(devices.cuda_shows(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids))


def max_cpu_engines() -> int:
    """How many CPU engines fit in this machine's available memory."""
    return max(1, psutil.virtual_memory().available // ENGINE_MEMORY_BYTES)


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the `mpich` wheel puts it there), else the one on PATH, or $NBDIST_MPIEXEC."""
    if os.environ.get("NBDIST_MPIEXEC"):
        return os.environ["NBDIST_MPIEXEC"]
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


@dataclass(frozen=True)
class ClusterOptions:
    """What `%dist_start` / `nbdist.start()` accept. `n=None` means one engine per GPU, else 2 CPU engines (also
    with --cpu or --backend gloo: CPU engines, whatever the GPUs)."""

    n: int | None = None
    cpu: bool = False
    backend: str = "auto"
    timeout: float = 60.0  # seconds the whole start-up may take
    mpi_args: tuple[str, ...] = field(default_factory=tuple)
    collective_timeout: float = 1800.0  # seconds a torch.distributed collective may wait
    hosts: tuple[str, ...] = field(default_factory=tuple)  # ssh hosts, Hydra's form: "a", "a:2" (slots)
    hostfile: str | None = None  # MPI's host file: one "host[:slots]" per line
    iface: str | None = None  # the network interface the hosts reach each other by, where they have several
    slurm: object = None  # a Slurm allocation to run in: True, or salloc's choices (cluster/hosts/slurm.py SlurmRequest)
    fork: bool = True  # ranks forked from the kernel where they can be (cluster/launching/warm.py); False: fresh processes

    def __post_init__(self) -> None:
        """Accept what a user naturally writes: mpi_args as one string ("-f hosts") is split as a shell would,
        hosts as one string ("a,b") at its commas. Anything else that is not a list is refused by resolved()."""
        from nbdist.cluster.hosts.slurm import SlurmRequest

        if isinstance(self.mpi_args, str):
            try:
                object.__setattr__(self, "mpi_args", tuple(shlex.split(self.mpi_args)))
            except ValueError as e:  # an unclosed quote
                raise DistUsageError(f"--mpi-args {self.mpi_args!r} cannot be split as a shell would: {e}") from None
        if isinstance(self.hosts, str):
            named = tuple(h.strip() for h in self.hosts.split(",") if h.strip())
            if self.hosts.strip() and not named:
                raise DistUsageError(f"--hosts {self.hosts!r} names no host")
            object.__setattr__(self, "hosts", named)
        for name in ("mpi_args", "hosts"):  # any other list or tuple (as nbdist.start always took) as a tuple
            if isinstance(getattr(self, name), (list, tuple)):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "slurm", SlurmRequest.of(self.slurm))

    @classmethod
    def names(cls) -> set[str]:
        """The options `nbdist.start()` takes besides n."""
        return {f.name for f in fields(cls)} - {"n"}

    @classmethod
    def of(cls, n: Any = None, **options: Any) -> "ClusterOptions":
        """From `nbdist.start`'s or `nbdist.Cluster`'s keywords: an unknown option is one line listing the known."""
        unknown = sorted(set(options) - cls.names())
        if unknown:
            known = ", ".join(sorted(cls.names()))
            raise DistUsageError(f"unknown option(s) {', '.join(unknown)}: choose from {known}")
        return cls(n=n, **options)

    def multi_host(self) -> bool:
        named = any(arg.split("=")[0] in HOSTFILE_FLAGS for arg in self.mpi_args)
        return bool(self.hosts or self.hostfile or self.slurm) or named

    def host_names(self) -> list[str]:
        """The hosts named by --hosts or --hostfile, without their slot counts."""
        if self.hosts:
            return [h.split(":")[0] for h in self.hosts]
        if self.hostfile:
            with open(self.hostfile) as f:
                lines = [line.split("#")[0].strip() for line in f]
            return [line.split()[0].split(":")[0] for line in lines if line]
        return []

    def launch_args(self, kernel_address: str) -> list[str]:
        """mpiexec's arguments for the hosts (Hydra's): where to start ranks (the hosts, or Slurm's allocation),
        and the kernel's address for the proxies to call back to (Hydra's own guess is this host's name, which the
        other hosts may not resolve)."""
        from nbdist.cluster.hosts.slurm import SLURM_LAUNCH

        if self.slurm is not None:
            args = list(SLURM_LAUNCH)
        elif self.hosts:
            args = ["-hosts", ",".join(self.hosts)]
        else:
            args = ["-f", self.hostfile] if self.hostfile else []
        if self.multi_host():
            args += ["-localhost", kernel_address]
        return args + list(self.mpi_args)

    def kernel_address(self, allocation=None) -> str:
        """The address the engines reach the kernel by: loopback on one host; else this host's address toward the
        named hosts or the Slurm allocation's nodes (cluster/hosts/ranks/addresses.py), or the named interface's."""
        from nbdist.cluster.hosts.ranks import addresses

        if not self.multi_host():
            return addresses.LOOPBACK
        peers = allocation.addresses() if allocation is not None else self.host_names()
        return addresses.address_toward(peers, self.iface)

    def threads_per_engine(self) -> int:
        return max(1, (os.cpu_count() or 1) // max(1, self.n or 1))

    def mpiexec(self) -> str:
        found = find_mpiexec()
        if not found:
            raise DistUsageError("mpiexec not found: `pip install mpich`, or put your MPI's mpiexec on PATH")
        return found

    def resolved(self, gpus: int | None = None) -> "ClusterOptions":
        """Fill in defaults from the hardware and check everything; raises DistUsageError naming the problem.

        `gpus`: the GPUs visible here; counted through NVML when not given (tests give it, so the GPU rules are
        checked on machines without one). --cpu and --backend gloo mean CPU engines, whatever the GPUs.
        """
        one_of(self.backend, BACKENDS, "backend")
        if not isinstance(self.cpu, bool):
            raise DistUsageError(f"cpu must be True or False, got {self.cpu!r}")
        if self.cpu and self.backend == "nccl":
            raise DistUsageError("--cpu and --backend nccl contradict each other: NCCL needs GPUs")
        self._check_types()
        seconds(self.timeout, "--timeout")
        seconds(self.collective_timeout, "collective_timeout")
        self._check_hosts()
        if not devices.wants_gpus(self.backend, self.cpu):
            gpus = 0
        elif gpus is None:
            gpus = visible_gpus()
        n = self._engine_count(gpus)
        if not self.multi_host():
            self._check_fits(n, gpus)
        self.mpiexec()
        return replace(self, n=n)

    def _check_types(self) -> None:
        """mpi_args and hosts are lists of strings; hostfile and iface a string (or None)."""
        for name, value in (("mpi_args", self.mpi_args), ("hosts", self.hosts)):
            if not isinstance(value, tuple) or not all(isinstance(item, str) for item in value):
                raise DistUsageError(f"{name} must be a list of strings or one string, got {value!r}")
        if self.mpi_args and not self.mpi_args[0].startswith("-"):
            raise DistUsageError(f"--mpi-args must begin with an mpiexec option, got {self.mpi_args[0]!r}: mpiexec "
                                 "would take it for the program to run")
        owned = next((arg for arg in self.mpi_args if arg.split("=")[0] in OWNED_MPI_ARGS), None)
        if owned is not None:
            raise DistUsageError(f"--mpi-args {owned!r}: nbdist gives mpiexec the number of engines itself; ask for "
                                 "them with -n (nbdist.start(n))")
        if not isinstance(self.fork, bool):
            raise DistUsageError(f"fork must be True or False, got {self.fork!r}")
        for name, value in (("hostfile", self.hostfile), ("iface", self.iface)):
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value).strip()):
                raise DistUsageError(f"{name} must be a non-empty string, got {value!r}")

    def _check_hosts(self) -> None:
        """--hosts and --hostfile: one of them, names that resolve, a host file that exists."""
        from nbdist.cluster.hosts.ranks import addresses

        if sum(map(bool, (self.hosts, self.hostfile, self.slurm))) > 1:
            raise DistUsageError("give one of --hosts, --hostfile and --slurm")
        if self.hostfile and not os.path.isfile(self.hostfile):
            raise DistUsageError(f"--hostfile {self.hostfile!r}: no such file")
        if self.multi_host() and (self.hosts or self.hostfile) and not self.host_names():
            raise DistUsageError(f"--hostfile {self.hostfile!r} names no host")
        for host in self.host_names():
            addresses.resolve(host)

    def _engine_count(self, gpus: int) -> int:
        """-n, or one engine per GPU, else DEFAULT_CPU_ENGINES. On several hosts nbdist cannot count the others'
        GPUs (NVML sees this host only), so there -n is required."""
        if self.slurm is not None:
            return self._slurm_engines()
        if self.n is None and self.multi_host():
            raise DistUsageError("give -n when the engines run on several hosts (--hosts, --hostfile or hosts in "
                                 "--mpi-args): nbdist counts the GPUs of this host only, not those of the others")
        n = self.n if self.n is not None else (gpus or DEFAULT_CPU_ENGINES)
        whole_number(n, "-n")
        return n

    def _slurm_engines(self) -> int:
        """With --slurm the allocation decides the engines: nodes × tasks per node, or an existing allocation's
        tasks; -n, if given, must agree."""
        request = self.slurm
        whole_number(request.nodes, "--nodes")
        for flag, value in (("--tasks-per-node", request.tasks_per_node), ("--gpus-per-node", request.gpus_per_node)):
            if value is not None:
                whole_number(value, flag)
        n = request.engines or int(os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NNODES") or 1)
        if self.n is not None and self.n != n:
            raise DistUsageError(f"-n {self.n}, but the Slurm allocation runs {n} engines (nodes × tasks per node): "
                                 f"leave -n out, or ask Slurm for {self.n}")
        return n

    def _check_fits(self, n: int, gpus: int) -> None:
        """On this host: NCCL runs one rank per GPU; CPU engines are limited by memory."""
        if self.backend == "nccl" and gpus == 0:
            raise DistUsageError("--backend nccl needs GPUs and none are visible here; use --backend gloo")
        if gpus and n > gpus:
            raise DistUsageError(
                f"-n {n} but {gpus} GPU{'s' if gpus > 1 else ''} visible: NCCL runs one rank per GPU; use -n {gpus}, "
                f"or --cpu / --backend gloo for CPU engines"
            )
        if gpus:
            return
        limit = max_cpu_engines()
        if n > limit:
            free_gib = psutil.virtual_memory().available / 2**30
            raise DistUsageError(
                f"-n {n} is more engines than this machine can hold: at most {limit} "
                f"({free_gib:.1f} GiB available, ~{ENGINE_MEMORY_BYTES / 2**30:.1f} GiB per engine)"
            )

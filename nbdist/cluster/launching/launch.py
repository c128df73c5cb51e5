"""Starting and stopping the ipyparallel controller and the MPI engines, fast and without leftovers.

ipyparallel's defaults are built for robustness on batch systems: a 1 s pause between controller and engines,
a 3 s heartbeat that engines must answer before the hub counts them, a nanny process per engine, and a stop that
waits politely. On one notebook's cluster those waits are most of the start-up time, so we:

- launch the engines at the same moment as the controller (the engines import torch and join the process group
  while the controller starts, then wait for its connection file);
- beat the heart every second, and every 10 ms until the engines have registered (cluster/launching/controller.py), so
  a registering engine is confirmed within 10-20 ms;
- run the controller's schedulers as threads, not processes, and skip the per-engine nanny;
- stop by signalling the process groups of mpiexec and the controller at once.

Every process we start carries a lifeline (see cluster/hosts/lifeline.py) to the notebook kernel: the controller and engines
on the kernel's host watch its pid; engines on other hosts hold a connection to the cluster's lifeline server
(cluster/hosts/lifeline_server.py), which runs from just before the engines start until they are stopped.

Each cluster runs in its own IPython profile directory, removed at stop (cluster/launching/files.py).

Across hosts nothing secret crosses the network in clear (docs/security.md): the controller speaks CurveZMQ and
admits only the kernel's client and the engines, by keys the kernel makes for each cluster; the
lifeline is TLS; and its token, which mpiexec would hand to its proxies in clear if it were in the engines'
environment, reaches the other hosts through ssh's own channel instead (cluster/launching/across_hosts.py).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import ipyparallel as ipp
import psutil

from nbdist.cluster.hosts import lifeline_server, slurm
from nbdist.cluster.launching import files as cluster_files
from nbdist.cluster.hosts.ranks import addresses
from nbdist.cluster.launching import across_hosts, host_probe, launch_output, mpi_segments, privacy, warm
from nbdist.cluster.launching.ranks.main import ENGINE_KEYS, ENGINE_KEYS_ENV, START_TIMEOUT_ENV
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistError

HEARTBEAT_MS = 1000  # each beat wakes the controller and every engine (idle cost: benchmarks/README.md)
HEARTBEAT_MISSES = 9  # the 10th beat missed drops the engine: 10 s without a beat (busy 2-core machines are slow)
ALIVE_CHECK_SECONDS = 0.05  # how often a start looks whether mpiexec or the controller has died (not each 5 ms poll)


@dataclass
class Launched:
    """What a launch made, owned until it is stopped: the ipyparallel cluster and the client connected to it, the
    lifeline server its engines hold, the Slurm allocation it runs in (--slurm), the warm process its ranks were
    forked from, and when its engines were launched (MPICH's files left since then are its own)."""

    cluster: ipp.Cluster
    client: ipp.Client | None = None
    engine_ids: list[int] = field(default_factory=list)
    lifeline: lifeline_server.LifelineServer | None = None
    allocation: slurm.Allocation | None = None
    warm_process: warm.WarmProcess | None = None
    launched_at: float = field(default_factory=time.time)
    left_open: list[str] = field(default_factory=list)  # what the kernel's side leaves open, in words (status: "open:")

    def processes(self) -> list[psutil.Process]:
        """Every process of the cluster: controller, mpiexec, Hydra proxies, the engines, the warm process."""
        return processes(self.cluster, self.warm_process)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the client and end everything the launch made; nothing is left running or on disk."""
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:
                pass
        stop_processes(self.cluster, self.warm_process, timeout)
        mpi_segments.remove_left_since(self.launched_at)  # a start killed before MPI's own clean-up
        if self.warm_process is not None:
            self.warm_process.stop()
        _forget(self.cluster)
        if self.lifeline is not None:  # after the processes: closing first would end the remote engines'
            self.lifeline.close()  # lifelines, racing our own kills
        if self.allocation is not None:  # after the engines: giving it back first would end them under us
            self.allocation.release()


def _engine_environment(options: ClusterOptions, lifeline: lifeline_server.LifelineServer,
                        kernel_address: str) -> dict[str, str]:
    env = {
        **lifeline.environment(),
        addresses.KERNEL_ADDRESS_ENV: kernel_address,  # rank 0 serves the rendezvous on its address toward it
        "NBDIST_BACKEND": options.backend,
        "NBDIST_DEVICE": "cpu" if options.cpu else "auto",
        "NBDIST_PG_TIMEOUT": str(options.collective_timeout),
        START_TIMEOUT_ENV: str(options.timeout),  # how long an engine on another host waits for the controller
        # One BLAS/OpenMP thread per engine: engines share the cores, and oversubscription slows everyone.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(options.threads_per_engine())),
        "PYTHONUNBUFFERED": "1",
    }
    if options.iface:
        env[addresses.IFACE_ENV] = options.iface
    if kernel_address == addresses.LOOPBACK:  # every engine on this host: MPICH's transport listens on no port
        env.update({k: v for k, v in addresses.ONE_HOST_TRANSPORTS.items() if k not in os.environ})  # yours win
    env["PYTHONPATH"] = os.pathsep.join(_kernel_import_paths())
    return env


def _kernel_import_paths() -> list[str]:
    """The kernel's own import path (minus the interpreter's), so engines can unpickle functions from the same
    modules the notebook imports: a helper module beside the notebook, a source checkout, a test folder."""
    package = os.path.dirname(os.path.abspath(importlib.util.find_spec("nbdist").origin))
    package_root = os.path.dirname(package)  # above nbdist/
    interpreter = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    kernel_paths = [os.path.abspath(p or ".") for p in sys.path]
    paths = [package_root] + [p for p in kernel_paths if not p.startswith(interpreter)]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [p for p in dict.fromkeys(paths) if os.path.isdir(p)]


def _warm_or_none(private: bool) -> warm.WarmProcess | None:
    """The kernel's warm process; None (fresh ranks) when the fork itself fails, e.g. for want of memory."""
    try:
        return warm.start(private)
    except OSError:
        return None


def _new_cluster(options: ClusterOptions, kernel_address: str, one_host: bool) -> ipp.Cluster:
    profile_dir = cluster_files.new_profile_dir()
    try:
        return _ipp_cluster(options, profile_dir, *privacy.controller_address(profile_dir, one_host, kernel_address),
                            curve=not one_host)
    except BaseException:  # e.g. an error in the user's ipcluster_config.py
        shutil.rmtree(profile_dir, ignore_errors=True)
        raise


def _ipp_cluster(options: ClusterOptions, profile_dir: str, transport: str, address: str,
                 curve: bool = False) -> ipp.Cluster:
    """The controller listens on Unix sockets in the cluster's folder for engines on this host (privacy.py), and on
    the kernel's address toward the other hosts when engines run there, with CurveZMQ (`curve`): every message
    encrypted, and only the peers the kernel names admitted (controller.admit_only). CurveZMQ authenticates each
    connection, so ipyparallel then signs no message with the HMAC key (its connection files hold an empty one)."""
    cluster = ipp.Cluster(
        profile_dir=profile_dir,
        cluster_file="",  # nbdist keeps the cluster in the kernel; no file for others to find (and none to race)
        engines="mpi",
        load_profile=cluster_files.has_user_config(profile_dir),
        n=options.n,
        delay=0,
        send_engines_connection_env=False,  # engines read the connection file, so they can start before it exists
        shutdown_atexit=False,  # nbdist's own atexit stops it (fast, files removed); ipyparallel's is slow and noisy
        log_level=40,
        controller_args=[
            "--IPController.use_threads=True",
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
            f"--IPController.transport={transport}",
            f"--IPController.ip={address}",
        ] + (["--IPController.enable_curve=True"] if curve else []),
    )
    cluster.log.addFilter(_already_removed)  # its launchers log through it
    return cluster


def _already_removed(record: logging.LogRecord) -> bool:
    """Drop ipyparallel's "Failed to remove <output file>: [Errno 2] No such file" at stop: when a launcher's process
    ends, ipyparallel's loop thread and nbdist's stop (_forget) both read and remove its output file, each checking
    first that it exists; the one that loses the race logs an ERROR for a file that is gone, as both wanted.
    Every other failure to remove (a file held open, no permission) still shows."""
    message = record.getMessage()
    return not (message.startswith("Failed to remove ") and "[Errno 2]" in message)


def start(options: ClusterOptions, while_waiting: Callable[[], bool] | None = None) -> Launched:
    """Start controller and engines (in a Slurm allocation first asked for, with --slurm), connect a client, wait
    until every engine has registered. `while_waiting()` is called instead of sleeping in that wait, until it
    returns False (the kernel has nothing else to do meanwhile: api.Cluster.start loads modules in it)."""
    deadline = time.monotonic() + options.timeout
    root = cluster_files.own_profile_root()  # before any process: one line where the cluster's folder cannot be had
    cluster_files.check_user_config()  # and where the user's ipyparallel settings raise
    allocation = slurm.allocate(options.slurm, options.timeout) if options.slurm is not None else None
    warm_process = None
    try:
        kernel_address = options.kernel_address(allocation)
        one_host = kernel_address == addresses.LOOPBACK and allocation is None
        refused = privacy.private_net_refused(root) if one_host else None
        private = one_host and refused is None  # mpiexec and the warm process in a network of their own
        if options.fork and warm.usable(options.multi_host() or allocation is not None) is None:
            warm_process = _warm_or_none(private)  # first: it loads what ranks need while the controller starts
        cluster = _new_cluster(options, kernel_address, one_host)
    except BaseException:
        if warm_process is not None:
            warm_process.stop()
        if allocation is not None:
            allocation.release()
        raise
    mpi_segments.remove_stale()  # this host's files of starts killed before MPI's own start was done
    launched = Launched(cluster, allocation=allocation, warm_process=warm_process)
    keys = None if one_host else across_hosts.CurveKeys.new()
    hosts = host_probe.HostWatch(options.host_names() if options.hosts else [])
    hosts.silent()  # the first answers now: a host that answered and then does not has dropped off
    try:
        lifeline = launched.lifeline = lifeline_server.serve(
            kernel_address, privacy.lifeline_path(cluster.profile_dir, one_host),
            token_file=None if one_host else os.path.join(cluster.profile_dir, "lifeline-token"))
        watched = [sys.executable, "-m", "nbdist.cluster.hosts.lifeline", str(os.getpid())]
        cluster.start_controller_sync(controller_cmd=watched + ["nbdist.cluster.launching.controller", str(options.n)]
                                      + ([keys.admit_arg()] if keys else []))
        mpi_args, secrets_env = options.launch_args(kernel_address), {}
        if keys is not None:
            mpi_args, delivered, in_clear = across_hosts.launch_args_with_token(mpi_args, cluster.profile_dir, lifeline)
            launched.left_open += [in_clear] if in_clear else []
            secrets_env = {ENGINE_KEYS_ENV: keys.write_engine_keys(cluster.profile_dir),
                           **({} if delivered else lifeline.secret_environment())}
        cluster.start_engines_sync(
            options.n,
            engine_cmd=(warm_process.engine_command() if warm_process is not None
                        else [sys.executable, "-m", "nbdist.cluster.launching.ranks.main"]),
            engine_args=[
                "--IPEngine.enable_nanny=False",
                "--log-level=40",
                f"--IPEngine.wait_for_url_file={options.timeout}",
            ],
            mpi_cmd=privacy.wrapped(options.mpiexec(), private),
            mpi_args=mpi_args,
            environment={**_engine_environment(options, lifeline, kernel_address),
                         **(privacy.environment(refused) if one_host else {}),
                         **(allocation.variables if allocation is not None else {}),
                         **secrets_env},
        )
        client = launched.client = (cluster.connect_client_sync() if keys is None
                                    else _connect_keyed_client(cluster, keys, deadline))
        _publish_engine_connection(cluster, lifeline, deadline, keys)
        checked = 0.0
        while len(client.ids) < options.n:
            if time.monotonic() - checked > ALIVE_CHECK_SECONDS:
                if warm_process is not None:  # first: its end ends mpiexec, whose line would only say "does not answer"
                    warm_process.check()
                launch_output.check_alive(cluster)
                if silent := hosts.silent():
                    raise DistError(host_probe.silent_line(silent, host_probe.ranks_on(options.hosts, options.n)))
                checked = time.monotonic()
            if time.monotonic() > deadline:
                raise DistError(
                    (warm_process is not None and warm_process.late(options.timeout)) or
                    f"only {len(client.ids)} of {options.n} engines registered within {options.timeout:g} s "
                    f"(raise --timeout?); engine output:\n{launch_output.tail(next(iter(cluster.engines.values())))}"
                )
            if while_waiting is None or not while_waiting():
                while_waiting = None
                time.sleep(0.005)
    except BaseException as e:  # a warm process that ended before it was ready is why, whatever failed after it
        why = warm_process.failure() if warm_process is not None and isinstance(e, DistError) else None
        launched.stop()
        if why:
            raise DistError(why) from None
        raise
    launched.client, launched.engine_ids = client, sorted(client.ids)
    return launched


def _connect_keyed_client(cluster: ipp.Cluster, keys: across_hosts.CurveKeys, deadline: float) -> ipp.Client:
    """ipyparallel's client, connected with the keypair the controller admits."""
    info = _connection_info(cluster, "client", deadline)
    return across_hosts.KeyedClient(info, cluster=cluster, profile_dir=cluster.profile_dir,
                                    cluster_id=cluster.cluster_id, curve_keys=keys.client)


def _publish_engine_connection(cluster: ipp.Cluster, lifeline: lifeline_server.LifelineServer,
                               deadline: float, keys: across_hosts.CurveKeys | None = None) -> None:
    """Send the controller's connection info for engines down the lifelines (with the engines' CURVE keypair,
    across hosts: the lifeline is TLS there): engines on other hosts register with it, so their hosts need no
    shared folder and keep no file of the cluster."""
    info = _connection_info(cluster, "engine", deadline)
    if keys is not None:
        info[ENGINE_KEYS] = keys.engine_keys()
    lifeline.publish_engine_connection(info)


def _connection_info(cluster: ipp.Cluster, kind: str, deadline: float) -> dict:
    """The controller's connection file for `kind` ("client", "engine"), once it is there and whole: the controller
    writes the engine file just after the client file, so either may be missing, or half written, for a moment."""
    path = cluster.controller.connection_files[kind]
    while True:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            launch_output.check_alive(cluster)
            if time.monotonic() > deadline:
                raise DistError(f"the controller wrote no connection file for the {kind} ({path})") from None
            time.sleep(0.005)


def _process_groups(cluster: ipp.Cluster) -> list[int]:
    launchers = [cluster.controller] + list(cluster.engines.values())
    return [
        launcher.pid
        for launcher in launchers
        if launcher is not None and getattr(launcher, "pid", None) and launcher.state == "running"
    ]


def processes(cluster: ipp.Cluster, warm_process: warm.WarmProcess | None = None) -> list[psutil.Process]:
    """Every process of an ipyparallel cluster (nbdist's, or a plain one): controller, mpiexec, Hydra proxies, the
    engines, and the warm process that forked them, if any."""
    members = warm_process.processes() if warm_process is not None else []
    for pgid in _process_groups(cluster):
        try:
            leader = psutil.Process(pgid)
            members += [leader] + leader.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return members


def stop_processes(cluster: ipp.Cluster, warm_process: warm.WarmProcess | None = None,
                   timeout: float = 5.0) -> None:
    """Kill controller and engines and wait until they are gone, leaving no process of theirs behind.

    ipyparallel starts each launcher in a new session, so each launcher pid is also a process group holding
    mpiexec, its proxies and the ranks (or the controller and its helper). The ranks go first: mpiexec then sees
    its job end and exits by itself within milliseconds, tidying its files. Then one SIGKILL per group takes
    whatever is left. Engines hold no state worth a graceful exit (a SIGTERM costs most of a second per stop;
    figures: benchmarks/README.md), and on other hosts Hydra's proxies end their ranks when mpiexec's connection
    drops.
    """
    groups = _process_groups(cluster)
    members = processes(cluster, warm_process)
    held = _hydra_files(members)
    forked = warm_process.ranks() if warm_process is not None else []
    ranks = list({p.pid: p for p in [p for p in members if _is_rank(p)] + forked}.values())
    _kill(ranks)
    _wait_gone(ranks + [p for p in members if _name(p) == "mpiexec"], timeout=0.5)
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)
    _kill(members)  # members that left their group (a nanny, a daemon) go too
    _wait_gone(members, timeout)
    for path in held:  # Hydra's topology file, which a killed proxy cannot remove itself
        try:
            os.remove(path)
        except OSError:
            pass


def _kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _is_rank(proc: psutil.Process) -> bool:
    try:
        return "nbdist.cluster.launching.ranks.main" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _hydra_files(procs: list[psutil.Process]) -> list[str]:
    """Files Hydra (MPICH's mpiexec) keeps open in /tmp for its proxies; they outlive a killed proxy."""
    files = []
    for proc in procs:
        try:
            files += [f.path for f in proc.open_files() if os.path.basename(f.path).startswith("hydra_hwloc_")]
        except psutil.Error:
            pass
    return files


def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Wait until every process has exited. A zombie counts as gone: it holds no resources, only a pid entry
    until its parent (or init, for orphaned ranks) reaps it; our own children we reap here."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not _exited(p)]
        if pending:
            time.sleep(0.005)


def _exited(proc: psutil.Process) -> bool:
    try:
        if proc.status() != psutil.STATUS_ZOMBIE:
            return False
        if proc.ppid() == os.getpid():
            os.waitpid(proc.pid, os.WNOHANG)
    except (psutil.NoSuchProcess, ChildProcessError):
        pass
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _forget(cluster: ipp.Cluster) -> None:
    """Now that the processes are gone, remove the cluster's profile directory (connection files, logs) with
    everything in it, and let ipyparallel know nothing is running."""
    for launcher in [cluster.controller] + list(cluster.engines.values()):
        if launcher is not None:
            try:
                launcher.get_output(remove=True)  # also stops ipyparallel's thread that follows the output file
            except Exception:
                pass
    cluster.controller = None
    cluster.engines = {}
    cluster_files.remove_profile_dir(cluster.profile_dir)

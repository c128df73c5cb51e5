"""Engines inside a Slurm allocation: requested for the cluster and given back with it, or the one the notebook
already runs in (kernel side).

Why an allocation of our own is held by a process: Slurm gives an allocation back when the `salloc` that asked for
it ends. nbdist runs `salloc <request> python -m nbdist.cluster.hosts.lifeline <kernel pid> nbdist.cluster.hosts.slurm_holder`:
the holder prints the allocation's SLURM_* variables and waits, under a lifeline to the kernel. `%dist_stop` ends the
holder; a kernel that dies ends it too (its lifeline), and with it the allocation, every job step in it (the
engines), and nothing is left on any node. Inside an existing allocation (a notebook server started by `srun` or
`sbatch`), the kernel's own SLURM_* variables say where the engines may run, and the allocation is not ours to end.

The engines start as one MPI job in the allocation: MPICH's Hydra with `-launcher slurm -rmk slurm` (it starts its
proxies with `srun` and reads the node list from the allocation), the proxies calling back to the kernel's address
toward the nodes (their `NodeAddr`, from `scontrol`).
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields

from nbdist.errors import DistError, DistUsageError

SLURM_LAUNCH = ("-launcher", "slurm", "-rmk", "slurm")  # Hydra: start proxies with srun, read the allocation's nodes


@dataclass(frozen=True)
class SlurmRequest:
    """What `salloc` is asked for: `nodes`, and per node `tasks_per_node` engines (default: `gpus_per_node`, else
    1), `gpus_per_node` GPUs, in `partition` for `time` ("HH:MM:SS") on `account`; `salloc_args` are added as they
    are. `use_existing`: run in the allocation the notebook is already in (no request)."""

    nodes: int = 1
    tasks_per_node: int | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    salloc_args: tuple[str, ...] = field(default_factory=tuple)
    use_existing: bool = False

    @classmethod
    def of(cls, value) -> SlurmRequest | None:
        """From what a user gives: True (the current allocation, else one node), a dict of the fields, a request."""
        if value is None or value is False:
            return None
        if value is True:
            return cls(use_existing=bool(os.environ.get("SLURM_JOB_ID")))
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise DistUsageError(f"unknown Slurm option(s) {', '.join(unknown)}: choose from "
                                     f"{', '.join(sorted(known))}")
            given = dict(value)
            if isinstance(given.get("salloc_args"), str):
                import shlex

                given["salloc_args"] = tuple(shlex.split(given["salloc_args"]))
            return cls(**given)
        raise DistUsageError(f"slurm must be True or a dict of salloc choices (nodes, tasks_per_node, ...), "
                             f"got {value!r}")

    @property
    def per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def engines(self) -> int | None:
        """How many engines the request makes (None: an existing allocation's own count decides)."""
        return None if self.use_existing else self.nodes * self.per_node

    def salloc(self, holder: list[str]) -> list[str]:
        """The salloc command that asks for this allocation and runs `holder` in it."""
        command = ["salloc", f"--nodes={self.nodes}", f"--ntasks-per-node={self.per_node}"]
        for flag, value in (("--gpus-per-node", self.gpus_per_node), ("--partition", self.partition),
                            ("--time", self.time), ("--account", self.account)):
            if value is not None:
                command.append(f"{flag}={value}")
        return command + list(self.salloc_args) + holder


@dataclass
class Allocation:
    """A Slurm allocation the engines run in: its job id, its SLURM_* variables, its nodes' addresses, and (for
    one nbdist asked for) the salloc process holding it."""

    job_id: str
    variables: dict[str, str]
    nodes: list[str]
    held_by: subprocess.Popen | None = None

    @property
    def engines(self) -> int:
        """Tasks the allocation was given (what Hydra starts with -rmk slurm)."""
        return int(self.variables.get("SLURM_NTASKS") or self.variables.get("SLURM_NPROCS") or len(self.nodes))

    def addresses(self) -> list[str]:
        """The nodes' addresses as Slurm reaches them (NodeAddr), for the kernel's route toward them."""
        return [node_address(node) for node in self.nodes]

    def release(self) -> None:
        """Give an allocation nbdist asked for back: its holder ends, so salloc relinquishes the allocation and
        Slurm ends its steps (the engines); a job left anyway is cancelled. An existing allocation is left alone."""
        if self.held_by is None:
            return
        import psutil

        try:
            for child in psutil.Process(self.held_by.pid).children(recursive=True):
                child.kill()
        except psutil.NoSuchProcess:
            pass
        try:
            self.held_by.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.held_by.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.held_by.wait()
        if self.job_id and shutil.which("scancel"):
            subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30, check=False)


def node_address(node: str) -> str:
    """A node's NodeAddr (its name when Slurm gives none)."""
    return node_fields(node).get("NodeAddr") or node


def node_fields(node: str, timeout: float = 30) -> dict[str, str]:
    """`scontrol show node`'s fields ({"State": "DOWN+NOT_RESPONDING", "Reason": "Not responding [root@...]", ...});
    empty when scontrol does not answer or knows no such node."""
    try:
        shown = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=timeout,
                               check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {key: value for line in shown.splitlines() for key, value in _FIELD.findall(line)}


_FIELD = re.compile(r"(\w+)=(.*?)(?=\s+\w+=|\s*$)")  # Key=value, a value may hold spaces ("Reason=Not responding")
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)", re.M)


def failed_nodes(output: str) -> list[str]:
    """The nodes srun says failed, in the engines' mpiexec output (Hydra starts its proxies with srun): Slurm took
    them out of the allocation (the node DOWN: slurmd stopped answering, or the node died) and ends the job on every
    node. How it goes on the test Slurm (tests/slurm_hosts.py) with slurmd SIGKILLed on one node: the engines
    there run on (slurmstepd outlives slurmd) until slurmctld sets the node DOWN, SlurmdTimeout plus its ping
    rounds later; then srun writes this line, the engines on the other nodes get SIGTERM from their slurmstepd, and
    the rest end soon after with srun and mpiexec (figures: benchmarks/README.md)."""
    nodes: list[str] = []
    for found in _NODE_FAILURE.finditer(output):
        nodes += hostnames(found.group(1)) if "[" in found.group(1) else [found.group(1)]
    return list(dict.fromkeys(nodes))


def node_condition(node: str) -> str:
    """What Slurm says of a node, in a few words: "node DOWN: not responding" (its state and Slurm's reason), or
    "node failure" when scontrol does not say (one call, a few milliseconds: asked once, after a failure)."""
    shown = node_fields(node, timeout=5)
    state = shown.get("State", "").split("+")[0]
    reason = re.sub(r"\s*\[[^]]*\]$", "", shown.get("Reason", "")).strip()  # without "[root@<time>]"
    if not state:
        return "node failure"
    return f"node {state}: {reason[:1].lower()}{reason[1:]}" if reason and reason != "none" else f"node {state}"


def hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames`: "node[1-2]" -> ["node1", "node2"]."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30,
                         check=False).stdout
    return out.split() or [nodelist]


def current() -> Allocation:
    """The allocation the kernel runs in (SLURM_JOB_ID and its variables)."""
    variables = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}
    return Allocation(variables["SLURM_JOB_ID"], variables, hostnames(variables.get("SLURM_JOB_NODELIST", "")))


def allocate(request: SlurmRequest, timeout: float) -> Allocation:
    """Ask Slurm for `request` and hold it (see the module docstring); one line when Slurm refuses it or does not
    grant it within `timeout` seconds (the pending request is withdrawn)."""
    if request.use_existing:
        return current()
    if not shutil.which("salloc"):
        raise DistUsageError("--slurm needs Slurm's salloc on PATH, and it is not there")
    holder = [sys.executable, "-m", "nbdist.cluster.hosts.lifeline", str(os.getpid()), "nbdist.cluster.hosts.slurm_holder"]
    process = subprocess.Popen(request.salloc(holder), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    line = _first_line(process, timeout)
    if line is None:
        refused = process.poll() is not None  # salloc ended by itself: Slurm said no
        early = "" if refused else _said_so_far(process)
        reason = "" if refused else _pending_reason(early)
        if not refused:
            process.send_signal(signal.SIGINT)  # salloc withdraws a pending request on an interrupt
        said, job = _said(process, early)
        Allocation(job, {}, [], process).release()
        asked = " ".join(request.salloc([])[1:])
        if refused:
            raise DistUsageError(f"Slurm refused the request ({asked}): {said or 'salloc exited'}")
        why = f" (Slurm's reason: {reason})" if reason else ""
        raise DistError(f"Slurm did not grant the request ({asked}) within {timeout:g} s{why}; it was withdrawn "
                        f"(raise --timeout, or ask for less)")
    variables = json.loads(line)
    return Allocation(variables["SLURM_JOB_ID"], variables, hostnames(variables.get("SLURM_JOB_NODELIST", "")),
                      process)


def _first_line(process: subprocess.Popen, timeout: float) -> str | None:
    """The holder's line (the allocation's variables), or None when salloc ends or the time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.1)
        if ready:
            line = process.stdout.readline().decode()
            if line.strip():
                return line
        if process.poll() is not None:
            return None
    return None


def _said_so_far(process: subprocess.Popen) -> str:
    """What salloc has written on its stderr until now (its pending job's id), read without waiting."""
    os.set_blocking(process.stderr.fileno(), False)
    try:
        return (process.stderr.read() or b"").decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.set_blocking(process.stderr.fileno(), True)


def _pending_reason(said: str) -> str:
    """Why Slurm keeps the job salloc named pending: squeue's REASON (e.g. Resources, PartitionConfig,
    PartitionNodeLimit), asked before the request is withdrawn; "" where squeue cannot say."""
    job = re.search(r"job allocation (\d+)", said)
    if job is None or not shutil.which("squeue"):
        return ""
    try:
        shown = subprocess.run(["squeue", "-h", "-j", job.group(1), "-o", "%r"], capture_output=True, text=True,
                               timeout=10)
    except (subprocess.TimeoutExpired, OSError):
        return ""
    return shown.stdout.strip() if shown.returncode == 0 and shown.stdout.strip() != "None" else ""


def _said(process: subprocess.Popen, early: str = "") -> tuple[str, str]:
    """salloc's own complaint, in one line ("salloc: error: ..." without its prefix), and the job id it named, if
    any (a pending request has one, which must not stay in the queue); `early`: what of its stderr was read before."""
    try:
        process.wait(timeout=5)
        text = early + process.stderr.read().decode(errors="replace")
    except (subprocess.TimeoutExpired, OSError, ValueError):
        return "", ""
    errors = [line.split("error:", 1)[1].strip() for line in text.splitlines() if "error:" in line]
    job = re.search(r"job allocation (\d+)", text)
    return "; ".join(dict.fromkeys(errors)), job.group(1) if job else ""

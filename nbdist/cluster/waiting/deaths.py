"""Which engine died, said within a second of its death (kernel side).

Why: one MPI rank dying (killed, out of memory) ends the whole MPICH job: Hydra kills the other ranks
milliseconds later, and ipyparallel's launcher notices the job is over only seconds after that (figures:
benchmarks/README.md). A user needs the rank that died, not "every engine died". Two witnesses:
- the engines' processes on this host, polled (a killed process is gone, or a zombie until its parent reaps it);
  the rank seen dead first is the one that died, the others follow it;
- Hydra's own report in mpiexec's output ("BAD TERMINATION ... PID <pid> RUNNING AT <host> ... EXIT CODE: 9"),
  which also covers ranks on other hosts;
- MPICH's own words when a rank calls MPI_Abort ("application called MPI_Abort(MPI_COMM_WORLD, 3) - process 1"):
  Hydra then ends every rank at once, so all are seen dead together and only these words name the one that called
  it. MPICH writes them to the rank's fd 2, then sends Hydra the abort command; mpiexec exits the moment it reads
  that command (its proxy then kills every rank, the aborting one too), so the words reached its output only where
  the proxy happened to forward them first (measured: 5 of 10 forked ranks, 6 of 10 fresh ones, "died together"
  otherwise; 17 of 20 plain MPICH processes, 1 of 5 with a thread forwarding a pipe on fd 2 as the rank's capture of
  its fd 2 does, which delays them further). Each rank's PMI socket is therefore relayed
  (cluster/launching/ranks/pmi_relay.py), and the relay writes the same words to a file in the cluster's folder
  before Hydra hears the command (`records`): named every time on the kernel's host (measured: 10 of 10 forked, 10
  of 10 fresh); a rank on another host writes them to mpiexec's output 0.2 s ahead of the command instead;
- in a Slurm allocation, srun's report in the same output ("Node failure on <node>"): Slurm took a node out of the
  allocation and ends the job on every node, so the node, Slurm's reason and its ranks are the cause, whatever rank
  is seen dying first (cluster/hosts/slurm.py failed_nodes says what was measured).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from nbdist.cluster.hosts import slurm
from nbdist.cluster.launching.ranks.pmi_relay import RECORD_PREFIX

_HYDRA = re.compile(r"BAD TERMINATION.*?PID (\d+) RUNNING AT (\S+).*?EXIT CODE: (\d+)", re.S)
_SIGNAL = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")
_ABORT = re.compile(r"application called MPI_Abort\((\S+?), (-?\d+)\) - process (\d+)")
_STAND_IN = re.compile(r"nbdist stand-in: rank pid (\d+) ended (?:by signal (\d+)|with exit code (\d+))")


@dataclass
class DeathWatch:
    """Watches one cluster's engines: `check()` returns a line naming the dead rank(s), or None while all live."""

    pids: dict[int, tuple[str, int]]  # rank -> (host, pid)
    output_file: str | None = None  # mpiexec's output, where Hydra reports a bad termination
    first_seen: list[int] = field(default_factory=list)  # the ranks seen dead in the first check that saw any
    lost: Callable[[], set] | None = None  # (host, pid) of engines whose lifeline to the kernel broke (other hosts)
    launched: dict[int, int] = field(default_factory=dict)  # rank -> the pid mpiexec started (a forked rank's
    # stand-in, cluster/launching/ranks/warm_stub.py: Hydra reports that pid)
    records: str | None = None  # the cluster's folder, where a rank's PMI relay records its MPI_Abort

    def check(self) -> str | None:
        here = socket.gethostname()
        if not self.first_seen:
            self.first_seen = [rank for rank, (host, pid) in sorted(self.pids.items())
                               if host == here and not alive(pid)]
            newly_several = len(self.first_seen) > 1
        else:
            newly_several = False
        said = self._said()
        if said is None and newly_several:
            said = self._await_said()  # several seen dead at once: only Hydra knows which went first
        if said is not None:
            return said
        return self.describe() if self.first_seen else self._unreachable()

    def _unreachable(self) -> str | None:
        """Ranks on other hosts whose lifeline broke (TCP keepalive: the host died, or its network did), by host."""
        lost = self.lost() if self.lost is not None else set()
        gone: dict[str, list[int]] = {}
        for rank, where in sorted(self.pids.items()):
            if where in lost:
                gone.setdefault(where[0], []).append(rank)
        if not gone:
            return None
        # an engine that died also ends its lifeline: Hydra (or srun) may say which and how
        return self._await_said() or unreachable_line({rank: host for host, ranks in gone.items() for rank in ranks})

    def describe(self, reported: tuple[int, str] | None = None) -> str:
        """Name the rank that died (Hydra's word first; else the first seen dead) and what killed it."""
        if reported is not None:
            rank, cause = reported
            return f"rank {rank} ({self._where(rank)}) died{cause}, which ends the whole MPI job"
        if len(self.first_seen) == 1:
            first = self.first_seen[0]
            return f"rank {first} ({self._where(first)}) died, which ends the whole MPI job"
        ranks = ", ".join(map(str, self.first_seen))
        return f"ranks {ranks} died together (which went first, mpiexec did not say), which ends the whole MPI job"

    def _where(self, rank: int) -> str:
        host, pid = self.pids[rank]
        return f"pid {pid} on {host}"

    def _await_said(self, seconds: float = 1.0) -> str | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            said = self._said()
            if said is not None:
                return said
            time.sleep(0.05)
        return None

    def _said(self) -> str | None:
        """What mpiexec's output says ended the job: srun's node failure (Slurm's cause, asked of scontrol once),
        else Hydra's report of a rank's death."""
        text = self._output()
        failed = slurm.failed_nodes(text)
        if failed:
            return left_allocation_line({node: slurm.node_condition(node) for node in failed},
                                        {rank: host for rank, (host, _) in self.pids.items()})
        aborted = self.aborted(self._records() + text)
        if aborted is not None:
            return aborted
        reported = self._hydra(text)
        return None if reported is None else self.describe(reported)

    def aborted(self, text: str) -> str | None:
        """The rank that called MPI_Abort and its error code, from MPICH's words in `text` (mpiexec's output, or the
        rank's own stderr); None where they are not there."""
        found = _ABORT.search(text)
        if found is None:
            return None
        communicator, code, rank = found.group(1), found.group(2), int(found.group(3))
        where = f" ({self._where(rank)})" if rank in self.pids else ""
        return (f"rank {rank}{where} called MPI_Abort with error code {code} (on {communicator}), which ends the "
                "whole MPI job")

    def _records(self) -> str:
        """MPICH's words for an MPI_Abort, as the PMI relay of a rank of this cluster on this host recorded them."""
        if not self.records:
            return ""
        said = []
        for _, pid in self.pids.values():
            try:
                with open(os.path.join(self.records, f"{RECORD_PREFIX}{pid}"), "rb") as f:
                    said.append(f.read(4096).decode(errors="replace"))
            except OSError:
                pass
        return "".join(said)

    def _output(self) -> str:
        """The last 16 KiB of mpiexec's output, where Hydra and srun report (their words are the file's last)."""
        if not self.output_file:
            return ""
        try:
            with open(self.output_file, "rb") as f:
                f.seek(max(0, f.seek(0, 2) - 16384))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _hydra(self, text: str) -> tuple[int, str] | None:
        """The rank whose end ended the job, and how: a forked rank's stand-in says so first (Hydra then kills
        the other stand-ins and may report any of them); else Hydra's report of the process it started."""
        ended = _STAND_IN.search(text)
        if ended is not None:
            rank = next((r for r, (_, p) in self.pids.items() if p == int(ended.group(1))), None)
            cause = _signal_cause(int(ended.group(2))) if ended.group(2) else f" (exit code {ended.group(3)})"
            if rank is not None:
                return rank, cause
        found = _HYDRA.search(text)
        if found is None:
            return None
        pid, killed = int(found.group(1)), _SIGNAL.search(text, found.end())
        rank = next((r for r, (_, p) in self.pids.items() if pid in (p, self.launched.get(r))), None)
        code = int(found.group(3))
        # Hydra's exit code of a process a signal ended is the signal's number, and its words for the signal may be
        # missing (under srun: "EXIT CODE: 9", no exit string); 9 is read as SIGKILL, which no engine exits with
        signalled = int(killed.group(1)) if killed else signal.SIGKILL if code == signal.SIGKILL else None
        cause = _signal_cause(signalled) if signalled else f" (exit code {code})"
        return None if rank is None else (rank, cause)


def left_allocation_line(nodes: dict[str, str], hosts: dict[int, str]) -> str:
    """One line for nodes Slurm took out of the allocation (node -> Slurm's words for it), each with the ranks it
    held (rank -> host; a rank's host name may be the node's name with a domain)."""
    parts = []
    for node, condition in nodes.items():
        ranks = [rank for rank, host in sorted(hosts.items()) if host.split(".")[0] == node.split(".")[0]]
        held = f": rank {ranks[0]}" if len(ranks) == 1 else f": ranks {', '.join(map(str, ranks))}" if ranks else ""
        parts.append(f"host {node} left the Slurm allocation ({condition}){held}")
    return "; ".join(parts) + "; Slurm ends the job on every node, and with it every engine"


def unreachable_line(hosts: dict[int, str]) -> str:
    """One line for ranks that stopped answering, grouped by host (rank -> host)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in sorted(hosts.items()):
        by_host.setdefault(host, []).append(rank)
    where = "; ".join(f"rank(s) {', '.join(map(str, ranks))} on {host}" for host, ranks in by_host.items())
    return f"{where} stopped answering: the engine died, or its host cannot be reached, which ends the whole MPI job"


PF_EXITING = 0x4  # Linux's task flag, set the moment a process starts to exit (before it frees its memory)


def alive(pid: int) -> bool:
    """Not exited, and not exiting: a process killed with SIGKILL sets PF_EXITING at once, but may take a while (a
    large memory to free, a loaded machine) to become a zombie, while a peer that lost it may abort and be gone
    sooner; counting "exiting" as dead keeps the killed rank the first one seen."""
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.Error:
        return False
    return not _exiting(pid)


def _exiting(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return bool(int(fields[6]) & PF_EXITING)  # field 9 of stat: flags
    except (OSError, IndexError, ValueError):
        return False


def _signal_cause(number: int) -> str:
    """Hydra's exit string names the signal that ended a killed rank (9: kill -9, or the kernel's OOM killer)."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    hint = ": killed, or out of memory" if number == signal.SIGKILL else ""
    return f" ({name}{hint})"

"""A real Slurm cluster over the namespace hosts of tests/hosts.py: munged and slurmctld here, one slurmd in each
host (its own network namespace and host name), Debian's slurm-wlm and munge, everything under a private folder and
removed on close.

Why real daemons: `--slurm` asks salloc for an allocation, starts the engines as job steps through Hydra's Slurm
launcher (srun), and gives the allocation back at stop or when the kernel dies. Only a real controller and real node
daemons show that the job, its steps and its processes end, on every node.

The configuration avoids what a test machine may lack: process tracking by /proc (proctrack/linuxproc), no task
binding, no accounting; cgroup.conf names cgroup/v1 without constraints, since slurmd loads a cgroup plugin even so
and cannot tell the version where /sys/fs/cgroup is a tmpfs of v1 hierarchies. Ports are chosen per run.
SlurmdTimeout is 10 s (Slurm's default is 300) so that a node whose slurmd dies is set DOWN, and its job ended, within
about 30 s (measured here: 45 s with 30, 25 to 30 s with 10, and no sooner with 5).
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hosts import Host, HostsUnavailable, Made, SshHosts

SLURM_CONF = """\
ClusterName=nbdist
SlurmctldHost={controller}({gateway})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=10
InactiveLimit=0
KillWait=2
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
"""
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


@dataclass
class SlurmHosts(Made):
    """`count` namespace hosts running slurmd, a slurmctld and munged here; `environment` is what a process needs to
    use this Slurm (SLURM_CONF)."""

    count: int = 2
    cpus: int = 2  # CPUs each node offers Slurm
    hosts: SshHosts = field(init=False)
    _daemons: list[subprocess.Popen] = field(default_factory=list)
    _slurmd: dict[str, subprocess.Popen] = field(default_factory=dict)  # host name -> its slurmd

    def _make(self) -> None:
        missing = [d for d in DAEMONS if not os.access(d, os.X_OK)]
        if missing:
            raise HostsUnavailable(f"needs {', '.join(missing)} (apt-get install slurm-wlm munge)")
        self.hosts = SshHosts(self.count).__enter__()
        self._configure()
        self._start()

    @property
    def folder(self) -> Path:
        return self.hosts.folder / "slurm"

    @property
    def environment(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.folder / "slurm.conf")}

    def _configure(self) -> None:
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus} State=UNKNOWN"
                          for h in self.hosts.hosts)
        port = random.SystemRandom().randrange(20000, 40000)  # not the seeded module's draw
        (self.folder / "slurm.conf").write_text(SLURM_CONF.format(
            controller=os.uname().nodename, gateway=self.hosts.gateway, ctld_port=port, slurmd_port=port + 1,
            folder=self.folder, nodes=nodes))
        (self.folder / "cgroup.conf").write_text(CGROUP_CONF)

    def _start(self) -> None:
        f = self.folder
        env = {**os.environ, **self.environment}
        self._spawn(["munged", "--foreground", "--force", f"--key-file={f}/munge.key", f"--socket={f}/munge.socket",
                     f"--pid-file={f}/munged.pid", f"--log-file={f}/munged.log", f"--seed-file={f}/munged.seed"], env)
        self._wait(lambda: (f / "munge.socket").exists(), "munged did not start")
        self._spawn(["slurmctld", "-D", "-f", str(f / "slurm.conf")], env)
        for host in self.hosts.hosts:
            self._spawn_slurmd(host)
        self._wait(self._nodes_idle, "the nodes did not come up idle", seconds=30)

    def _spawn_slurmd(self, host: Host) -> None:
        """slurmd in `host`'s network namespace, under its host name (its own UTS namespace)."""
        self._slurmd[host.name] = self._spawn(
            ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c",
             f"hostname {host.name} && exec slurmd -D -N {host.name} -f {self.folder}/slurm.conf"],
            {**os.environ, **self.environment})

    def _spawn(self, command: list[str], env: dict) -> subprocess.Popen:
        log = open(self.folder / f"{Path(command[0]).name}-{len(self._daemons)}.out", "w")  # noqa: SIM115
        self._daemons.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        return self._daemons[-1]

    def kill_slurmd(self, host: Host) -> None:
        """SIGKILL `host`'s slurmd (what runs in its job steps is left running, as when slurmd crashes)."""
        daemon = self._slurmd.pop(host.name)
        os.kill(daemon.pid, 9)  # the pid is slurmd's own: ip netns exec, unshare and sh each exec the next
        daemon.wait()
        self._daemons.remove(daemon)

    def start_slurmd(self, host: Host, seconds: float = 60.0) -> None:
        """Start `host`'s slurmd again (if it is not running) and wait until every node is idle: a node set DOWN for
        not responding returns to service when its slurmd registers (ReturnToService=2)."""
        if host.name not in self._slurmd:
            self._spawn_slurmd(host)
        self._wait(self._nodes_idle, f"{host.name} did not come back idle", seconds=seconds)

    def _nodes_idle(self) -> bool:
        shown = self.run("sinfo", "-h", "-o", "%T %D").stdout.split()
        return shown[:1] == ["idle"] and shown[1:2] == [str(self.count)]

    def _wait(self, ready, why: str, seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            if time.monotonic() > deadline or any(d.poll() is not None for d in self._daemons):
                logs = " | ".join(p.read_text()[-300:] for p in self.folder.glob("*.log") if p.stat().st_size)
                raise HostsUnavailable(f"{why}: {logs}")
            time.sleep(0.1)

    def run(self, *command: str) -> subprocess.CompletedProcess:
        """A Slurm command (sinfo, squeue, scancel, ...) against this cluster."""
        return subprocess.run(command, env={**os.environ, **self.environment}, capture_output=True, text=True,
                              timeout=30, check=False)

    def jobs(self) -> list[str]:
        """The queue's jobs that are not done: "<id> <state>" each."""
        return [line for line in self.run("squeue", "-h", "-o", "%i %T").stdout.splitlines()
                if line.split()[1:2] != ["COMPLETING"]]

    def close(self) -> None:
        for daemon in reversed(self._daemons):
            try:
                os.killpg(daemon.pid, 9)
            except ProcessLookupError:
                pass
            daemon.wait()
        if hasattr(self, "hosts"):
            self.hosts.close()  # the namespaces' processes (slurmstepd, engines), the network, the folder
        shutil.rmtree(self.folder, ignore_errors=True) if hasattr(self, "hosts") else None

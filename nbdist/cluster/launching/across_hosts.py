"""What keeps a cluster's traffic private across hosts (the kernel's side; one host: privacy.py).

The controller speaks CurveZMQ and admits only the kernel's client and the engines, by keypairs the kernel makes for
each cluster (`CurveKeys`; controller.py's ZAP handler admits them); the lifeline is TLS (cluster/hosts/
lifeline_server.py); and its token, which mpiexec would hand to its proxies in clear if it were in the engines'
environment, reaches the other hosts through ssh's own channel, or under Slurm as MUNGE credentials
(`launch_args_with_token`, cluster/hosts/token_launcher.py). Where neither can carry it, it crosses in clear, and
the cluster's status says so in one line. What MPI itself still sends in clear is in docs/security.md.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

import ipyparallel as ipp

from nbdist.cluster.hosts import lifeline_server, token_launcher
from nbdist.cluster.launching import controller as controller_main


@dataclass(frozen=True)
class CurveKeys:
    """A cluster's CurveZMQ keypairs (Z85), made by the kernel: its client's and the engines'. The controller makes its
    own and admits these two public keys only; the engines' secret key reaches them over private channels only
    (the lifeline's TLS; a file of the cluster's 0700 folder on the kernel's host)."""

    client: tuple[bytes, bytes]
    engines: tuple[bytes, bytes]

    @classmethod
    def new(cls) -> "CurveKeys":
        import zmq

        return cls(zmq.curve_keypair(), zmq.curve_keypair())

    def admit_arg(self) -> str:
        return controller_main.ADMIT_FLAG + ",".join(k[0].decode("ascii") for k in (self.client, self.engines))

    def engine_keys(self) -> list[str]:
        return [key.decode("ascii") for key in self.engines]

    def write_engine_keys(self, folder: str) -> str:
        """The engines' keypair in a file only this user reads, for the engines on the kernel's host."""
        path = os.path.join(folder, "engine-keys.json")
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump(self.engine_keys(), f)
        return path


class KeyedClient(ipp.Client):
    """ipyparallel's client with the keypair the controller admits (it would make a random one, refused there)."""

    def __init__(self, *args, curve_keys: tuple[bytes, bytes], **kwargs):
        self.curve_publickey, self.curve_secretkey = curve_keys
        super().__init__(*args, **kwargs)


_LAUNCHERS = {"ssh": "ssh", "rsh": "rsh", "slurm": "srun"}  # Hydra's launcher -> the command it runs by default


def _flag(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0]


def launch_args_with_token(args: list[str], profile_dir: str,
                            lifeline: lifeline_server.LifelineServer) -> tuple[list[str], bool, str]:
    """mpiexec's arguments with its launcher wrapped (cluster/hosts/token_launcher.py) so that the lifeline's token
    reaches the other hosts over ssh (or as MUNGE credentials in srun's environment), not in mpiexec's own; whether
    the wrapper carries it; and, where it crosses the network in clear, what the status says of it (else ""). In
    clear: in srun's environment where munge does not work here (`slurm_channel`); in the engines' environment, as
    mpiexec sends it, where the launcher is another (fork, lsf, ...) or the cluster's folder cannot hold a program
    (noexec)."""
    launcher, executable, kept, i = None, None, [], 0
    while i < len(args):
        name, arg = _flag(args[i]), args[i]
        value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
        step = 1 if "=" in arg else 2
        if arg.startswith("-") and name in ("launcher", "bootstrap"):
            launcher = value
        elif arg.startswith("-") and name in ("launcher-exec", "bootstrap-exec"):
            executable, i = value, i + step
            continue
        kept.append(arg)
        i += 1
    if launcher is None:  # Hydra's own choice: Slurm's inside an allocation, else ssh; named, so both agree
        launcher = "slurm" if {"SLURM_JOB_ID", "SLURM_JOBID"} & set(os.environ) else "ssh"
        kept = ["-launcher", launcher] + kept
    noexec = os.statvfs(profile_dir).f_flag & getattr(os, "ST_NOEXEC", 0)
    if launcher not in _LAUNCHERS or noexec:
        why = "the cluster's folder is on a noexec file system" if noexec else f"Hydra's launcher {launcher} has none"
        return args, False, (f"the lifeline's token crosses the network in clear, in the engines' environment "
                             f"(mpiexec sends it to its proxies): no private channel for it ({why})")
    kind, why = slurm_channel() if launcher == "slurm" else ("ssh", "")
    script = os.path.join(profile_dir, "launcher")
    command = [sys.executable, "-S", token_launcher.__file__, kind, executable or _LAUNCHERS[launcher],
               lifeline.token_file, sys.executable]
    with os.fdopen(os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700), "w") as f:
        f.write("#!/bin/sh\nexec " + " ".join(map(shlex.quote, command)) + ' "$@"\n')
    said = (f"the lifeline's token crosses Slurm's network in clear, in srun's environment (Slurm signs its launch "
            f"request but does not encrypt it): {why}") if why else ""
    return kept + ["-launcher-exec", script], True, said


def slurm_channel() -> tuple[str, str]:
    """How the token reaches srun's tasks: ("munge=<munged's socket>", "") where Slurm authenticates with munge and
    munge encodes here (a credential with no payload, a few ms), its socket Slurm's own (AuthInfo's socket=, else
    munge's default); else ("srun", why not): the token in srun's environment."""
    if shutil.which("munge") is None:
        return "srun", "no munge on the kernel's PATH"
    try:
        shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30,
                               check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        shown = ""
    config = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", shown, re.MULTILINE))
    if "munge" not in config.get("AuthType", "auth/munge"):
        return "srun", f"Slurm's AuthType is {config['AuthType']}, not munge, so its nodes may have no munged"
    socket = re.search(r"socket=([^,\s]+)", config.get("AuthInfo", ""))
    socket_args = [f"--socket={socket.group(1)}"] if socket else []
    try:
        probe = subprocess.run(["munge", "--no-input", *socket_args], capture_output=True, text=True, timeout=30,
                               check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "srun", f"munge failed here ({e})"
    if probe.returncode:
        said = probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"]
        return "srun", f"munge failed here ({said[-1]})"
    return "munge=" + (socket.group(1) if socket else ""), ""

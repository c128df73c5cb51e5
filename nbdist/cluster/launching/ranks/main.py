"""Engine entry point: `python -m nbdist.cluster.launching.ranks.main [ipengine args]`, launched by mpiexec once per rank.

Order matters for start-up time: the lifeline first (no orphans), then the relay of the rank's PMI socket (which
records an MPI_Abort before Hydra ends the job: cluster/launching/ranks/pmi_relay.py), then the slow part (import
torch, MPI rendezvous, process group) while the controller is still starting, and only then the ipyparallel engine,
which waits for the controller's connection file if it is not there yet.

An engine on another host than the kernel's reads no file of the cluster: the controller's connection info comes
down its lifeline, and ipyparallel's profile directory there is an empty one of this engine's, removed once the
engine has registered (the kernel's first call: engines read nothing from it after their start), so that a host
keeps nothing of a cluster after it (not even when the engines are killed; a start that failed earlier leaves it
for the next engine on that host to remove).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile

START_TIMEOUT_ENV = "NBDIST_START_TIMEOUT"  # seconds the start may take; an engine waits this long for the controller
CONNECTION_ENV = "IPP_CONNECTION_INFO"  # ipyparallel's engine reads the controller's connection info here if set
PROFILE_ENV = "IPP_PROFILE_DIR"  # ... and its profile directory here
ENGINE_KEYS = "nbdist_engine_curve"  # in the connection info down the lifeline: [public, secret] (Z85)
ENGINE_KEYS_ENV = "NBDIST_ENGINE_KEYS_FILE"  # on the kernel's host: the file holding them (a path: no secret)
CURVE_ENV = ("IPP_CURVE_PUBLICKEY", "IPP_CURVE_SECRETKEY")  # where ipyparallel's engine reads its keypair


def main() -> None:
    from nbdist.cluster.hosts import lifeline

    lifeline.start()
    from nbdist.cluster.launching import mpi_segments

    if not lifeline.on_kernel_host():  # an earlier start killed before MPI's start was done left these; on the
        mpi_segments.remove_stale()  # kernel's host the kernel removes them (a rank in the cluster's own user
        # namespace cannot read the maps of processes outside it, and would take a mapped file for a stale one)
    from nbdist.cluster.launching.ranks import boot, pmi_relay

    if not os.environ.get(boot.STAND_IN_ENV):  # a forked rank's stand-in relays its PMI socket itself
        pmi_relay.start(boot.private_folder())
    boot.boot()
    if not lifeline.on_kernel_host():
        _connect_from_another_host(lifeline)
    elif os.environ.get(ENGINE_KEYS_ENV):
        with open(os.environ[ENGINE_KEYS_ENV]) as f:
            _use_keys(json.load(f))
    from ipyparallel.engine.app import main as ipengine_main

    sys.argv[0] = "ipengine"
    ipengine_main()


def _connect_from_another_host(lifeline) -> None:
    """Take the controller's connection info from the lifeline and use a profile directory of this host's."""
    timeout = float(os.environ.get(START_TIMEOUT_ENV, "60"))
    info = lifeline.engine_connection_info(timeout)
    if info is None:
        sys.exit(f"nbdist engine on {os.uname().nodename}: no connection info from the kernel within {timeout:g} s")
    connection = json.loads(info)
    _use_keys(connection.pop(ENGINE_KEYS, None))
    os.environ[CONNECTION_ENV] = json.dumps(connection)
    os.environ[PROFILE_ENV] = engine_profile_dir()


def _use_keys(keys: list[str] | None) -> None:
    """The engines' CURVE keypair, for ipyparallel's engine (a cluster on one host has none)."""
    if keys:
        os.environ.update(zip(CURVE_ENV, keys))


def engine_profile_dir() -> str:
    """An empty ipyparallel profile directory of this engine's on this host (engines write nothing into it), after
    removing those of engines that have ended (a shared one was left behind by every cluster). boot.info removes
    it once the engine has registered."""
    from nbdist.cluster.launching.ranks.boot import ENGINE_PROFILE_PREFIX

    user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    root = os.path.join(tempfile.gettempdir(), f"nbdist-{user}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    for left in glob.glob(os.path.join(root, ENGINE_PROFILE_PREFIX + "*")):
        pid = left.rsplit("-", 1)[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(left, ignore_errors=True)
    path = os.path.join(root, f"{ENGINE_PROFILE_PREFIX}{os.getpid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


if __name__ == "__main__":
    main()

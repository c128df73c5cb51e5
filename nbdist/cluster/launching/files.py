"""Each cluster's own ipyparallel profile directory: made at start, removed at stop, never in the user's ~/.ipython.

Why: ipyparallel keeps connection files, logs and the controller's engine list in a profile directory. In the
user's ~/.ipython they would collect files of stopped clusters, which JupyterLab's ipyparallel extension then
reports at its next start. So each cluster gets a fresh directory, marked with its kernel's pid and start time
(the owner file); stop removes it; a kernel killed with SIGKILL cannot, so its processes' lifelines do, and every
start also removes directories whose kernel is gone. The user's ipyparallel settings are copied in.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
import traceback

import psutil

from nbdist.cluster.hosts.lifeline import OWNER_FILE, owner_of
from nbdist.errors import DistError

CLUSTER_DIR_ENV = "NBDIST_CLUSTER_DIR"  # where the clusters' profile directories go (default: see profile_root)
USER_CONFIG_FILES = ("ipcluster_config", "ipcontroller_config", "ipengine_config")
STALE_UNOWNED_SECONDS = 60.0  # a directory still without its owner file after this long was abandoned mid-start


def profile_root() -> str:
    """$NBDIST_CLUSTER_DIR, else a private folder in this host's temp directory. Multi-host runs too: engines on
    other hosts get the controller's connection info down their lifelines (cluster/launching/ranks/main.py), so the
    cluster's files need not be where every host sees them; they stay on the kernel's host, and go with the
    cluster."""
    if os.environ.get(CLUSTER_DIR_ENV):
        return os.path.abspath(os.environ[CLUSTER_DIR_ENV])
    user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return os.path.join(tempfile.gettempdir(), f"nbdist-{user}")


def own_profile_root() -> str:
    """profile_root(), made if missing, or one line saying why it cannot hold this user's clusters (not a folder,
    another user's). Asked before anything of a start runs: a start that failed here after forking its warm process
    hung in that process's stop."""
    root = profile_root()
    named = f"{CLUSTER_DIR_ENV}={root}" if os.environ.get(CLUSTER_DIR_ENV) else root
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise DistError(f"{named} is not a folder: set {CLUSTER_DIR_ENV} to a folder of your own") from None
    except OSError as e:
        raise DistError(f"cannot make {named} ({e.strerror}): set {CLUSTER_DIR_ENV} to a folder of your own") from None
    if hasattr(os, "getuid") and os.stat(root).st_uid != os.getuid():  # connection files hold the cluster's keys
        raise DistError(f"{named} belongs to another user: set {CLUSTER_DIR_ENV} to a folder of your own")
    return root


def new_profile_dir() -> str:
    """A fresh profile directory owned by this kernel, holding the user's ipyparallel configuration (if any)."""
    root = own_profile_root()
    remove_stale_profile_dirs(root)
    path = tempfile.mkdtemp(prefix="cluster-", dir=root)
    me = psutil.Process()
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(f"{me.pid} {me.create_time()}")
    _copy_user_config(path)
    return path


def has_user_config(path: str) -> bool:
    """Whether the user's ipyparallel settings were copied into this profile directory: only then is it worth
    ipyparallel's loading it (a profile application, configuration files searched: a noticeable part of every start;
    figures: benchmarks/README.md)."""
    return any(glob.glob(os.path.join(path, name + ".*")) for name in USER_CONFIG_FILES)


def _user_config_files() -> list[str]:
    """The user's ipyparallel settings files, in the kernel's IPython profile (else the default one)."""
    try:
        from IPython import get_ipython
        from IPython.paths import get_ipython_dir

        shell = get_ipython()
        user_profile = shell.profile_dir.location if shell else os.path.join(get_ipython_dir(), "profile_default")
    except Exception:
        return []
    return [found for name in USER_CONFIG_FILES for found in glob.glob(os.path.join(user_profile, name + ".*"))
            if found.endswith((".py", ".json"))]


def _copy_user_config(path: str) -> None:
    """Settings such as a multi-host run's controller_ip live in the user's profile; the cluster still gets them."""
    for found in _user_config_files():
        shutil.copy(found, path)


def check_user_config() -> None:
    """Load each of the user's settings files once, as ipyparallel will, before anything of a start runs:
    ipyparallel logs a file that raises (a traceback naming the cluster's copy) and starts without any of its
    settings, which the user then never learns."""
    for path in _user_config_files():
        _check_user_config(path)


def _check_user_config(path: str) -> None:
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    loader = PyFileConfigLoader if path.endswith(".py") else JSONFileConfigLoader
    try:
        loader(os.path.basename(path), path=os.path.dirname(path)).load_config()
    except Exception as e:  # noqa: BLE001 - whatever the user's file raises
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        where = f" line {frames[-1].lineno}" if frames else ""
        raise DistError(f"your ipyparallel settings {path}{where} raised {type(e).__name__}: {e}; "
                        "fix or remove it (nothing was started)") from None


def remove_stale_profile_dirs(root: str) -> None:
    """Remove the profile directories of kernels that have died (a SIGKILLed kernel cleans nothing up)."""
    for path in glob.glob(os.path.join(root, "cluster-*")):
        owner = owner_of(path)
        if owner is None:
            try:
                abandoned = time.time() - os.path.getmtime(path) > STALE_UNOWNED_SECONDS
            except OSError:
                continue
        else:
            abandoned = not _kernel_alive(*owner)
        if abandoned:
            shutil.rmtree(path, ignore_errors=True)


def _kernel_alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0  # the same process, not a reused pid
    except psutil.Error:
        return False


def remove_profile_dir(path: str) -> None:
    if owner_of(path) is not None:  # only a directory nbdist made
        shutil.rmtree(path, ignore_errors=True)

"""The kernel never starts MPI, and a killed kernel leaves no MPICH file in /dev/shm.

Before: after a timed-out cell on the MPI backend, renewing the ranks' groups imported the backend's mpi4py into
the kernel, which started MPI there: the kernel's later starts could no longer fork their ranks, and a kernel
killed afterwards (a JupyterHub server culled) left its 1 MB shared-memory file behind; so did the ranks' file of
the groups renewed after their start, which MPICH removes only at MPI_Finalize."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

KERNEL = r"""
import json, os, signal, sys
import nbdist
cluster = nbdist.start(2, timeout=120)
cluster.execute("import torch, torch.distributed as dist")
try:
    cluster.execute("t = torch.ones(2)\nif dist.get_rank() == 0:\n    dist.all_reduce(t)\n", timeout=3)
except nbdist.DistError as error:
    said = str(error)
again = nbdist.start(2, restart=True)
again.execute("import torch, torch.distributed as dist")
try:  # its groups renewed too: a file of MPICH's made after the ranks started, which they hold at the kill
    again.execute("t = torch.ones(2)\nif dist.get_rank() == 1:\n    dist.all_reduce(t)\n", timeout=3)
except nbdist.DistError:
    pass
print(json.dumps({"said": said, "mpi_in_kernel": "mpi4py.MPI" in sys.modules,
                  "forked": again._launched.warm_process is not None}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _mpich_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("mpich_")
            and os.stat(os.path.join("/dev/shm", name)).st_uid == os.getuid()}


def test_a_timed_out_cell_leaves_mpi_out_of_the_kernel_and_a_killed_kernel_leaves_no_file():
    before = _mpich_files()
    run = subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True, timeout=240)
    assert run.returncode == -signal.SIGKILL, run.stdout[-2000:] + run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "MPI group(s) renewed, engine variables kept" in got["said"], got
    assert not got["mpi_in_kernel"] and got["forked"], got
    deadline = time.monotonic() + 10
    while _mpich_files() - before and time.monotonic() < deadline:  # the ranks end as their kernel's lifeline goes
        time.sleep(0.2)
    assert not _mpich_files() - before

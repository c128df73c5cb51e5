"""A protection the OS refuses degrades, it never stops the start: where the kernel refuses the socket filter that
keeps Hydra's control port to this host (without CAP_NET_ADMIN, as for an ordinary user), a cluster still starts,
and its status says in one line what stays open. The kernel here is run without CAP_NET_ADMIN by setpriv
(util-linux), on a real cluster."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

KERNEL = """
import nbdist
cluster = nbdist.start(2, timeout=120, fork={fork})
try:
    print(cluster.status())
    print("ranks:", sorted(cluster.run(lambda: __import__("torch").distributed.get_rank())))
finally:
    nbdist.stop()
"""


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "launched"])
def test_a_start_without_cap_net_admin_starts_and_says_what_stays_open(fork):
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to take CAP_NET_ADMIN away: apt-get install util-linux")
    run = subprocess.run([setpriv, "--bounding-set=-net_admin", "--inh-caps=-net_admin", sys.executable, "-c",
                          KERNEL.format(fork=fork)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "ranks: [0, 1]" in run.stdout, run.stdout
    open_lines = [line for line in run.stdout.splitlines() if line.startswith("open: ")]
    assert len(open_lines) == 1 and "Hydra's control port" in open_lines[0], run.stdout


def test_a_start_with_the_filter_leaves_nothing_open(cluster):
    assert not [line for line in str(cluster.status()).splitlines() if line.startswith("open: ")]

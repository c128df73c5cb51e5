"""Under Slurm the lifeline's token crosses the network as MUNGE credentials, never in clear (issue 42), on a real
Slurm made by the test (tests/slurm_hosts.py: munged and slurmctld here, a slurmd in each of two namespace hosts).

Before: the token rode in srun's environment, which Slurm carries to the nodes in its launch request, signed by
munge but not encrypted: a capture of the hosts' bridge during a start held it (measured below, where the kernel has
no munge: that fallback is the old way, and the cluster's status says so in one line). Now srun's environment holds
one MUNGE credential per node instead, encrypted with the site's key, and the receiver before Hydra's proxy decodes
it there (cluster/hosts/token_launcher.py). A node that cannot decode it is one line naming it, at once.

Where Slurm or the hosts cannot be made, the tests skip saying why, unless NBDIST_REQUIRE_HOSTS=1.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import test_hosts_privacy as privacy
import test_hosts_slurm
from test_hosts_privacy import OUTPUT_MARK, SOURCE_MARK, Capture, _secrets
from test_hosts_slurm import assert_nothing_left

import nbdist
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistError

pytestmark = pytest.mark.multihost
slurm = test_hosts_slurm.slurm  # this module's own Slurm (a module fixture)

OPEN_LINE = ("open: the lifeline's token crosses Slurm's network in clear, in srun's environment (Slurm signs its "
             "launch request but does not encrypt it): no munge on the kernel's PATH")


def where() -> tuple[str, bool, bool]:
    """On a rank: its host, whether it holds the lifeline's token, and whether the credentials are gone."""
    import os
    import socket

    return (socket.gethostname(), len(os.environ.get("NBDIST_LIFELINE_TOKEN", "")) == 32,
            "NBDIST_LIFELINE_MUNGE" not in os.environ)


def captured_start(slurm) -> tuple[Capture, nbdist.Cluster]:
    """A cluster on both nodes, started and running a cell while every frame on the hosts' bridge is captured."""
    return privacy.captured_start(slurm.hosts.bridge, ClusterOptions(slurm={"nodes": 2, "tasks_per_node": 1},
                                                                      cpu=True, timeout=120.0))


def seen_in(payload: bytes, cluster: nbdist.Cluster) -> dict[str, bool]:
    seen = {name: secret in payload for name, secret in _secrets(cluster).items()}
    seen["the cell's source"] = SOURCE_MARK.encode() in payload
    seen["the cell's output"] = OUTPUT_MARK.encode() in payload
    return seen


@pytest.fixture()
def without(tmp_path):
    """The kernel's PATH without the commands named (a folder of links to everything else on the directories that
    held them), as on a host where they are not installed; srun gives the nodes' tasks the same PATH."""
    before = os.environ["PATH"]

    def hide(*names: str) -> None:
        links, kept = tmp_path / "bin", []
        links.mkdir()
        for folder in before.split(os.pathsep):
            if not any(Path(folder, name).exists() for name in names):
                kept.append(folder)
                continue
            for entry in Path(folder).iterdir():
                if entry.name not in names and not (links / entry.name).exists():
                    (links / entry.name).symlink_to(entry)
        os.environ["PATH"] = os.pathsep.join([*kept, str(links)])

    yield hide
    os.environ["PATH"] = before


def test_a_capture_of_a_slurm_start_holds_neither_the_token_nor_the_keys(slurm):
    capture, cluster = captured_start(slurm)
    try:
        payload = capture.payload()
        assert len(capture.frames) > 100, len(capture.frames)
        # srun's launch request was captured, its environment in clear: the credentials in it, not the token
        assert b"NBDIST_LIFELINE_MUNGE=MUNGE:" in payload
        seen = seen_in(payload, cluster)
        assert not any(seen.values()) and len(seen) >= 5, seen
        assert cluster.run(where) == [(h.name, True, True) for h in slurm.hosts.hosts]  # the cluster works
        assert "open:" not in str(cluster.status())
        srun = [p for p in cluster.processes() if p.name() == "srun"]
        assert srun and all("NBDIST_LIFELINE_TOKEN" not in p.environ() for p in srun)
    finally:
        cluster.stop()
    assert_nothing_left(slurm, 15)


def test_without_munge_the_token_crosses_in_clear_and_the_status_says_so(slurm, without):
    """The old way, measured: the token is in the capture, and the status says why in one line."""
    without("munge", "unmunge")
    capture, cluster = captured_start(slurm)
    try:
        seen = seen_in(capture.payload(), cluster)
        assert seen.pop("lifeline token") and not any(seen.values()), seen
        assert cluster.run(where) == [(h.name, True, True) for h in slurm.hosts.hosts]
        status = str(cluster.status())
        assert [line for line in status.splitlines() if line.startswith("open:")] == [OPEN_LINE], status
    finally:
        cluster.stop()
    assert_nothing_left(slurm, 15)


def test_a_node_that_cannot_decode_the_token_is_one_line_at_once(slurm, without):
    """The kernel's host has munge, the nodes no unmunge: the receivers say so and the start ends on their line,
    without waiting for its timeout (before the kernel looked for it, the other proxies, srun and mpiexec waited)."""
    without("unmunge")
    started = time.monotonic()
    with pytest.raises(DistError) as unread:
        nbdist.Cluster(ClusterOptions(slurm={"nodes": 2, "tasks_per_node": 1}, cpu=True, timeout=120.0)).start()
    line, took = str(unread.value), time.monotonic() - started
    names = [h.name for h in slurm.hosts.hosts]
    assert any(line == f"node {name} could not read the lifeline's token (a MUNGE credential): no unmunge on PATH"
               for name in names), line
    assert took < 30, took
    assert_nothing_left(slurm, 15)

"""A stopped cluster says nothing false: ipyparallel's launcher and nbdist's stop both remove a launcher's output
file when its process ends, and the loser of that race used to log an ERROR for a file already gone (seen once in a
clean-clone run, printed between a scaling sweep's result lines)."""
from __future__ import annotations

import logging
import os

import ipyparallel as ipp

from nbdist.cluster.launching.launch import _ipp_cluster
from nbdist.cluster.options import ClusterOptions


def _launcher(cluster: ipp.Cluster, output_file: str):
    """A launcher as ipyparallel makes one for this cluster (it logs through the cluster's logger)."""
    from ipyparallel.cluster.launcher import LocalProcessLauncher

    launcher = LocalProcessLauncher(log=cluster.log, profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id)
    launcher.output_file = output_file
    return launcher


def test_a_file_already_removed_is_not_an_error_but_other_failures_still_are(tmp_path, caplog):
    cluster = _ipp_cluster(ClusterOptions(n=1).resolved(), str(tmp_path), "tcp", "127.0.0.1")
    gone = tmp_path / "log" / "ipcontroller-1.log"
    launcher = _launcher(cluster, str(gone))
    with caplog.at_level(logging.ERROR, logger=cluster.log.name):
        # what ipyparallel logs when os.remove loses the race (launcher.get_output(remove=True))
        launcher.log.error(f"Failed to remove {gone}: {FileNotFoundError(2, os.strerror(2))}")
        launcher.log.error(f"Failed to remove {gone}: {PermissionError(13, os.strerror(13))}")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"Failed to remove {gone}: [Errno 13] Permission denied"], messages

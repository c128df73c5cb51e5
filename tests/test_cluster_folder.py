"""The cluster's folder is checked before anything of a start runs: where it cannot be this user's (a file in its
place, a folder another user made), one line within a second and no process left; before, both starts hung for good
in the stop of the warm process they had forked (and each try left a ~260 MB process)."""
from __future__ import annotations

import os
import time

import psutil
import pytest

import nbdist
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistError


def _refused(monkeypatch, folder) -> str:
    monkeypatch.setenv("NBDIST_CLUSTER_DIR", str(folder))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    with pytest.raises(DistError) as refused:
        # a Cluster of its own: nbdist.start() would keep a cluster another test left running, and check nothing
        nbdist.Cluster(ClusterOptions(n=2, cpu=True, timeout=30)).start()
    assert time.monotonic() - started < 1.0
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    return str(refused.value)


def test_a_file_where_the_folder_should_be_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    message = _refused(monkeypatch, tmp_path / "a-file")
    assert message == f"NBDIST_CLUSTER_DIR={tmp_path / 'a-file'} is not a folder: set NBDIST_CLUSTER_DIR to a folder of your own"


def test_a_folder_another_user_made_is_one_line(monkeypatch, tmp_path):
    if os.getuid() != 0:
        pytest.skip("making a folder owned by another user needs root (CI runs this as root)")
    folder = tmp_path / "someone-elses"
    folder.mkdir(mode=0o777)
    os.chown(folder, 4321, 4321)
    folder.chmod(0o777)
    message = _refused(monkeypatch, folder)
    assert message.endswith("belongs to another user: set NBDIST_CLUSTER_DIR to a folder of your own"), message


def test_ipyparallel_settings_that_raise_are_one_line_naming_the_file(monkeypatch, tmp_path):
    """The user's ipcluster_config.py is copied into each cluster's profile; before, one that raised was logged as
    a traceback naming the copy, and the cluster started without any of its settings."""
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    settings = profile / "ipcluster_config.py"
    settings.write_text("c = get_config()\nraise ValueError('broken setting')\n")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    root = tmp_path / "clusters"
    message = _refused(monkeypatch, root)
    assert message == (f"your ipyparallel settings {settings} line 2 raised ValueError: broken setting; "
                       "fix or remove it (nothing was started)")
    assert os.listdir(root) == []  # no profile directory of the refused cluster left

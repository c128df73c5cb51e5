"""A real 2-engine cluster (MPI engines, torch.distributed over mpi4py): collectives, status, errors, stuck ranks, stop."""
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from IPython.paths import get_ipython_dir
from kernel_driver import ANSI
from processes import wait_until_gone

import nbdist
from nbdist.cluster.hosts import lifeline
from nbdist.cluster.launching.files import remove_stale_profile_dirs
from nbdist.cluster.launching.launch import _hydra_files
from nbdist.errors import DistError, DistUsageError


def _all_reduce_ranks():
    import torch
    import torch.distributed as dist

    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t


def test_all_reduce_gives_the_sum_on_every_rank(cluster):
    results = cluster.run(_all_reduce_ranks)
    n = cluster.world_size
    expected = torch.full((2,), float(n * (n + 1) // 2))
    assert len(results) == n
    for t in results:
        assert torch.equal(t, expected)


def test_status_lists_every_rank_with_distinct_pids(cluster):
    rows = cluster.status().rows
    assert [r["rank"] for r in rows] == [0, 1]
    assert len({r["pid"] for r in rows}) == 2
    assert {r["backend"] for r in rows} == {"mpi4py"}
    assert all(r["world_size"] == 2 and r["device"] == "cpu" for r in rows)
    assert "rank" in str(cluster.status()) and "mpi4py" in str(cluster.status())


def test_results_come_back_in_rank_order(cluster):
    assert cluster.run(lambda: __import__("torch.distributed").distributed.get_rank()) == [0, 1]


def test_run_on_chosen_ranks(cluster):
    import os

    pids = cluster.run(os.getpid, ranks=[1])
    assert pids == [cluster.status().rows[1]["pid"]]


def test_execute_keeps_state_per_rank(cluster, capsys):
    cluster.execute("import torch.distributed as dist\nx = 10 * dist.get_rank()")
    cluster.execute("print('x is', x)", output="all")
    out = capsys.readouterr().out
    assert "[rank 0] x is 0" in out and "[rank 1] x is 10" in out


def test_output_rank0_by_default_and_none(cluster, capsys):
    cluster.execute("print('hello')")
    assert capsys.readouterr().out == "[rank 0] hello\n"
    cluster.execute("print('hello')", output="none")
    assert capsys.readouterr().out == ""


def test_error_names_the_rank_and_message(cluster, capsys):
    code = "import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('boom')\n"
    with pytest.raises(DistError, match=r"rank 1 raised ValueError: boom"):
        cluster.execute(code)
    err = ANSI.sub("", capsys.readouterr().err)
    assert "[rank 1]" in err and "ValueError: boom" in err
    assert "ipyparallel" not in err and "nbdist" not in err  # the user's frames only
    assert cluster.run(_all_reduce_ranks)[0][0] == 3.0  # the next call works


RAISE_WHILE_OTHER_WAITS = (
    "import torch, torch.distributed as dist\n"
    "kept = 'still here'\n"
    "if dist.get_rank() == 1:\n    raise RuntimeError('rank one failed')\n"
    "t = torch.ones(1)\ndist.all_reduce(t)\n"
)


def test_rank_raising_while_other_waits_in_all_reduce(cluster, capsys):
    """Rank 1 raises, rank 0 waits in all_reduce: on the CPU default backend (mpi4py, whose waits are interruptible)
    the error comes at once, rank 0 is freed by interrupt, and the engines keep their variables."""
    started = time.monotonic()
    with pytest.raises(DistError) as info:
        cluster.execute(RAISE_WHILE_OTHER_WAITS, timeout=30)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "rank 1 raised RuntimeError: rank one failed" in message
    assert "interrupted rank(s) 0, which then stopped" in message and "engine variables kept" in message
    assert "restarted" not in message
    assert elapsed < 10
    assert cluster.run(_all_reduce_ranks)[0][0] == 3.0
    cluster.execute("assert kept == 'still here', kept")  # the variable set before the failure, on every rank


def test_on_gloo_a_rank_stuck_in_all_reduce_costs_a_restart():
    """gloo's waits cannot be interrupted: the same case ends with the engines restarted (said in the line)."""
    from nbdist.cluster.options import ClusterOptions

    with nbdist.Cluster(ClusterOptions(n=2, backend="gloo")) as gloo:
        started = time.monotonic()
        with pytest.raises(DistError) as info:
            gloo.execute(RAISE_WHILE_OTHER_WAITS, timeout=30)
        message = str(info.value)
        assert "rank 1 raised RuntimeError: rank one failed" in message
        assert "rank(s) 0" in message and "restarted the engines" in message
        assert time.monotonic() - started < 30
        assert gloo.run(_all_reduce_ranks)[0][0] == 3.0


def test_timeout_interrupts_a_slow_cell(cluster):
    started = time.monotonic()
    with pytest.raises(DistError, match=r"timed out after 1 s: ranks 0, 1 run cell In\[\d+\]:2 in <module>, outside any "
                                        r"communication call; nbdist interrupted rank\(s\) 0, 1, which then stopped"):
        cluster.execute("import time\ntime.sleep(30)", timeout=1)
    assert time.monotonic() - started < 10
    assert cluster.run(_all_reduce_ranks)[1][0] == 3.0


def test_bad_ranks_and_output(cluster):
    with pytest.raises(DistUsageError, match="not in 0..1"):
        cluster.run(int, ranks=[5])
    with pytest.raises(DistUsageError, match="--output must be one of"):
        cluster.execute("1", output="rank7")


def test_start_while_running_keeps_the_cluster(cluster, capsys):
    assert nbdist.start(2) is cluster
    assert "already running" in capsys.readouterr().out


def test_stop_leaves_no_process():
    """A separate cluster (the shared one keeps running): stop, and every one of its processes is gone."""
    with nbdist.Cluster(nbdist.cluster.options.ClusterOptions(n=2)) as c:
        procs = c.processes()
        assert len(procs) >= 4  # controller, mpiexec, proxy, 2 engines
        temp_files = _hydra_files(procs)  # MPICH's topology files in /tmp
        shared = _mpich_segments(procs)  # MPICH's shared memory between the ranks, a file in /dev/shm
        assert shared
        profile = c._launched.cluster.profile_dir  # the cluster's own: connection files, logs
        assert os.listdir(os.path.join(profile, "security")) and not profile.startswith(get_ipython_dir())
        started = time.monotonic()
    assert time.monotonic() - started < 1.5
    assert wait_until_gone(procs, timeout=0.5) == []
    assert [f for f in temp_files if os.path.exists(f)] == []
    assert [f for f in shared if os.path.exists(f)] == []
    assert not os.path.exists(profile)
    with pytest.raises(DistUsageError, match="the cluster is stopped"):
        c.run(int)


def _mpich_segments(procs) -> set[str]:
    """The /dev/shm files MPICH mapped into the processes, whether or not they still have a name."""
    paths = set()
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                paths |= {line.split(maxsplit=5)[-1] for line in maps if " /dev/shm/mpich_" in line}
        except OSError:
            pass
    return {path.removesuffix(" (deleted)") for path in paths}


def _owned_dir(root, name: str, owner: str | None):
    folder = root / name
    folder.mkdir()
    if owner is not None:
        (folder / lifeline.OWNER_FILE).write_text(owner)
    return folder


def test_profile_dirs_of_dead_kernels_are_removed_at_start(tmp_path):
    """What a SIGKILLed kernel left (if its lifelines could not tidy) goes at the next start; nothing else does."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    me = psutil.Process()
    dead = _owned_dir(tmp_path, "cluster-dead", f"{ended.pid} {time.time()}")
    reused_pid = _owned_dir(tmp_path, "cluster-reused", f"{me.pid} {me.create_time() - 1000}")
    alive = _owned_dir(tmp_path, "cluster-alive", f"{me.pid} {me.create_time()}")
    starting = _owned_dir(tmp_path, "cluster-starting", None)  # made a moment ago, owner file not yet written
    remove_stale_profile_dirs(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, starting.name]
    assert not dead.exists() and not reused_pid.exists()


def test_lifeline_removes_only_its_kernels_directory(tmp_path):
    mine = _owned_dir(tmp_path, "cluster-mine", "4242 1.0")
    other = _owned_dir(tmp_path, "cluster-other", "4343 1.0")
    unowned = _owned_dir(tmp_path, "profile_default", None)
    for folder in (mine, other, unowned):
        lifeline.remove_if_owned_by(str(folder), 4242)
    assert not mine.exists() and other.exists() and unowned.exists()


def test_lifeline_module_runs_without_warning():
    """`python -m nbdist.cluster.hosts.lifeline` (how the controller starts) must not find itself already imported by the
    package: that prints a RuntimeWarning into JupyterLab's server log at every stop."""
    run = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "nbdist.cluster.hosts.lifeline", str(os.getpid()), "platform"],
        capture_output=True, text=True, timeout=60,
    )
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout.strip()  # the module it ran (platform) printed this machine's platform


@pytest.mark.slow
def test_import_nbdist_is_light_and_its_names_are_there():
    code = (
        "import sys, nbdist\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ipyparallel', 'torch', 'IPython', 'zmq'}))\n"
        "from nbdist import Cluster, start, current, stop, DistError, DistUsageError, Status\n"
        "print(Cluster.__module__, start.__module__, Status.__module__, DistError.__module__)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]", "nbdist.cluster.api nbdist.cluster.api nbdist.cluster.status nbdist.errors"]


def test_subpackages_are_reachable_from_the_package_without_importing_them_first():
    code = (
        "import nbdist\n"
        "print(round(nbdist.schedules.build('gpipe', 2, 2).simulate().bubble_fraction, 6))\n"
        "print(callable(nbdist.collectives.benchmark), callable(nbdist.collectives.trace), nbdist.Mesh.__name__)\n"
        "print(nbdist.cluster.meshes.mesh.make_mesh(4, dp=2, pp=2).groups('pp'))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [str(round(1 / 3, 6)), "True True Mesh", "[[0, 2], [1, 3]]"]


def test_the_users_ipyparallel_settings_reach_the_clusters_own_profile(tmp_path, monkeypatch):
    """e.g. a multi-host run's controller_ip, set in the user's profile, still applies to nbdist's cluster."""
    import ipyparallel as ipp

    from nbdist.cluster.launching.files import new_profile_dir

    user_profile = tmp_path / "ipython" / "profile_default"
    user_profile.mkdir(parents=True)
    (user_profile / "ipcluster_config.py").write_text("c.Cluster.controller_ip = '10.1.2.3'\n")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("NBDIST_CLUSTER_DIR", str(tmp_path / "clusters"))
    profile = new_profile_dir()
    assert os.path.dirname(profile) == str(tmp_path / "clusters")
    assert ipp.Cluster(profile_dir=profile, cluster_file="").controller_ip == "10.1.2.3"
    assert sorted(os.listdir(user_profile)) == ["ipcluster_config.py"]  # the user's profile only read

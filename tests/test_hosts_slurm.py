"""Engines in a Slurm allocation (issue 21), on a real Slurm made by the test: munged and slurmctld here, a slurmd in
each of two namespace hosts (tests/slurm_hosts.py).

The claims: `nbdist.start(slurm=...)` asks salloc for the allocation, runs one engine per task across the nodes as one
world, and gives the allocation back at stop (the queue empty, nothing left on any node) or when the kernel dies;
inside an existing allocation it uses that one; a request Slurm refuses, or does not grant in time, is one line,
withdrawn, nothing left; a node Slurm takes out of the allocation (its slurmd killed) is one line naming the host,
Slurm's reason and the ranks it held, and the cluster then stops cleanly.

Where Slurm or the hosts cannot be made, the tests skip saying why, unless NBDIST_REQUIRE_HOSTS=1 (CI), where that is
a failure.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from hosts import made_or_skip
from slurm_hosts import SlurmHosts
from test_device_paths import adam, data_fn, model_fn, serial, worst
from test_hosts_ssh import _command, on_rank_sleep, on_rank_sums

import nbdist
from nbdist import models
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistError, DistUsageError

pytestmark = pytest.mark.multihost

START_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def slurm():
    made = made_or_skip(lambda: SlurmHosts(2))
    before = os.environ.get("SLURM_CONF")
    os.environ.update(made.environment)  # salloc, srun and scontrol, as run by nbdist in this process
    yield made
    if before is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = before
    made.close()


def engines_on(slurm: SlurmHosts) -> set[int]:
    """What runs on the nodes besides their sshd and slurmd: job steps (slurmstepd), Hydra's proxies, engines."""
    return {p for h in slurm.hosts.hosts for p in slurm.hosts.engine_pids(h) if not _command(p).startswith("slurmd ")}


def assert_nothing_left(slurm: SlurmHosts, seconds: float) -> None:
    """Within `seconds`: the queue empty (the allocation given back) and nothing running on any node."""
    deadline = time.monotonic() + seconds
    while (slurm.jobs() or engines_on(slurm)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not slurm.jobs() and not engines_on(slurm), (slurm.jobs(), engines_on(slurm))


def start_two_by_two() -> nbdist.Cluster:
    """2 nodes × 2 tasks: ranks 0, 1 on the first node, 2, 3 on the second."""
    return nbdist.Cluster(ClusterOptions(slurm={"nodes": 2, "tasks_per_node": 2}, cpu=True,
                                         timeout=START_TIMEOUT)).start()


def test_an_allocation_asked_for_runs_the_engines_across_the_nodes_and_is_given_back(slurm):
    cluster = start_two_by_two()
    try:
        names = [h.name for h in slurm.hosts.hosts]
        assert cluster.world_size == 4 and cluster.hosts == [names[0], names[0], names[1], names[1]]
        assert len(slurm.jobs()) == 1, slurm.jobs()
        got = cluster.run(on_rank_sums)
        assert all(g["mpi"] == 6 and g["torch"][0] == 60.0 for g in got), got
        tr = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, cluster=cluster, batch_size=8, live=False,
                            plan={"dp": 2, "pp": 2, "microbatches": 2})
        try:
            tr.fit(steps=3)
            assert worst(tr.state_dict(), serial(3)) <= 1e-5  # stages on different nodes
        finally:
            tr.close()
    finally:
        cluster.stop()
    assert_nothing_left(slurm, 10)


def test_a_node_whose_slurmd_dies_is_named_with_its_ranks_and_the_cluster_stops_cleanly(slurm):
    """slurmd is killed on the second node while a cell runs. Its engines run on (slurmstepd outlives slurmd) until
    slurmctld sets the node DOWN for not responding (SlurmdTimeout=10: about 25 s) and ends the job on every node;
    srun says so in mpiexec's output, and the cell ends at once with one line: the host, Slurm's reason, its ranks.
    Stop gives the allocation back and leaves nothing on any node; slurmd is started again for the tests after."""
    cluster = start_two_by_two()
    victim = slurm.hosts.hosts[1]
    try:
        try:
            assert cluster.hosts[2:] == [victim.name, victim.name], cluster.hosts
            threading.Timer(1.0, slurm.kill_slurmd, (victim,)).start()
            started = time.monotonic()
            with pytest.raises(DistError) as lost:
                cluster.run(on_rank_sleep, 200, timeout=250)
            took, line = time.monotonic() - started, str(lost.value)
            assert line.startswith(f"host {victim.name} left the Slurm allocation (node DOWN: not responding): "
                                   f"ranks 2, 3; Slurm ends the job on every node"), line
            assert "\n" not in line and took < 60, (took, line)
        finally:
            cluster.stop()
        assert_nothing_left(slurm, 15)
    finally:
        slurm.start_slurmd(victim)  # the node returns to service when its slurmd registers again


def test_a_rank_killed_with_sigkill_is_said_so(slurm):
    """Hydra under srun reports a rank that SIGKILL ended as "EXIT CODE: 9" with no exit string; before, the line
    said "died (exit code 9)"."""
    cluster = nbdist.Cluster(ClusterOptions(slurm={"nodes": 2, "tasks_per_node": 1}, cpu=True,
                                            timeout=START_TIMEOUT)).start()
    try:
        pids = cluster.run(os.getpid)
        threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
        with pytest.raises(DistError) as died:
            cluster.run(on_rank_sleep, 60, timeout=90)
        line = str(died.value)
        assert line.startswith(f"rank 1 (pid {pids[1]} on {slurm.hosts.hosts[1].name}) died (SIGKILL: killed, or out "
                               "of memory), which ends the whole MPI job"), line
    finally:
        cluster.stop()
    assert_nothing_left(slurm, 15)


def test_a_request_slurm_refuses_is_one_line_and_nothing_stays(slurm):
    with pytest.raises(DistUsageError) as refused:
        nbdist.Cluster(ClusterOptions(slurm={"nodes": 1, "partition": "nope"}, cpu=True)).start()
    line = str(refused.value)
    assert line.startswith("Slurm refused the request (--nodes=1 --ntasks-per-node=1 --partition=nope): ")
    assert "invalid partition" in line.lower() and "\n" not in line
    assert not slurm.jobs()


def test_a_request_not_granted_in_time_is_withdrawn(slurm):
    started = time.monotonic()
    """With Slurm's own reason for keeping it pending (squeue's REASON; before, the line had none)."""
    with pytest.raises(DistError, match=r"^Slurm did not grant the request \(--nodes=3 --ntasks-per-node=1\) "
                                        r"within 5 s \(Slurm's reason: \w+\); it was withdrawn") as late:
        nbdist.Cluster(ClusterOptions(slurm={"nodes": 3}, cpu=True, timeout=5)).start()
    assert "\n" not in str(late.value)
    assert time.monotonic() - started < 15
    time.sleep(0.5)
    assert not slurm.jobs(), slurm.jobs()


INSIDE = """
import json, nbdist
cluster = nbdist.start(slurm=True, cpu=True, timeout=120)
print(json.dumps({"hosts": cluster.hosts, "sum": cluster.run(lambda: __import__("mpi4py.MPI").MPI.COMM_WORLD
                  .allreduce(1))}), flush=True)
cluster.stop()
"""


def test_inside_an_existing_allocation_the_engines_use_it(slurm):
    """A notebook server started in an allocation (salloc here): --slurm uses that allocation's nodes and tasks."""
    done = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=1", sys.executable, "-c", INSIDE],
                          capture_output=True, text=True, timeout=180, env={**os.environ, **slurm.environment},
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    said = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and said, done.stderr[-2000:]
    got = json.loads(said[-1])
    assert got["hosts"] == [h.name for h in slurm.hosts.hosts] and got["sum"] == [2, 2]
    assert not slurm.jobs()


KERNEL = """
import json, nbdist
cluster = nbdist.start(slurm={"nodes": 2}, cpu=True, timeout=120)
print(json.dumps(cluster.hosts), flush=True)
import time; time.sleep(600)
"""


def test_killing_the_kernel_gives_the_allocation_back_and_leaves_nothing(slurm):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **slurm.environment})
    try:
        assert len(json.loads(kernel.stdout.readline())) == 2
        assert slurm.jobs() and engines_on(slurm)
        kernel.kill()
        assert_nothing_left(slurm, 15)
    finally:
        kernel.kill()
        kernel.wait()


def test_slurm_choices_and_their_refusals():
    from nbdist.cluster.hosts.slurm import SlurmRequest

    request = ClusterOptions(slurm={"nodes": 2, "gpus_per_node": 4, "time": "00:30:00", "salloc_args": "--exclusive"})
    assert request.slurm.engines == 8 and request.multi_host()
    assert request.slurm.salloc(["cmd"]) == ["salloc", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4",
                                             "--time=00:30:00", "--exclusive", "cmd"]
    assert request.launch_args("10.0.0.1")[:6] == ["-launcher", "slurm", "-rmk", "slurm", "-localhost", "10.0.0.1"]
    with pytest.raises(DistUsageError, match=r"^unknown Slurm option\(s\) gpus: choose from"):
        ClusterOptions(slurm={"gpus": 2})
    with pytest.raises(DistUsageError, match=r"^-n 3, but the Slurm allocation runs 2 engines"):
        ClusterOptions(n=3, slurm={"nodes": 2}).resolved(gpus=0)
    with pytest.raises(DistUsageError, match=r"^give one of --hosts, --hostfile and --slurm$"):
        ClusterOptions(n=2, hosts="localhost", slurm=True).resolved(gpus=0)
    assert SlurmRequest.of(None) is None and SlurmRequest.of(False) is None

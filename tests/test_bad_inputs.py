"""Every bad input is one clear line, and nothing is left behind (issue 22).

Each case gives nbdist something wrong, through the API or a magic, and checks what a person sees: ONE line naming
the problem (the exception's message, or the magic's UsageError), nothing run on the ranks when the input could be
refused in the kernel, the cluster still usable afterwards (a trivial run works) and no process left after stop.
The ranks' own failures are said once for all the ranks that failed the same way, their tracebacks folded to the
user's frames; a rank's flood of output is cut; the lifeline server's waiting connections are bounded.

Real clusters throughout: the shared 2-engine `cluster` (tests/conftest.py) for the API, one kernel with its own
2-engine cluster for the magics.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from kernel_driver import ANSI, KernelDriver
from processes import wait_until_gone
from test_magics import internals, nbdist_lines, with_cluster

import nbdist
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistError, DistUsageError

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def one_line(raised: pytest.ExceptionInfo, says: str) -> str:
    """The error's message: a single line that says `says` (a regular expression)."""
    message = str(raised.value)
    assert "\n" not in message, message
    assert re.search(says, message), message
    return message


# -- start: refused in the kernel before any process starts --------------------------------------------------------

BAD_STARTS = [
    (dict(n=0), "-n must be at least 1, got 0"),
    (dict(n=-1), "-n must be at least 1, got -1"),
    (dict(n=2.5), "-n must be a whole number, got 2.5"),
    (dict(n="2"), "-n must be a whole number, got '2'"),
    (dict(n=True), "-n must be a whole number, got True"),
    (dict(n=10**6), "-n 1000000 is more engines than this machine can hold"),
    (dict(backend="foo"), "unknown backend 'foo': choose auto, gloo, nccl, mpi"),
    (dict(backend=None), "unknown backend None"),
    (dict(cpu=True, backend="nccl"), "--cpu and --backend nccl contradict each other"),
    (dict(backend="nccl"), "--backend nccl needs GPUs and none are visible here"),
    (dict(cpu="yes"), "cpu must be True or False, got 'yes'"),
    (dict(timeout=0), "--timeout must be a positive number of seconds, got 0"),
    (dict(timeout=-1), "--timeout must be a positive number of seconds, got -1"),
    (dict(timeout="x"), "--timeout must be a number of seconds, got 'x'"),
    (dict(timeout=float("nan")), "--timeout must be a positive number of seconds, got nan"),
    (dict(timeout=float("inf")), r"--timeout must be at most 1,000,000,000 seconds"),
    (dict(collective_timeout=0), "collective_timeout must be a positive number of seconds"),
    (dict(collective_timeout=float("inf")), "collective_timeout must be at most"),
    (dict(collective_timeout=1e300), "collective_timeout must be at most"),
    (dict(bogus=1), r"unknown option\(s\) bogus: choose from backend, collective_timeout"),
    (dict(hosts="no-such-host.invalid"), "host 'no-such-host.invalid' cannot be resolved"),
    (dict(hosts=[1, 2]), r"hosts must be a list of strings or one string, got \(1, 2\)"),
    (dict(hosts=",,,"), "--hosts ',,,' names no host"),
    (dict(hostfile="/no/such/file"), "--hostfile '/no/such/file': no such file"),
    (dict(hosts="localhost", hostfile="/etc/hostname"), "give one of --hosts, --hostfile and --slurm"),
    (dict(n=None, hosts="localhost"), "give -n when the engines run on several hosts"),
    (dict(mpi_args=[1]), r"mpi_args must be a list of strings or one string, got \(1,\)"),
    (dict(mpi_args=5), "mpi_args must be a list of strings or one string, got 5"),
    (dict(mpi_args='"unclosed'), "cannot be split as a shell would: No closing quotation"),
    (dict(mpi_args=["unclosed"]), "--mpi-args must begin with an mpiexec option, got 'unclosed'"),
    (dict(iface=123), "iface must be a non-empty string, got 123"),
    (dict(slurm=5), "slurm must be True or a dict of salloc choices"),
    (dict(slurm={"nodes": 0}), "--nodes must be at least 1, got 0"),
    (dict(slurm={"nodes": 1, "tasks_per_node": -2}), "--tasks-per-node must be at least 1, got -2"),
    (dict(slurm={"cores": 2}), r"unknown Slurm option\(s\) cores"),
    (dict(restart="yes"), "restart must be True or False, got 'yes'"),
]


@pytest.mark.parametrize("options, says", BAD_STARTS, ids=[repr(o) for o, _ in BAD_STARTS])
def test_a_bad_start_is_one_line_and_starts_nothing(options, says, capfd):
    before = _children()
    options = {"n": 2, **options}
    with pytest.raises(DistUsageError) as raised:
        nbdist.start(**options)
    one_line(raised, says)
    assert capfd.readouterr() == ("", "")  # nothing else said
    assert _children() - before == set()  # nothing started


@pytest.mark.parametrize("args, kwargs, says", [
    ((2,), {}, r"Cluster takes a ClusterOptions or keywords \(Cluster\(n=2, cpu=True\)\), got 2"),
    ((ClusterOptions(n=2),), {"n": 2}, "give Cluster a ClusterOptions or keywords, not both"),
    ((), {"n": 2, "bogus": 1}, r"unknown option\(s\) bogus"),
])
def test_a_bad_cluster_is_one_line(args, kwargs, says):
    with pytest.raises(DistUsageError) as raised:
        nbdist.Cluster(*args, **kwargs)
    one_line(raised, says)


def test_an_mpiexec_that_refuses_its_arguments_is_said_at_once_and_leaves_nothing():
    """mpiexec exits at once on a flag it does not know: said in one line with its complaint, in well under the
    start-up timeout (it used to wait all of it), and no process of the attempt is left."""
    before = _children()
    began = time.monotonic()
    with pytest.raises(DistError) as raised:
        nbdist.Cluster(ClusterOptions(n=2, mpi_args=["--no-such-flag"])).start()
    # mpiexec's own complaint follows, e.g. "unrecognized argument no-such-flag" (the start waits for its last words)
    one_line(raised, r"^the engines' mpiexec exited during start-up: .*no-such-flag")
    assert time.monotonic() - began < 15
    assert wait_until_gone([p for p in psutil.Process().children(recursive=True) if p.pid not in before], 5) == []


TWO_THREADS = """
import threading, time, psutil, nbdist
from nbdist.cluster import api
got = []
threads = [threading.Thread(target=lambda: got.append(nbdist.start(1))) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
clusters = {id(c) for c in got}
running = [c for c in api._running if c.running]
nbdist.stop()
still = [c for c in api._running if c.running]
time.sleep(1)
left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
print(len(got), len(clusters), len(running), len(still), len(left))
"""


def test_two_starts_from_two_threads_make_one_cluster_and_stop_stops_it():
    """One cluster per kernel: the second start waits for the first and finds it running; nbdist.stop() stops it
    and nothing is left."""
    done = subprocess.run([sys.executable, "-c", TWO_THREADS], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    # two starts, one cluster, running until stop; no cluster nor process after it
    assert lines[-1] == "2 1 1 0 0", done.stdout
    assert sum("already running" in line for line in lines) == 1


# -- run, run_each, execute: refused before anything reaches a rank ------------------------------------------------


def _mark(path):
    def mark(*_):
        open(path, "w").close()
        return 1

    return mark


def _bad_runs(cluster, mark, lock):
    return {
        "timeout=0": (lambda: cluster.run(mark, timeout=0), r"timeout must be a positive number of seconds, got 0 "
                      r"\(or None for no limit\)"),
        "timeout=-5": (lambda: cluster.run(mark, timeout=-5), "timeout must be a positive number of seconds, got -5"),
        "timeout='3'": (lambda: cluster.run(mark, timeout="3"), "timeout must be a number of seconds, got '3'"),
        "timeout=nan": (lambda: cluster.run(mark, timeout=float("nan")), "got nan"),
        "timeout=inf": (lambda: cluster.run(mark, timeout=float("inf")), "timeout must be at most"),
        "ranks=[5]": (lambda: cluster.run(mark, ranks=[5]), r"ranks \[5\] are not in 0..1"),
        "ranks='x'": (lambda: cluster.run(mark, ranks="x"), "--ranks 'x': expected 'all', '0', '0,2' or '1-3'"),
        "ranks='1-0'": (lambda: cluster.run(mark, ranks="1-0"), "ranks '1-0' are not in 0..1"),
        "ranks=[]": (lambda: cluster.run(mark, ranks=[]), r"ranks \[\] are not in 0..1"),
        "ranks=[0, 0]": (lambda: cluster.run(mark, ranks=[0, 0]), r"ranks \[0, 0\] name a rank twice"),
        "ranks=[True]": (lambda: cluster.run(mark, ranks=[True]), r"ranks \[True\] are not in 0..1"),
        "ranks=1.0": (lambda: cluster.run(mark, ranks=1.0), "ranks must be 'all', a spec like '0,2-3', a rank"),
        "not callable": (lambda: cluster.run(5), "run needs a function to call on the ranks, got 5"),
        "None": (lambda: cluster.run(None), "run needs a function to call on the ranks, got None"),
        "unpicklable closure": (lambda: cluster.run(lambda: lock), r"<lambda> or its arguments cannot be sent to "
                                r"the ranks \(TypeError: cannot pickle '_thread.lock' object\)"),
        "unpicklable argument": (lambda: cluster.run(mark, lock), "mark or its arguments cannot be sent"),
        "run_each list": (lambda: cluster.run_each(mark, [1, 2]), r"run_each takes \{rank: \(arguments, ...\)\}"),
        "run_each rank 7": (lambda: cluster.run_each(mark, {7: ()}), r"ranks \[7\] are not in 0..1"),
        "run_each int args": (lambda: cluster.run_each(mark, {0: 5}), "the arguments of rank 0 must be a tuple"),
        "run_each timeout=0": (lambda: cluster.run_each(mark, {0: ()}, timeout=0), "timeout must be a positive"),
        "run_each rank 1 unpicklable": (lambda: cluster.run_each(mark, {0: (1,), 1: (lock,)}),
                                        "mark or its arguments cannot be sent"),
        "execute 5": (lambda: cluster.execute(5), "execute takes code as a string, got int"),
        "execute timeout=-1": (lambda: cluster.execute("1", timeout=-1), "timeout must be a positive"),
        "execute output": (lambda: cluster.execute("1", output="x"), "--output must be one of rank0, all, none"),
        "execute ranks": (lambda: cluster.execute("1", ranks="0-7"), "ranks '0-7' are not in 0..1"),
        "mesh dp=3": (lambda: cluster.mesh(dp=3), "mesh dp=3 needs 3 ranks but the cluster has 2"),
    }


BAD_RUNS = list(_bad_runs(None, None, None))


@pytest.mark.parametrize("case", BAD_RUNS)
def test_a_bad_run_is_one_line_and_runs_nothing(cluster, case, tmp_path, capfd):
    marker = tmp_path / "ran"
    call, says = _bad_runs(cluster, _mark(str(marker)), threading.Lock())[case]
    with pytest.raises(DistUsageError) as raised:
        call()
    one_line(raised, says)
    assert capfd.readouterr() == ("", "")
    assert cluster.run(lambda: 1) == [1, 1]  # the cluster is as usable as before (and each rank's queue is done)
    assert not marker.exists()  # refused before any rank ran anything


def test_one_rank_or_a_list_of_ranks():
    """A rank given as a number is that rank (it used to be a raw TypeError); ranks said twice in a spec once."""
    from nbdist.cluster.arguments import chosen_ranks

    assert chosen_ranks(1, 2) == [1] and chosen_ranks("0,0", 2) == [0] and chosen_ranks(range(2), 2) == [0, 1]


def _fails_inside_torch():
    import torch

    layer = torch.nn.Linear(4, 2)
    return layer(torch.ones(3, 4, dtype=torch.float64))


def test_the_same_failure_on_every_rank_is_said_once_in_the_users_frames(cluster, capfd):
    with pytest.raises(DistError) as raised:
        cluster.run(_fails_inside_torch)
    one_line(raised, r"^ranks 0, 1 raised RuntimeError: mat1 and mat2 must have the same dtype, but got Double "
                     r"and Float$")
    err = ANSI.sub("", capfd.readouterr().err)
    lines = err.splitlines()
    assert all(line.startswith("[ranks 0, 1] ") for line in lines), err  # one block for both ranks
    assert "in _fails_inside_torch()" in err and "return layer(torch.ones(3, 4, dtype=torch.float64))" in err
    assert "site-packages" not in err and "torch/nn" not in err  # torch's own frames hidden...
    assert lines[-1] == "[ranks 0, 1] (3 frames of torch hidden: %dist_traceback shows every frame)"  # ...and said
    assert len(lines) <= 12, err
    from nbdist.cluster.waiting.remote import last_tracebacks

    whole = last_tracebacks()
    assert sorted(whole) == [0, 1] and "torch/nn/modules/linear.py" in ANSI.sub("", whole[0])


def _fails_by_rank():
    import torch.distributed as dist

    rank = dist.get_rank()
    raise ValueError("bad" if rank == 0 else f"rank {rank} is different")


def test_different_failures_are_each_said(cluster, capfd):
    with pytest.raises(DistError) as raised:
        cluster.run(_fails_by_rank)
    one_line(raised, r"^rank 0 raised ValueError: bad; rank 1 raised ValueError: rank 1 is different$")
    err = ANSI.sub("", capfd.readouterr().err)
    assert "[rank 0] ValueError: bad" in err and "[rank 1] ValueError: rank 1 is different" in err


def _floods(megabytes: int):
    import sys

    for _ in range(megabytes):
        sys.stdout.write("x" * (2**20 - 1) + "\n")
    print("the end")
    return megabytes


def test_a_flood_of_output_is_cut_and_kept_in_a_file(cluster, capfd):
    """50 MB printed by rank 0: the cell shows the first MiB and one line saying how much more there was and where
    all of it is (a file in the cluster's folder)."""
    assert cluster.run(_floods, 50) == [50, 50]
    out = capfd.readouterr().out
    assert len(out) < 2**20 + 2**12
    last = out.splitlines()[-1]
    found = re.fullmatch(r"\[rank 0\] stdout cut after 1 MiB: 49 MiB more not shown; all 50 MiB of it is in "
                         r"(\S+) until the cluster stops", last)
    assert found, last
    kept = Path(found.group(1))
    assert kept.parent.parent == Path(cluster._launched.cluster.profile_dir)
    assert kept.stat().st_size == 50 * 2**20 + len("the end\n")
    assert cluster.run(lambda: 1) == [1, 1]


def test_the_output_relay_cuts_each_rank_and_stream_once():
    """The cut without a cluster: a rank's stdout past the cap, in pieces and without a newline."""
    import io

    from nbdist.cluster.waiting.remote import OutputRelay

    kept = {}
    relay = OutputRelay([0, 1], {0, 1}, keep=lambda r, s, text: kept.setdefault((r, s), text) and f"/k/{r}", cap=10)
    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        relay.relay([{"stdout": "abc\n"}, {"stdout": "0123456789abcdef"}])
        relay.relay([{"stdout": "abc\ndef\n"}, {"stdout": "0123456789abcdefXYZ"}])
        relay.relay([{"stdout": "abc\ndef\n"}, {"stdout": "0123456789abcdefXYZ"}], final=True)
        relay.relay([{"stdout": "abc\ndef\n"}, {"stdout": "0123456789abcdefXYZ"}], final=True)
    finally:
        sys.stdout = sys_stdout
    assert out.getvalue().splitlines() == [
        "[rank 0] abc", "[rank 1] 0123456789", "[rank 0] def",
        "[rank 1] stdout cut after 10 B: 9 B more not shown; all 19 B of it is in /k/1",
    ]
    assert kept == {(1, "stdout"): "0123456789abcdefXYZ"}


# -- the lifeline server under a flood of connections ---------------------------------------------------------------

FLOOD = """
import socket, sys, time
held = [socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30) for _ in range(int(sys.argv[2]))]
print("connected", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_the_lifeline_server_holds_a_bounded_number_of_waiting_connections_and_a_lifeline_still_gets_through():
    """300 connections that never say the token (a scanner, a flood) keep at most MAX_PENDING of the kernel's files
    open (900 used to hold 850), and an engine's lifeline that connects during the flood is held."""
    from test_lifeline_hosts import _end, _gone_pid, _watched

    from nbdist.cluster.hosts.lifeline_server import MAX_PENDING, LifelineServer

    server = LifelineServer(handshake_seconds=60)  # the flood's connections would otherwise be dropped as late
    me = psutil.Process()
    before = me.num_fds()
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(server.port), "300"], stdout=subprocess.PIPE, text=True)
    watched = None
    try:
        assert flood.stdout.readline().strip() == "connected"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and server.pending() < MAX_PENDING:
            time.sleep(0.05)
        time.sleep(0.5)  # whatever is left in the listener's queue is accepted
        assert server.pending() == MAX_PENDING
        assert me.num_fds() - before <= MAX_PENDING + 2, me.num_fds() - before
        env = {**server.environment(), "NBDIST_KERNEL_HOST": "kernel-elsewhere"}
        watched = _watched(env, _gone_pid())
        assert watched.stdout.readline().strip() == "running"  # the lifeline was accepted
        assert server.held() == 1 and server.pending() <= MAX_PENDING
    finally:
        _end(*[p for p in (watched, flood) if p is not None])
        server.close()
    assert me.num_fds() <= before


# -- the magics, in a real kernel ----------------------------------------------------------------------------------

def test_the_magics_with_no_cluster_running_are_one_line_each():
    driver = KernelDriver()
    try:
        assert not driver.execute("%load_ext nbdist").error
        for line, says in [
            ("%dist_stop", "UsageError: no cluster is running: start one with %dist_start or nbdist.start()"),
            ("%dist_status", "UsageError: no cluster is running"),
            ("%dist_restart", "UsageError: no cluster is running"),
            ("%%dist\nprint(1)", "UsageError: no cluster is running"),
            ("%dist_traceback", "UsageError: no rank has failed yet in this kernel: nothing to show"),
        ]:
            shown = driver.execute(line).shown
            assert nbdist_lines(shown) == [says] or nbdist_lines(shown)[0].startswith(says), (line, shown)
            assert len(nbdist_lines(shown)) == 1, (line, shown)
        assert psutil.Process(driver.pid).children(recursive=True) == []
    finally:
        driver.shutdown()


@pytest.fixture(scope="module")
def in_kernel(kernel):
    return with_cluster(kernel)


USABLE = "%%dist\nprint('usable')"

BAD_MAGICS = [
    ("%dist_start -n abc", "UsageError: argument -n: invalid int value: 'abc'"),
    ("%dist_start -n 0 --restart", "UsageError: -n must be at least 1, got 0"),
    ("%dist_start -n 100000 --restart", "UsageError: -n 100000 is more engines than this machine can hold"),
    ("%dist_start --timeout -1 --restart", "UsageError: --timeout must be a positive number of seconds, got -1.0"),
    ("%dist_start --timeout 0 --restart", "UsageError: --timeout must be a positive number of seconds, got 0.0"),
    ("%dist_start --timeout abc", "UsageError: argument --timeout: invalid float value: 'abc'"),
    ("%dist_start --backend foo", "UsageError: unknown backend 'foo': choose auto, gloo, nccl, mpi"),
    ("%dist_start --cpu --backend nccl", "UsageError: --cpu and --backend nccl contradict each other"),
    ("%dist_start --bogus", "UsageError: unrecognized arguments: --bogus"),
    ("%dist_start 4", "UsageError: unrecognized arguments: 4"),
    ("%dist_start -n 2 --mpi-args '\"unclosed'", "UsageError: --mpi-args '\"unclosed' cannot be split as a shell "
                                                "would: No closing quotation"),  # as nbdist.start(mpi_args=) says
    ('%dist_start -n 2 --mpi-args "unclosed', "UsageError: cannot read the arguments '-n 2 --mpi-args \"unclosed': "
                                               "No closing quotation"),
    ("%dist_start --hosts ,,,", "UsageError: --hosts ',,,' names no host"),
    ("%dist_start --nodes 2", "UsageError: --nodes is a Slurm choice: add --slurm"),
    ("%dist_start --slurm --nodes 0", "UsageError: --nodes must be at least 1, got 0"),
    ("%dist_start -n 2 --hostfile /no/such", "UsageError: --hostfile '/no/such': no such file"),
    ("%%dist --timeout -1\nprint('ran')", "UsageError: --timeout must be a positive number of seconds, got -1.0"),
    ("%%dist --timeout 0\nprint('ran')", "UsageError: --timeout must be a positive number of seconds, got 0.0"),
    ("%%dist --timeout abc\nprint('ran')", "UsageError: argument --timeout: invalid float value: 'abc'"),
    ("%%dist --ranks 9\nprint('ran')", "UsageError: ranks '9' are not in 0..1"),
    ("%%dist --ranks x\nprint('ran')", "UsageError: --ranks 'x': expected 'all', '0', '0,2' or '1-3'"),
    ("%%dist --output everyone\nprint('ran')", "UsageError: --output must be one of rank0, all, none"),
    ("%%dist --bogus\nprint('ran')", "UsageError: unrecognized arguments: --bogus"),
    ("%%dist\n", "UsageError: %%dist is a cell magic, but the cell body is empty."),
    ("%dist_stop now", "UsageError: %dist_stop takes no arguments, got 'now'"),
    ("%dist_status now", "UsageError: %dist_status takes no arguments, got 'now'"),
    ("%dist_restart now", "UsageError: %dist_restart takes no arguments, got 'now'"),
    ("%dist_traceback all", "UsageError: %dist_traceback takes no arguments, got 'all'"),
    ("%dist_train nothing --steps 2", "UsageError: 'nothing' is not an nbdist.Trainer in this notebook"),
    ("%dist_train", "UsageError: the following arguments are required: trainer"),
]


@pytest.mark.parametrize("line, says", BAD_MAGICS, ids=[line.split("\n")[0] for line, _ in BAD_MAGICS])
def test_a_bad_magic_is_one_usage_line_and_the_cluster_stays(in_kernel, line, says):
    before = {p.pid for p in psutil.Process(in_kernel.pid).children(recursive=True)}
    shown = in_kernel.execute(line).shown
    assert len(nbdist_lines(shown)) == 1 and nbdist_lines(shown)[0].startswith(says), shown
    assert "ran" not in shown.split() and internals(shown) == [] and "Traceback" not in shown
    assert {p.pid for p in psutil.Process(in_kernel.pid).children(recursive=True)} == before  # nothing new, none gone
    assert in_kernel.execute(USABLE).stdout == "[rank 0] usable\n"


def test_a_cell_failing_on_every_rank_is_one_block_and_one_line_and_dist_traceback_shows_it_whole(in_kernel):
    cell = "%%dist\nimport torch\ntorch.nn.Linear(4, 2)(torch.ones(3, 4, dtype=torch.float64))"
    shown = in_kernel.execute(cell).shown
    assert nbdist_lines(shown) == ["DistError: ranks 0, 1 raised RuntimeError: mat1 and mat2 must have the same "
                                   "dtype, but got Double and Float"]
    ranks = [line for line in shown.splitlines() if line.startswith("[rank")]
    assert all(line.startswith("[ranks 0, 1] ") for line in ranks) and len(ranks) <= 10, shown
    assert "torch/nn" not in shown and "frames of torch hidden: %dist_traceback shows every frame" in shown
    whole = in_kernel.execute("%dist_traceback")
    assert whole.error is None and "torch/nn/modules/linear.py" in whole.stdout
    assert all(line.startswith("[ranks 0, 1] ") for line in whole.stdout.splitlines())
    assert in_kernel.execute(USABLE).stdout == "[rank 0] usable\n"


def test_dist_stop_leaves_no_process_and_a_second_stop_is_one_line(in_kernel):
    procs = psutil.Process(in_kernel.pid).children(recursive=True)
    assert len(procs) >= 4
    assert in_kernel.execute("%dist_stop").stdout.startswith("stopped 2 engines")
    assert wait_until_gone(procs, timeout=5) == []
    assert nbdist_lines(in_kernel.execute("%dist_stop").shown) == [
        "UsageError: no cluster is running: start one with %dist_start or nbdist.start()"]

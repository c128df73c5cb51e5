"""What a cell can do to its ranks, tried as a user would (issue 42): each fault is said in one line naming the rank,
and the cells after it run.

Real clusters throughout: the shared 2-engine `cluster` (tests/conftest.py) for the API; one kernel with its own
2-engine cluster for the magics; a cluster of its own where a rank ends the MPI job.
"""
from __future__ import annotations

import re
import time

import psutil
import pytest
from kernel_driver import ANSI, KernelDriver
from test_magics import internals, nbdist_lines, with_cluster

import nbdist
from nbdist.cluster.launching.ranks import pmi_relay
from nbdist.cluster.launching.ranks.pmi_relay import RECORD
from nbdist.errors import DistError, DistUsageError

USABLE = "print('usable')"


def one_line(raised: pytest.ExceptionInfo) -> str:
    message = str(raised.value)
    assert "\n" not in message, message
    return message


def still_usable(cluster, capfd) -> None:
    """The next cell runs at once and shows its output (a rank that cannot answer would take the whole timeout)."""
    capfd.readouterr()
    started = time.monotonic()
    cluster.execute(USABLE, timeout=30)
    assert capfd.readouterr().out == "[rank 0] usable\n"
    assert time.monotonic() - started < 10


# -- output ------------------------------------------------------------------------------------------------------------

def test_printing_100_mb_at_once_is_cut_and_said_as_30_mb_is(cluster, capfd):
    """One print of 100 MB reaches the kernel seconds after the cell's reply: the cell showed nothing of it."""
    cluster.execute("print('x' * 100_000_000)", timeout=120)
    out = capfd.readouterr().out
    assert out.startswith("[rank 0] xxxx") and len(out) < 2**20 + 2**12
    last = out.splitlines()[-1]
    assert re.fullmatch(r"\[rank 0\] stdout cut after 1 MiB: 94\.4 MiB more not shown; all 95\.4 MiB of it is in "
                        r"\S+ until the cluster stops", last), last


@pytest.mark.parametrize("breaks, how", [("sys.stdout = None", "set to None"), ("sys.stdout.close()", "closed")])
def test_a_cell_that_breaks_stdout_is_said_and_the_next_cells_run(cluster, capfd, breaks, how):
    """None: every later cell hung until its timeout (ipyparallel's flush lost the reply); closed: every later cell
    failed with 'I/O operation on closed file', saying nothing of why. Now the rank's stdout is given back."""
    cluster.execute(f"import sys\n{breaks}", timeout=30)
    assert capfd.readouterr().err == (f"[rank 0] nbdist: sys.stdout was {how} by this code; nbdist gave the rank a new "
                                      "one (its output reaches the notebook through it)\n")
    still_usable(cluster, capfd)
    assert cluster.run(_prints, timeout=30) == ["printed", "printed"]
    assert capfd.readouterr().out == "[rank 0] from a function\n"


def _prints() -> str:
    print("from a function")
    return "printed"


def _stdout_none_in_a_function() -> int:
    import sys

    sys.stdout = None
    return 1


def test_a_function_that_sets_stdout_to_none_does_not_hang_the_ranks(cluster, capfd):
    assert cluster.run(_stdout_none_in_a_function, timeout=30) == [1, 1]
    assert "sys.stdout was set to None" in capfd.readouterr().err
    still_usable(cluster, capfd)


# -- failures said in one line ---------------------------------------------------------------------------------------

def test_a_huge_exception_message_is_cut_in_the_line_saying_how_much(cluster, capfd):
    with pytest.raises(DistError) as raised:
        cluster.execute("raise ValueError('y' * 2**20)", timeout=30)
    message = one_line(raised)
    assert re.fullmatch(r"ranks 0, 1 raised ValueError: y{488}\.\.\. \(1,048,088 more characters not shown: "
                        r"%dist_traceback shows them\)", message), message[:700]
    err = ANSI.sub("", capfd.readouterr().err)
    assert max(len(line) for line in err.splitlines()) < 2200 and "more characters not shown" in err
    from nbdist.cluster.waiting.remote import last_tracebacks

    assert "y" * 2**20 in last_tracebacks()[0]  # %dist_traceback has it whole


def test_sys_exit_is_one_line_naming_the_ranks_without_ipythons_warning(cluster, capfd):
    with pytest.raises(DistError) as raised:
        cluster.execute("import sys\nsys.exit(3)", timeout=30)
    assert one_line(raised) == ("ranks 0, 1 called sys.exit(3), which ends the cell there, not the rank: the engines "
                                "and their variables are kept (%dist_stop ends them)")
    shown = capfd.readouterr()
    assert "site-packages" not in shown.err + shown.out and "To exit" not in shown.err and shown.err == ""
    still_usable(cluster, capfd)


def test_a_keyboard_interrupt_the_cell_raises_is_its_own_exception(cluster, capfd):
    cell = "import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise KeyboardInterrupt('mine')"
    with pytest.raises(DistError) as raised:
        cluster.execute(cell, timeout=30)
    assert one_line(raised) == "rank 1 raised KeyboardInterrupt: mine"
    assert "[rank 1] KeyboardInterrupt: mine" in ANSI.sub("", capfd.readouterr().err)


def test_a_timeout_too_short_to_mean_anything_is_refused_before_the_cell_runs(cluster, tmp_path, capfd):
    """1e-9 s ran the cell, showed its output, then said "timed out"."""
    marker = tmp_path / "ran"
    with pytest.raises(DistUsageError) as raised:
        cluster.execute(f"open({str(marker)!r}, 'w').close()\nprint('ran')", timeout=1e-9)
    assert one_line(raised) == ("timeout 1e-09 s is too short to mean anything (a cell takes longer to reach the ranks "
                                "and answer): give at least 0.1 s (or None for no limit)")
    assert not marker.exists() and capfd.readouterr().out == ""
    with pytest.raises(DistUsageError, match="too short to mean anything"):
        cluster.run(_prints, timeout=0.01)


def test_a_destroyed_process_group_is_said_at_once_and_the_next_cell_is_not_stuck(cluster, capfd):
    """Rank 0 destroyed its process group, then a collective: the renewal of the MPI groups waited 60 s for rank 0
    (64 s in all), and the next cell stayed stuck behind it."""
    try:
        cluster.execute("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.destroy_process_group()")
        collective = "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)"
        started = time.monotonic()
        with pytest.raises(DistError) as raised:
            cluster.execute(collective, timeout=120)
        assert time.monotonic() - started < 20
        message = one_line(raised)
        assert message.endswith("; rank 0 has no process group any more (torch.distributed.destroy_process_group() "
                                "ended it), so no collective can run: %dist_restart (or cluster.restart()) starts "
                                "fresh engines with a new one; engine variables are lost"), message
        assert message.startswith("rank 0 raised ValueError: Default process group has not been initialized")
        still_usable(cluster, capfd)
    finally:
        cluster.restart()  # the shared cluster as other tests expect it: a process group on every rank


# -- start: mpiexec's arguments ----------------------------------------------------------------------------------------

def test_an_mpi_arg_nbdist_owns_is_refused_before_the_running_cluster_is_stopped(cluster):
    """`restart=True, mpi_args="-n 5"` stopped the running cluster, then mpiexec refused the option."""
    engines = {p.pid for p in cluster.processes()}
    with pytest.raises(DistUsageError) as raised:
        nbdist.start(2, restart=True, mpi_args="-n 5")
    assert one_line(raised) == ("--mpi-args '-n': nbdist gives mpiexec the number of engines itself; ask for them with "
                                "-n (nbdist.start(n))")
    assert cluster.running and {p.pid for p in cluster.processes()} == engines
    assert cluster.run(_prints, timeout=30) == ["printed", "printed"]


@pytest.fixture(scope="module")
def in_kernel(kernel):
    return with_cluster(kernel)


def _children(driver: KernelDriver) -> set[int]:
    return {p.pid for p in psutil.Process(driver.pid).children(recursive=True)}


@pytest.mark.parametrize("line, says", [
    ('%dist_start --restart --mpi-args "-n 5"',
     "UsageError: --mpi-args '-n': nbdist gives mpiexec the number of engines itself; ask for them with -n"),
    ("%%dist --timeout 1e-9\nprint('ran')", "UsageError: --timeout 1e-09 s is too short to mean anything"),
], ids=["mpi-args -n 5", "timeout 1e-9"])
def test_the_magics_refuse_in_one_line_and_the_cluster_stays(in_kernel, line, says):
    before = _children(in_kernel)
    shown = in_kernel.execute(line).shown
    assert len(nbdist_lines(shown)) == 1 and nbdist_lines(shown)[0].startswith(says), shown
    assert "ran" not in shown.split() and internals(shown) == []
    assert _children(in_kernel) == before
    assert in_kernel.execute(f"%%dist\n{USABLE}").stdout == "[rank 0] usable\n"


def test_the_magic_splits_mpi_args_as_the_function_does(in_kernel):
    """`--mpi-args "-launcher-exec /bin/false"` reached mpiexec as one argument, which it refused ("unrecognized
    argument launcher-exec /bin/false"); split, Hydra takes it (on one host it launches nothing through it)."""
    result = in_kernel.execute('%dist_start --restart -n 2 --mpi-args "-launcher-exec /bin/false"')
    assert result.error is None, result.shown
    assert in_kernel.execute(f"%%dist\n{USABLE}").stdout == "[rank 0] usable\n"


# -- a rank that ends the MPI job --------------------------------------------------------------------------------------

ABORT = ("from mpi4py import MPI\nif MPI.COMM_WORLD.Get_rank() == 1:\n    MPI.COMM_WORLD.Abort(3)\n"
         "MPI.COMM_WORLD.Barrier()")  # rank 0 waits for rank 1, which never comes: Hydra ends it


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_a_rank_calling_mpi_abort_is_named_with_its_code(fork):
    """Rank 1 calls MPI_Abort(3): Hydra ends both ranks at once. MPICH's line naming it reached mpiexec's output in
    5 of 10 forked and 6 of 10 fresh tries (mpiexec exits as it reads the abort command, which often comes first);
    the others read "ranks 0, 1 died together". Now the rank's PMI relay records the line before Hydra hears of the
    abort (cluster/launching/ranks/pmi_relay.py): named 10 of 10 times each."""
    from nbdist.cluster.options import ClusterOptions

    with nbdist.Cluster(ClusterOptions(n=2, fork=fork)) as aborting:
        assert (aborting._launched.warm_process is not None) == fork  # the kind of rank this test is about
        with pytest.raises(DistError) as raised:
            aborting.execute(ABORT, timeout=60)
    message = one_line(raised)
    assert re.fullmatch(r"rank 1 \(pid \d+ on \S+\) called MPI_Abort with error code 3 \(on MPI_COMM_WORLD\), which "
                        r"ends the whole MPI job; %dist_restart .*", message), message


def test_mpichs_words_for_mpi_abort_name_the_rank_and_its_code():
    """MPICH's line (as a fresh rank's mpiexec output held it, measured, and as the PMI relay records it) names the
    rank that called MPI_Abort; before, every rank seen dead at once read "died together"."""
    from nbdist.cluster.waiting.deaths import DeathWatch

    watch = DeathWatch({0: ("vm", 11), 1: ("vm", 12)})
    said = "Abort(3) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 3) - process 1\n"
    assert watch.aborted(said) == ("rank 1 (pid 12 on vm) called MPI_Abort with error code 3 (on MPI_COMM_WORLD), "
                                   "which ends the whole MPI job")
    assert watch.aborted("BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES") is None
    recorded = RECORD.format(pid=12, code=3, rank=1)
    assert watch.aborted(recorded) == watch.aborted(said)


def test_the_pmi_relay_records_an_abort_before_passing_it_on(tmp_path):
    """The relay between a rank and Hydra writes the record to the cluster's folder before Hydra reads the command,
    and passes every byte on unchanged, both ways."""
    import socket
    import threading

    rank, rank_end = socket.socketpair()
    hydra_end, hydra = socket.socketpair()
    record = pmi_relay.recorder("1", lambda: 12, str(tmp_path))
    relaying = threading.Thread(target=pmi_relay.relay, args=(hydra_end.fileno(), rank_end.fileno(), record))
    relaying.start()
    rank.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\n")
    assert hydra.recv(100) == b"cmd=init pmi_version=1 pmi_subversion=1\n"
    hydra.sendall(b"cmd=response_to_init rc=0\n")
    assert rank.recv(100) == b"cmd=response_to_init rc=0\n"
    assert not (tmp_path / "mpi-abort-12").exists()
    rank.sendall(b"cmd=abo")
    assert hydra.recv(100) == b"cmd=abo" and not (tmp_path / "mpi-abort-12").exists()
    rank.sendall(b"rt exitcode=3 message=abort\n")
    assert hydra.recv(100) == b"rt exitcode=3 message=abort\n"
    assert (tmp_path / "mpi-abort-12").read_text() == RECORD.format(pid=12, code=3, rank=1)
    rank.close()
    relaying.join(5)
    assert not relaying.is_alive()

"""What of the GPU paths a CPU cluster can prove: after a rank fails, a GPU cluster's waiter asks every rank to
synchronise (cluster/waiting/ranks/gpu_sync.py) and says what it did; on CPU ranks that synchronise is immediate and true."""
import pytest

import nbdist
from nbdist.cluster.options import ClusterOptions
from nbdist.cluster.waiting.ranks import gpu_sync
from nbdist.cluster.waiting.recovery import Recovery
from nbdist.cluster.waiting.remote import Waiter


@pytest.fixture(scope="module")
def two():
    cluster = nbdist.Cluster(ClusterOptions(n=2)).start()
    yield cluster
    cluster.stop()


def fail_on_rank_one(rank_of):
    from nbdist.cluster.launching.ranks.boot import boot

    if boot().rank == rank_of:
        raise ValueError("boom")
    return "ok"


class Counted(Recovery):
    """The cluster's own answers, with bringing the ranks back in step counted and said."""

    def __init__(self, cluster, calls: list):
        launched = cluster._launched
        super().__init__(cluster, launched.cluster, launched.lifeline, cluster._info, cluster._view,
                         cluster._mark_ended)
        self.calls = calls

    def back_in_step(self) -> str:
        self.calls.append(True)
        return "the ranks were brought back in step"


def waiter(cluster, ar, calls: list) -> Waiter:
    return Waiter(ar=ar, ranks=[0, 1], on=Counted(cluster, calls))


def test_a_failure_asks_to_bring_the_ranks_back_in_step_and_says_so(two):
    calls = []
    ar = two._view([0, 1]).apply_async(fail_on_rank_one, 1)
    with pytest.raises(nbdist.DistError) as raised:
        waiter(two, ar, calls).wait()
    assert calls == [True]
    assert "rank 1 raised ValueError: boom" in str(raised.value)
    assert "the ranks were brought back in step" in str(raised.value)


def test_no_failure_no_resynchronisation(two):
    calls = []
    ar = two._view([0, 1]).apply_async(fail_on_rank_one, 7)
    assert waiter(two, ar, calls).wait() == ["ok", "ok"]
    assert calls == []


def test_cpu_ranks_are_always_in_step(two):
    assert two.run(gpu_sync.synchronise, 1.0) == [True, True]
    assert two._recovery().gpus_in_step().endswith("in step")
    assert two._recovery().back_in_step() == ""  # CPU engines, no MPI-backend group: nothing to do, nothing said

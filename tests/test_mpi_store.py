"""The rendezvous store carried over MPI (cluster/hosts/ranks/mpi_store.py), on real engines: torch's Store interface as
torch's own stores answer it, gloo formed through it, and a wait for a key nobody sets ends in one line.

Off the kernel's host (other hosts, several hosts) it is every cluster's rendezvous: no socket opened for it (the
namespace-host tests check that a two-host cluster's default store is this one)."""
from __future__ import annotations

import datetime

import pytest


def _store_calls() -> dict:
    """On every rank: a fresh store over the world (a collective), every call torch makes of a store."""
    import torch.distributed as dist
    from mpi4py import MPI

    from nbdist.cluster.hosts.ranks.mpi_store import over_mpi

    world = MPI.COMM_WORLD
    store = over_mpi(world, datetime.timedelta(seconds=30))
    me = world.rank
    store.set(f"key{me}", f"value{me}")
    store.wait([f"key{r}" for r in range(world.size)])  # every rank's key: waits for the others' sets
    seen = {
        "get": [store.get(f"key{r}") for r in range(world.size)],
        "check": (store.check(["key0"]), store.check(["key0", "nobody"])),
        "multi_get": store.multi_get(["key0", "key1"]),
    }
    world.Barrier()
    seen["add"] = store.add("counter", me + 1)
    world.Barrier()
    seen["sum"] = store.add("counter", 0)  # 1 + 2 over two ranks, whoever added first
    if me == 0:
        store.append("log", b"a")
        store.append("log", b"b")
        store.multi_set(["m1", "m2"], [b"x", b"y"])
        seen["compare_set"] = (store.compare_set("cs", b"", b"first"), store.compare_set("cs", b"zz", b"no"),
                               store.compare_set("cs", b"first", b"second"))
    world.Barrier()
    seen["log"], seen["m"] = store.get("log"), store.multi_get(["m1", "m2"])
    world.Barrier()
    if me == 0:
        seen["deleted"] = (store.delete_key("log"), store.delete_key("log"))
    world.Barrier()
    seen["num_keys"] = store.num_keys()
    try:
        store.wait(["nobody sets this"], datetime.timedelta(seconds=0.5))
    except dist.DistStoreError as error:
        seen["timeout"] = str(error)
    world.Barrier()
    store.close()
    return seen


def test_every_store_call_answers_as_torchs_stores_do(cluster):
    first, second = cluster.run(_store_calls)
    for seen in (first, second):
        assert seen["get"] == [b"value0", b"value1"]
        assert seen["check"] == (True, False)
        assert seen["multi_get"] == [b"value0", b"value1"]
        assert seen["sum"] == 3
        assert seen["log"] == b"ab" and seen["m"] == [b"x", b"y"]
        assert seen["num_keys"] == 6  # key0, key1, counter, m1, m2, cs (log deleted)
        assert seen["timeout"].startswith("the rendezvous store timed out: wait(['nobody sets this'])")
        assert "\n" not in seen["timeout"]
    assert sorted([first["add"], second["add"]]) in ([1, 3], [2, 3])
    assert first["compare_set"] == (b"first", b"first", b"second")
    assert first["deleted"] == (True, False)


def _gloo_through_the_store() -> list[float]:
    """A gloo process group formed through a store over MPI, then an all-reduce on it."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from nbdist.cluster.hosts.ranks.mpi_store import over_mpi

    world = MPI.COMM_WORLD
    ours = over_mpi(world, datetime.timedelta(seconds=30))
    group = dist.ProcessGroupGloo(dist.PrefixStore("gloo-test", ours), world.rank, world.size,
                                  datetime.timedelta(seconds=30))
    x = torch.tensor([float(world.rank + 1)] * 3)
    group.allreduce([x]).wait()
    world.Barrier()
    ours.close()
    return x.tolist()


def test_gloo_forms_through_the_store_and_reduces_right(cluster):
    assert cluster.run(_gloo_through_the_store) == [[3.0, 3.0, 3.0]] * 2


@pytest.mark.parametrize("value, says", [(3, "store values are bytes or text, got int")])
def test_a_value_that_is_not_bytes_is_one_line(cluster, value, says):
    def bad_set(v):
        from mpi4py import MPI

        from nbdist.cluster.hosts.ranks.mpi_store import over_mpi

        store = over_mpi(MPI.COMM_WORLD, datetime.timedelta(seconds=5))
        try:
            store.set("k", v)
            return "accepted"
        except TypeError as error:
            return str(error)
        finally:
            MPI.COMM_WORLD.Barrier()
            store.close()

    assert cluster.run(bad_set, value) == [says] * 2

"""The mpi4py torch.distributed backend (nbdist/backend/ranks/mpi_backend.py) on a real 4-engine MPI cluster.

Every operation runs twice on the same inputs, once on a gloo group and once on an mpi4py group of the same ranks,
and the results must agree: exactly for integers, bools, min and max and for data moved unchanged, within 1e-6
for floating sums and products (the two libraries add in different orders). Ranks 0..k-1 for k = 2, 3, 4;
sub-groups whose group ranks differ from their global ranks; async works waited out of order; non-contiguous,
bf16 and zero-size tensors. Then the failures: a rank raising while its peer waits in an all-reduce frees the
peer by interrupt (the engines and their variables stay), and a group's timeout ends a wait naming the operation.

The engine functions import what they use inside: cluster.run looks their global names up on the engines. They
raise AssertionError by hand: pytest rewrites `assert` statements into code that needs names only the kernel has.
"""
from __future__ import annotations

import pytest
import torch

import nbdist

# -- what runs on the engines ------------------------------------------------------------------------------------


def every_op(k: int) -> dict | None:
    """On every rank: each case on a gloo and an mpi4py group of ranks 0..k-1; {case: (gloo, mpi4py, tolerance)}
    on the members, None elsewhere."""
    import torch
    import torch.distributed as dist

    from nbdist.backend.ranks import mpi_backend
    from nbdist.cluster.meshes.ranks import groups
    from nbdist.runtime.ranks import registry

    mpi_backend.register()
    ranks = list(range(k))
    pair = registry.get_or_make("group", f"test-mpi4py:{ranks}", lambda: groups.Held("test groups", tuple(ranks), (
        dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="mpi4py")))).handle
    r, n, R = dist.get_rank(), k, dist.ReduceOp
    if r >= k:
        return None
    last = n - 1

    def values(dtype, shape=(2, 3), seed=0, exact=False):
        """This rank's inputs: small integers (exact in every dtype, products in range) or normal floats."""
        g = torch.Generator().manual_seed(100 * seed + r)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        if exact or not (dtype.is_floating_point or dtype.is_complex):
            return torch.randint(0, 4, shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    def all_reduce(dtype, op, exact=False):
        def run(group):
            t = values(dtype, exact=exact)
            dist.all_reduce(t, op=op, group=group)
            return t
        return run

    cases = {}
    reductions = {torch.float32: "SUM AVG PRODUCT MIN MAX", torch.float64: "SUM AVG PRODUCT MIN MAX",
                  torch.float16: "SUM AVG PRODUCT MIN MAX", torch.bfloat16: "SUM AVG PRODUCT MIN MAX",
                  torch.int8: "SUM PRODUCT MIN MAX BAND BOR BXOR", torch.uint8: "SUM PRODUCT MIN MAX BAND BOR BXOR",
                  torch.int32: "SUM PRODUCT MIN MAX BAND BOR BXOR", torch.int64: "SUM PRODUCT MIN MAX BAND BOR BXOR",
                  torch.bool: "SUM PRODUCT MIN MAX", torch.complex64: "SUM AVG"}
    for dtype, ops in reductions.items():
        for op in ops.split():
            half = dtype in (torch.float16, torch.bfloat16)
            tolerance = 1e-6 if op in ("SUM", "AVG", "PRODUCT") and (dtype.is_floating_point or dtype.is_complex) else 0
            if half:  # integers: exact in both; AVG divides, rounded to the dtype once here, per step in gloo
                tolerance = 1e-2 if op == "AVG" else 0
            cases[f"all_reduce {op} {dtype}"] = (all_reduce(dtype, getattr(R, op), exact=half), tolerance)

    def broadcast(dtype):
        def run(group):
            t = values(dtype, seed=1)
            dist.broadcast(t, last, group=group)
            return t
        return run

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        cases[f"broadcast {dtype}"] = (broadcast(dtype), 0)

    def all_gather(dtype):
        def run(group):
            out = [torch.empty(2, 3, dtype=dtype) for _ in range(n)]
            dist.all_gather(out, values(dtype, seed=2), group=group)
            return out
        return run

    def all_gather_into_tensor(dtype):
        def run(group):
            out = torch.empty(2 * n, 3, dtype=dtype)
            dist.all_gather_into_tensor(out, values(dtype, seed=3), group=group)
            return out
        return run

    def all_gather_in_place(group):
        out = torch.zeros(n * 5)
        mine = out[5 * r:5 * (r + 1)]
        mine.copy_(values(torch.float32, (5,), seed=21))
        dist.all_gather_into_tensor(out, mine, group=group)  # the input is this rank's slot, as FSDP2 does
        return out

    cases["all_gather_into_tensor in place"] = (all_gather_in_place, 0)
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        cases[f"all_gather {dtype}"] = (all_gather(dtype), 0)
        cases[f"all_gather_into_tensor {dtype}"] = (all_gather_into_tensor(dtype), 0)

    def reduce_scatter(op, dtype=torch.float32):
        def run(group):
            out = torch.empty(3, dtype=dtype)
            dist.reduce_scatter(out, [values(dtype, (3,), seed=4 + i) for i in range(n)], op=op, group=group)
            return out
        return run

    def reduce_scatter_tensor(op, dtype=torch.float32, exact=False):
        def run(group):
            out = torch.empty(2, 3, dtype=dtype)
            dist.reduce_scatter_tensor(out, values(dtype, (2 * n, 3), seed=5, exact=exact), op=op, group=group)
            return out
        return run

    cases["reduce_scatter SUM"] = (reduce_scatter(R.SUM), 1e-6)
    cases["reduce_scatter MAX"] = (reduce_scatter(R.MAX), 0)
    cases["reduce_scatter SUM int64"] = (reduce_scatter(R.SUM, torch.int64), 0)
    cases["reduce_scatter_tensor SUM"] = (reduce_scatter_tensor(R.SUM), 1e-6)
    cases["reduce_scatter_tensor AVG"] = (reduce_scatter_tensor(R.AVG), 1e-6)
    cases["reduce_scatter_tensor MIN"] = (reduce_scatter_tensor(R.MIN), 0)
    cases["reduce_scatter_tensor SUM bf16"] = (reduce_scatter_tensor(R.SUM, torch.bfloat16, exact=True), 0)

    def all_to_all_single(uneven):
        def run(group):
            if not uneven:
                out = torch.empty(2 * n, 3)
                dist.all_to_all_single(out, values(torch.float32, (2 * n, 3), seed=6), group=group)
                return out
            send = [j + 1 for j in range(n)]  # rank r sends j+1 rows to rank j and gets r+1 rows from each
            out = torch.empty((r + 1) * n, 3)
            dist.all_to_all_single(out, values(torch.float32, (sum(send), 3), seed=7), [r + 1] * n, send,
                                   group=group)
            return out
        return run

    def all_to_all(group):
        out = [torch.empty(2, 2) for _ in range(n)]  # equal sizes: gloo's all_to_all takes no others
        dist.all_to_all(out, [values(torch.float32, (2, 2), seed=8 + i) for i in range(n)], group=group)
        return out

    cases["all_to_all_single equal"] = (all_to_all_single(False), 0)
    cases["all_to_all_single uneven"] = (all_to_all_single(True), 0)
    cases["all_to_all"] = (all_to_all, 0)

    def gather(group):
        out = [torch.empty(2, 3) for _ in range(n)] if r == 0 else None
        dist.gather(values(torch.float32, seed=9), out, dst=0, group=group)
        return out

    def scatter(group):
        out = torch.empty(2, 3)
        dist.scatter(out, [values(torch.float32, seed=10 + i) for i in range(n)] if r == 0 else None, src=0,
                     group=group)
        return out

    def reduce(op):
        def run(group):
            t = values(torch.float32, seed=11)
            dist.reduce(t, last, op=op, group=group)
            return t if r == last else None  # other ranks' tensors are unspecified after a reduce
        return run

    cases["gather"], cases["scatter"] = (gather, 0), (scatter, 0)
    cases["reduce SUM"], cases["reduce MAX"] = (reduce(R.SUM), 1e-6), (reduce(R.MAX), 0)

    def ring(group):
        got = torch.empty(4)
        works = [dist.isend(values(torch.float32, (4,), seed=12), (r + 1) % n, group=group),
                 dist.irecv(got, (r - 1) % n, group=group)]
        for w in reversed(works):
            w.wait()
        return got

    def batch_both_ways(group):
        left, right = torch.empty(3, dtype=torch.bfloat16), torch.empty(3, dtype=torch.bfloat16)
        mine = values(torch.bfloat16, (3,), seed=13)
        ops = [dist.P2POp(dist.isend, mine, (r + 1) % n, group), dist.P2POp(dist.isend, mine, (r - 1) % n, group),
               dist.P2POp(dist.irecv, left, (r - 1) % n, group), dist.P2POp(dist.irecv, right, (r + 1) % n, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return [left, right]

    def barrier(group):
        dist.barrier(group=group)
        return torch.tensor(True)

    def objects(group):
        everyone = [None] * n
        dist.all_gather_object(everyone, {"rank": r, "name": f"r{r}"}, group=group)
        sent = [{"from": last}] if r == last else [None]
        dist.broadcast_object_list(sent, src=last, group=group)
        return everyone + sent

    cases["isend/irecv ring"], cases["batch_isend_irecv"] = (ring, 0), (batch_both_ways, 0)
    cases["barrier"], cases["objects"] = (barrier, 0), (objects, 0)

    def non_contiguous(group):
        strided = group is pair[1]  # gloo gets the same values laid out contiguously: the reference
        # (gloo itself mishandles some strided tensors: a broadcast into a strided view received half of it)

        def lay(t):
            """t's values; on the mpi4py run in a view with stride 2 in its last dimension."""
            if not strided:
                return t
            holder = torch.zeros(*t.shape, 2, dtype=t.dtype)
            holder[..., 1] = t
            view = holder[..., 1]
            if view.is_contiguous() and t.numel() > 1:
                raise AssertionError("the view meant to be strided is contiguous")
            return view

        base = lay(values(torch.float32, (3, 4), seed=14))
        dist.all_reduce(base, group=group)
        column = lay(torch.arange(4.0) + 7 if r == last else torch.zeros(4))
        dist.broadcast(column, last, group=group)
        gathered = [lay(torch.zeros(3)) for _ in range(n)]
        dist.all_gather(gathered, lay(values(torch.float32, (3,), seed=15)), group=group)
        out = lay(torch.zeros(2 * n, 3))
        dist.all_gather_into_tensor(out, lay(values(torch.float32, (2, 3), seed=15)), group=group)
        half = lay(values(torch.bfloat16, (4, 3), seed=16, exact=True))
        dist.all_reduce(half, group=group)
        scattered = lay(torch.zeros(2, 3))
        dist.reduce_scatter_tensor(scattered, lay(values(torch.float32, (2 * n, 3), seed=18)), group=group)
        moved = lay(torch.zeros(2 * n))
        dist.all_to_all_single(moved, lay(values(torch.float32, (2 * n,), seed=19)), group=group)
        got = lay(torch.zeros(3))
        works = [dist.isend(lay(values(torch.float32, (3,), seed=20)), (r + 1) % n, group=group),
                 dist.irecv(got, (r - 1) % n, group=group)]
        for w in works:
            w.wait()
        return [base, column, *gathered, out, half, scattered, moved, got]

    def zero_size(group):
        empty = torch.empty(0, 3)
        dist.all_reduce(empty, group=group)
        dist.broadcast(torch.empty(0), 0, group=group)
        out = torch.empty(0, 3)
        dist.all_gather_into_tensor(out, torch.empty(0, 3), group=group)
        moved = torch.empty(0)
        dist.all_to_all_single(moved, torch.empty(0), group=group)
        return [empty, out, moved]

    def async_out_of_order(group):
        tensors = [values(torch.float32, (m,), seed=17 + m) for m in (5, 1, 300)]
        works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
        works[2].wait()
        works[0].wait()
        future = works[1].get_future()
        value = future.wait()
        works[1].wait()  # gloo marks a work complete a moment after its future: is_completed() may lag without
        completed = [w.is_completed() for w in works]
        if completed != [True] * 3 or value[0] is not tensors[1]:  # no assert: pytest rewrites them for the kernel
            raise AssertionError(f"works completed: {completed}; future's value is the tensor: {value[0] is tensors[1]}")
        return tensors

    cases["non-contiguous"], cases["zero-size"] = (non_contiguous, 1e-6), (zero_size, 0)
    cases["async out of order"] = (async_out_of_order, 1e-6)

    return {name: (run(pair[0]), run(pair[1]), tolerance) for name, (run, tolerance) in cases.items()}


def ddp_steps() -> dict:
    """On every rank: three SGD steps of a small model under DistributedDataParallel over gloo and over mpi4py
    (DDP's reducer calls the group from C++ and waits on its works' futures); the parameters after each."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.backend.ranks import mpi_backend
    from nbdist.cluster.meshes.ranks import groups
    from nbdist.runtime.ranks import registry

    mpi_backend.register()
    world = list(range(dist.get_world_size()))
    mpi = registry.get_or_make("group", "test-mpi4py:world", lambda: groups.Held(
        "test world", tuple(world), dist.new_group(world, backend="mpi4py"))).handle
    params = {}
    for backend, group in (("gloo", None), ("mpi4py", mpi)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.0005)  # several buckets
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(1 + dist.get_rank())
        for _ in range(3):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(torch.randn(4, 8)), torch.randn(4, 2)).backward()
            optimizer.step()
        params[backend] = [p.detach().clone() for p in model.parameters()]
    return params


def in_groups(kind: str) -> dict:
    """On every rank: sub-groups [0, 2], [1, 3] and [1, 2, 3], each on gloo and on mpi4py (made once, in the same
    order everywhere); the same operations on both, with global ranks as torch takes them."""
    import torch
    import torch.distributed as dist

    from nbdist.backend.ranks import mpi_backend
    from nbdist.cluster.meshes.ranks import groups
    from nbdist.runtime.ranks import registry

    mpi_backend.register()
    layouts = ([0, 2], [1, 3], [1, 2, 3])
    made = registry.get_or_make("group", "test-mpi4py:sub-groups", lambda: groups.Held("test sub-groups", (), [
        (ranks, dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="mpi4py"))
        for ranks in layouts])).handle
    r, results = dist.get_rank(), {}
    for ranks, gloo, mpi in made:
        if r not in ranks:
            continue
        for backend, group in (("gloo", gloo), ("mpi4py", mpi)):
            t = torch.arange(4.0) * (r + 1)
            dist.all_reduce(t, group=group)
            b = torch.full((2,), float(r))
            dist.broadcast(b, ranks[-1], group=group)  # global rank of the group's last member
            out = torch.empty(2 * len(ranks))
            dist.all_gather_into_tensor(out, torch.full((2,), float(r)), group=group)
            me = ranks.index(r)
            got = torch.empty(1)
            reqs = [dist.isend(torch.tensor([10.0 * r]), ranks[(me + 1) % len(ranks)], group=group),
                    dist.irecv(got, ranks[(me - 1) % len(ranks)], group=group)]
            for w in reqs:
                w.wait()
            results[(tuple(ranks), backend)] = [t, b, out, got, dist.get_rank(group), dist.get_world_size(group)]
    return results


def waits_in_all_reduce(fail_rank: int):
    """Rank `fail_rank` raises at once; rank 0 waits in an mpi4py all-reduce for it (ranks 2, 3 return)."""
    import torch
    import torch.distributed as dist

    from nbdist.backend.ranks import mpi_backend
    from nbdist.cluster.meshes.ranks import groups
    from nbdist.runtime.ranks import registry

    mpi_backend.register()
    pair = registry.get_or_make("group", "test-mpi4py:pair", lambda: groups.Held(
        "test pair", (0, 1), dist.new_group([0, 1], backend="mpi4py"))).handle
    if dist.get_rank() == fail_rank:
        raise ValueError("broken before the all-reduce")
    if dist.get_rank() in (0, 1):
        dist.all_reduce(torch.ones(3), group=pair)
    return dist.get_rank()


def all_reduce_on(name: str):
    """Ranks 0 and 1 all-reduce on the kept group `name` (of ranks 0 and 1): 1 + 2 everywhere."""
    import torch
    import torch.distributed as dist

    from nbdist.runtime.ranks import registry

    pair = registry.get("group", name).handle
    if dist.get_rank() not in (0, 1):
        return None
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=pair)
    return t


def keep(value=None) -> tuple:
    """Keep `value` in this rank's registry (when given); return (pid, what is kept)."""
    import os

    from nbdist.runtime.ranks import registry

    if value is not None:
        registry.put("test", "kept", value)
    return os.getpid(), registry.get("test", "kept")


def renew():
    from nbdist.backend.ranks import mpi_backend

    return mpi_backend.renew()


def alone_in_a_short_group():
    """Rank 0 all-reduces on a group of ranks 0 and 1 whose timeout is 2 s; rank 1 never joins."""
    import datetime

    import torch
    import torch.distributed as dist

    from nbdist.backend.ranks import mpi_backend
    from nbdist.cluster.meshes.ranks import groups
    from nbdist.runtime.ranks import registry

    mpi_backend.register()
    short = registry.get_or_make("group", "test-mpi4py:short", lambda: groups.Held("test short", (0, 1), dist.new_group(
        [0, 1], backend="mpi4py", timeout=datetime.timedelta(seconds=2)))).handle
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(2), group=short)
    return dist.get_rank()


# -- the claims ----------------------------------------------------------------------------------------------------


def assert_same(gloo, mine, tolerance: float, where: str) -> None:
    if isinstance(gloo, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and mine.dtype == gloo.dtype and mine.shape == gloo.shape, where
        torch.testing.assert_close(mine, gloo, rtol=tolerance, atol=tolerance, equal_nan=True, msg=where)
    elif isinstance(gloo, (list, tuple)):
        assert isinstance(mine, (list, tuple)) and len(mine) == len(gloo), where
        for i, (g, m) in enumerate(zip(gloo, mine)):
            assert_same(g, m, tolerance, f"{where}[{i}]")
    else:
        assert mine == gloo, where


@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_operation_equals_gloo(cluster4, k):
    results = cluster4.run(every_op, k, timeout=300)
    assert all(results[r] is None for r in range(k, 4))
    for rank in range(k):
        assert len(results[rank]) > 70
        for case, (gloo, mine, tolerance) in results[rank].items():
            assert_same(gloo, mine, tolerance, f"{case} on rank {rank} of {k}")


def test_ddp_over_mpi4py_trains_as_over_gloo(cluster4):
    for rank, params in enumerate(cluster4.run(ddp_steps, timeout=120)):
        assert_same(params["gloo"], params["mpi4py"], 1e-6, f"DDP parameters on rank {rank}")


def test_sub_groups_map_to_sub_communicators(cluster4):
    results = cluster4.run(in_groups, "sub", timeout=120)
    for rank, mine in enumerate(results):
        keys = {ranks for ranks, _ in mine}
        assert keys == {ranks for ranks in ((0, 2), (1, 3), (1, 2, 3)) if rank in ranks}, rank
        for ranks in keys:
            gloo, ours = mine[(ranks, "gloo")], mine[(ranks, "mpi4py")]
            assert_same(gloo, ours, 0, f"sub-group {list(ranks)} on rank {rank}")
            assert ours[4] == ranks.index(rank) and ours[5] == len(ranks)
            assert ours[0].tolist() == [i * sum(q + 1 for q in ranks) for i in range(4)]  # and not gloo's luck


def test_a_rank_raising_frees_the_rank_waiting_in_an_all_reduce(cluster4):
    before = cluster4.run(keep, "still here")
    with pytest.raises(nbdist.DistError, match=r"rank 1 raised ValueError: broken before.*interrupted rank\(s\) 0"
                                               r".*MPI group\(s\) renewed, engine variables kept"):
        cluster4.run(waits_in_all_reduce, 1, timeout=60)
    assert cluster4.run(keep) == before  # the same processes, their registry kept: no restart
    results = cluster4.run(all_reduce_on, "test-mpi4py:pair", timeout=60)  # renewed: not paired with the abandoned one
    assert results[0].tolist() == results[1].tolist() == [3.0, 3.0, 3.0]


def test_a_wait_past_the_groups_timeout_raises_naming_the_operation(cluster4):
    with pytest.raises(nbdist.DistError, match=r"rank 0 raised \w+: mpi4py all_reduce #\d+ on the group of ranks "
                                               r"\[0, 1\] timed out after 2 s on rank 0: rank 1 did not answer"):
        cluster4.run(alone_in_a_short_group, timeout=60)
    assert cluster4.run(all_reduce_on, "test-mpi4py:short", timeout=60)[0].tolist() == [3.0, 3.0, 3.0]

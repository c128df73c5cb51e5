"""DDP communication hooks (nbdist/data_parallel/ranks/hooks.py) on a real 2-engine cluster: MPI all-reduce equals torch's (gloo)
and the serial model; the compression hooks send fewer bytes and still train; top-k's error feedback loses nothing; bad
input is refused. On a real 4-engine cluster: the MPI hooks on process groups that are not the whole world (a
mesh's dp dimension, and groups of no mesh), each group averaging only within itself."""
import math

import pytest
import torch
from torch import nn

import nbdist
from nbdist.data_parallel.ranks import hooks
from nbdist.errors import DistError, DistUsageError

ATOL = 1e-6
LR = 0.1
IN, HIDDEN, OUT, BATCH = 16, 64, 4, 32  # BATCH: the global batch, split evenly over the ranks


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def full_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 2) + 0.1 * x[:, OUT : 2 * OUT]  # learnable: loss can fall a long way


# -- engine-side (imported there from this module; keep imports inside) ----------------------------------------------


def _train(hook: str | None, steps: int, **options) -> dict:
    """`steps` SGD steps of DDP on this rank's shard; hook None = no hook registered (DDP's built-in all-reduce)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.data_parallel.ranks.hooks import register_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(build_model())
    state = register_hook(model, hook, **options) if hook else None
    x, y = (t.chunk(world)[rank] for t in full_batch())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {
        "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "losses": losses,
        "bytes": state.bytes_per_step if state else None,
        "full": state.full_bytes_per_step if state else None,
    }


def _topk_bookkeeping(ratio: float, steps: int) -> dict:
    """Top-k steps with a spy on what goes in (each bucket's local gradient) and what goes out (the exchange):
    per parameter, sum of gradients over the steps, sum of what was sent, and the residual left at the end."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.data_parallel.ranks import hooks

    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(build_model(), bucket_cap_mb=0.01)  # several buckets, regrouped after step 1
    state = hooks.TopKState(ratio=ratio)
    names = {id(p): n for n, p in model.module.named_parameters()}
    grads = {n: torch.zeros(p.numel()) for n, p in model.module.named_parameters()}
    sent = {n: torch.zeros(p.numel()) for n, p in model.module.named_parameters()}
    current: dict = {}
    layouts = []
    exchange = state.exchange

    def spy_exchange(indices, values):
        dense = torch.zeros(current["buffer"].numel()).index_put_((indices.long(),), values)
        for p, piece in zip(current["params"], dense.split([p.numel() for p in current["params"]])):
            sent[names[id(p)]] += piece
        return exchange(indices, values)

    def spy_hook(state, bucket):
        current.update(buffer=bucket.buffer(), params=bucket.parameters())
        layouts.append((bucket.index(), [names[id(p)] for p in bucket.parameters()]))
        for p, g in zip(bucket.parameters(), bucket.buffer().split([p.numel() for p in bucket.parameters()])):
            grads[names[id(p)]] += g
        return hooks.topk_hook(state, bucket)

    state.exchange = spy_exchange
    model.register_comm_hook(state, spy_hook)
    x, y = (t.chunk(world)[rank] for t in full_batch())
    for _ in range(steps):
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
    residual = {names[key]: r for key, r in state.residual_by_parameter().items()}
    return {"grads": grads, "sent": sent, "residual": residual, "layouts": layouts, "bytes": state.bytes_per_step}


def _accumulate(no_sync: bool, steps: int, k: int = 2) -> dict:
    """`steps` SGD steps of DDP (MPI hook, several buckets), each rank's shard in k micro-batches whose losses are
    divided by k; with no_sync the first k-1 backward passes only accumulate."""
    import contextlib

    import torch
    import torch.distributed as dist

    from nbdist.data_parallel.ranks.ddp import ddp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ddp(build_model(), hook="mpi", bucket_cap_mb=0.01)
    x, y = (t.chunk(world)[rank] for t in full_batch())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
            quiet = model.no_sync() if no_sync and i < k - 1 else contextlib.nullcontext()
            with quiet:
                (nn.functional.mse_loss(model(xm), ym) / k).backward()
        optimizer.step()
    state = model.comm_hook_state
    return {"params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "buckets": state.buckets_per_step, "bytes": state.bytes_per_step, "full": state.full_bytes_per_step}


def _bad_input() -> list[str]:
    """The errors register_hook and ddp raise on this rank, as 'Type: message'."""
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.data_parallel.ranks.ddp import ddp
    from nbdist.data_parallel.ranks.hooks import register_hook

    model = DistributedDataParallel(build_model())
    attempts = [
        lambda: register_hook(model, "nope"),
        lambda: register_hook(model, "topk", ratio=0),
        lambda: register_hook(model, "topk", ratio=1.5),
        lambda: register_hook(model, "topk", ratio=-0.1),
        lambda: register_hook(model, "topk", ratio="0.1"),
        lambda: register_hook(model, "mpi", ratio=0.1),
        lambda: register_hook(model, "powersgd", rank=0),
        lambda: register_hook(build_model(), "mpi"),
        lambda: ddp(build_model(), hook="topk", ratio=2.0),
    ]
    out = []
    for attempt in attempts:
        try:
            attempt()
            out.append("no error")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _auto_and_ddp(backend: str | None = None) -> dict:
    """ddp() with hook "auto" on the world's process group, or on a new group of every rank on `backend`."""
    import torch.distributed as dist

    from nbdist.data_parallel.ranks.ddp import ddp
    from nbdist.data_parallel.ranks.hooks import choose

    group = None if backend is None else dist.new_group(backend=backend)  # collective: every rank
    model = ddp(build_model(), bucket_cap_mb=1, process_group=group)
    return {
        "auto": choose(model),
        "state": model.comm_hook_state.name,
        "cap": model.bucket_bytes_cap,
        "view": model.gradient_as_bucket_view,
    }


# -- in this process ---------------------------------------------------------------------------------------------------


def serial(steps: int, batch: tuple | None = None) -> dict:
    model = build_model()
    x, y = batch or full_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def assert_params_close(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=ATOL, rtol=0)


def test_mpi_hook_equals_torch_and_serial(cluster):
    steps = 3  # crosses DDP's bucket regrouping after the first step
    mpi = cluster.run(_train, "mpi", steps)
    default = cluster.run(_train, None, steps)
    via_torch = cluster.run(_train, "torch", steps)
    expected = serial(steps)
    for rank in range(cluster.world_size):
        assert_params_close(mpi[rank]["params"], default[rank]["params"])
        assert_params_close(mpi[rank]["params"], expected)
        assert_params_close(via_torch[rank]["params"], default[rank]["params"])
    full = 4 * sum(p.numel() for p in build_model().parameters())
    assert mpi[0]["bytes"] == mpi[0]["full"] == [full] * steps


def powersgd_bytes(rank: int) -> int:
    """What torch's PowerSGD sends per step for build_model(): P and Q of each matrix worth compressing
    ((n + m) r elements against n m, at min_compression_rate 2), every other tensor whole; float32."""
    total = 0
    for p in build_model().parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if p.dim() > 1 and (n + m) * r * 2 < n * m else p.numel()
    return 4 * total


@pytest.mark.parametrize(
    "hook, options",
    [("fp16", {}), ("bf16", {}), ("topk", {"ratio": 0.1}), ("powersgd", {"rank": 2})],
)
def test_compression_sends_less_and_still_trains(cluster, hook, options):
    steps = 25
    results = cluster.run(_train, hook, steps, **options)
    full = 4 * sum(p.numel() for p in build_model().parameters())
    for r in results:
        assert r["full"] == [full] * steps
        assert r["losses"][-1] < 0.7 * r["losses"][0], r["losses"]
    sent = results[0]["bytes"]
    if hook in ("fp16", "bf16"):
        assert sent == [full // 2] * steps
    elif hook == "topk":  # values + int32 indices: 2 x ratio of the bytes, rounded up per bucket
        assert all(2 * 0.1 * full <= s <= 2 * 0.1 * full + 8 * 4 for s in sent), sent
    else:  # plain all-reduce for start_iter = 2 steps, then the low-rank factors
        assert sent == [full] * 2 + [powersgd_bytes(options["rank"])] * (steps - 2)
        assert sent[-1] < full


def test_topk_error_feedback_loses_nothing(cluster):
    steps = 3
    results = cluster.run(_topk_bookkeeping, 0.2, steps)
    for r in results:
        first, last = r["layouts"][0], r["layouts"][-1]
        assert len(first[1]) == 6 and len(last[1]) < 6  # DDP regrouped its buckets: residuals were carried over
        for name, grad_sum in r["grads"].items():
            torch.testing.assert_close(r["sent"][name] + r["residual"][name], grad_sum, atol=1e-5, rtol=0)
        held_back = sum(int((t != 0).sum()) for t in r["residual"].values())
        assert 0 < held_back < sum(t.numel() for t in r["residual"].values())  # the identity is not trivial
        assert len(r["bytes"]) == steps


def test_topk_ratio_one_is_a_plain_average(cluster):
    topk = cluster.run(_train, "topk", 2, ratio=1.0)
    default = cluster.run(_train, None, 2)
    assert_params_close(topk[0]["params"], default[0]["params"])


def test_bad_input_is_refused(cluster):
    errors = cluster.run(_bad_input)[0]
    expected = [
        "unknown hook 'nope'",
        "ratio must be in (0, 1], got 0",
        "ratio must be in (0, 1], got 1.5",
        "ratio must be in (0, 1], got -0.1",
        "ratio must be in (0, 1], got '0.1'",
        "hook 'mpi' takes no options; got 'ratio'",
        "PowerSGD rank must be at least 1, got 0",
        "needs a DistributedDataParallel model, got Sequential",
        "ratio must be in (0, 1], got 2.0",
    ]
    assert len(errors) == len(expected)
    for got, want in zip(errors, expected):
        assert got.startswith("DistUsageError: ") and want in got, got


def test_ddp_auto_keeps_ddps_all_reduce_on_the_mpi_backend_and_picks_the_mpi_hook_over_gloo(cluster):
    """On CPU engines' default backend (mpi4py) DDP's own all-reduce already goes through MPI: "auto" keeps it
    ("torch"). On a gloo group "auto" all-reduces through MPI with nbdist's hook."""
    for r in cluster.run(_auto_and_ddp):
        assert r == {"auto": "torch", "state": "torch", "cap": 2**20, "view": True}
    for r in cluster.run(_auto_and_ddp, "gloo"):
        assert r == {"auto": "mpi", "state": "mpi", "cap": 2**20, "view": True}


class _FakeBucket:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self.tensor


@pytest.mark.parametrize("hook", [hooks.mpi_allreduce_hook, hooks.topk_hook])
def test_mpi_hooks_refuse_non_cpu_tensors(hook):
    with pytest.raises(DistUsageError, match="CPU tensors only.*meta"):
        hook(hooks.TopKState(), _FakeBucket(torch.zeros(4, device="meta")))


def test_topk_compress_keeps_what_it_does_not_send():
    g = torch.tensor([0.5, -3.0, 0.1, 2.0, -0.2])
    indices, values, residual = hooks.topk_compress(g, 2)
    assert sorted(indices.tolist()) == [1, 3] and indices.dtype == torch.int32
    dense = torch.zeros(5).index_put_((indices.long(),), values)
    assert torch.equal(dense + residual, g)
    assert math.isclose(residual.abs().max().item(), 0.5)


def test_errors_on_the_engines_name_the_rank(cluster):
    with pytest.raises(DistError, match="ranks 0, 1 raised DistUsageError.*unknown hook"):  # the same on both
        cluster.run(_train, "nope", 1)


def _powersgd_two_buckets(through_ddp: bool):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.data_parallel.ranks.ddp import ddp
    from nbdist.data_parallel.ranks.hooks import register_hook

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))
    if through_ddp:  # ddp() makes the gradients one bucket
        model = ddp(net, hook="powersgd", rank=2)
    else:  # DDP's defaults: a small first bucket, then 25 MB ones
        model = DistributedDataParallel(net)
        register_hook(model, "powersgd", rank=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


def test_accumulation_with_no_sync_equals_serial_with_fewer_all_reduces(cluster):
    """Gradient accumulation over 2 micro-batches trains like the whole batch at once, with or without no_sync;
    no_sync hands the hook each step's buckets once instead of once per micro-batch (HookState counts them)."""
    steps, expected = 3, serial(3)
    for no_sync in (True, False):
        for result in cluster.run(_accumulate, no_sync, steps):
            assert_params_close(result["params"], expected)
            assert len(result["buckets"]) == steps * (1 if no_sync else 2)  # backward passes that communicated
            assert result["buckets"][-1] > 1  # bucket_cap_mb=0.01: several buckets, once DDP rebuilt them (step 1)
            assert result["bytes"] == result["full"]  # the MPI hook sends every bucket whole


def test_powersgd_on_several_buckets_is_avoided_or_refused(cluster):
    """torch's PowerSGD hook fails on gloo and on mpi4py (the CPU default) with two buckets (hangs or aborts): ddp()
    avoids it, register_hook refuses it. With one bucket it trains: PowerSGD waits on its second all-reduce inside
    the first one's callback, which the mpi4py backend must not run on the thread that completes them."""
    assert all(loss > 0 for loss in cluster.run(_powersgd_two_buckets, True, timeout=60))
    refused = r"PowerSGD on mpi4py fails \(hangs or aborts\) with more than one gradient bucket"
    with pytest.raises(DistError, match=refused):
        cluster.run(_powersgd_two_buckets, False, timeout=60)


# -- on process groups that are not the whole world (4 engines) -----------------------------------------------------

SUBGROUP_ATOL = 1e-5


def replica_batch(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each replica group trains on its own global batch (another seed per replica), so groups that mixed their
    gradients would end up with neither group's serial result."""
    g = torch.Generator().manual_seed(100 + replica)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 2) + 0.1 * x[:, OUT : 2 * OUT]


def _train_replica(where, hook: str, steps: int, **options) -> dict:
    """On every rank: DDP over this rank's replica group, `steps` SGD steps on its replica's batch (this rank's
    shard of it). where: a Mesh (the group is its dp dimension, the replica its pp coordinate) or a list of rank
    lists (every rank makes every group, as dist.new_group needs; the replica is the index of this rank's)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.cluster.meshes.ranks import groups, rank_mesh
    from nbdist.data_parallel.ranks.hooks import register_hook

    if isinstance(where, list):
        made = [groups.torch_group(ranks) for ranks in where]
        replica = next(i for i, ranks in enumerate(where) if dist.get_rank() in ranks)
        group, mesh_comm = made[replica], None
    else:
        me = rank_mesh.here(where)
        group, replica, mesh_comm = me.group("dp"), me.coord("pp"), me.comm("dp")
    model = DistributedDataParallel(build_model(), process_group=group)
    state = register_hook(model, hook, **options)
    x, y = (t.chunk(dist.get_world_size(group))[dist.get_rank(group)] for t in replica_batch(replica))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    comm = getattr(state, "comm", None)
    return {
        "replica": replica,
        "hook": state.name,
        "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "comm_size": None if comm is None else comm.size,
        "mesh_comm": comm is not None and comm is mesh_comm,
    }


def assert_replicas_equal_their_serial_runs(results: list[dict], steps: int) -> None:
    expected = {replica: serial(steps, replica_batch(replica)) for replica in {r["replica"] for r in results}}
    for r in results:
        for key in expected[r["replica"]]:
            torch.testing.assert_close(r["params"][key], expected[r["replica"]][key], atol=SUBGROUP_ATOL, rtol=0)
    assert len(expected) == 2
    drift = max((expected[0][k] - expected[1][k]).abs().max().item() for k in expected[0])
    assert drift > 1e-3  # the replicas' serial results differ: equal to its own means no mixing with the other


def test_mpi_hook_on_a_mesh_dp_group_equals_torch_and_each_replica_serial(cluster4):
    """dp=2 x pp=2 on 4 ranks: two dp groups of two ranks ([0, 1] and [2, 3]), never the whole world. The MPI hook
    talks on the mesh's dp communicator; each group equals torch's (over the mpi4py backend) and its own serial
    run."""
    m = nbdist.mesh(cluster4, dp=2, pp=2)
    assert m.groups("dp") == [[0, 1], [2, 3]]
    steps = 3  # crosses DDP's bucket regrouping after the first step
    mpi = cluster4.run(_train_replica, m, "mpi", steps)
    via_torch = cluster4.run(_train_replica, m, "torch", steps)
    assert [r["replica"] for r in mpi] == [0, 0, 1, 1]
    assert all(r["hook"] == "mpi" and r["comm_size"] == 2 and r["mesh_comm"] for r in mpi)
    assert all(r["hook"] == "torch" and r["comm_size"] is None for r in via_torch)
    for a, b in zip(mpi, via_torch):
        assert_params_close(a["params"], b["params"])
    assert_replicas_equal_their_serial_runs(mpi, steps)


def test_topk_on_a_sub_group_averages_within_it(cluster4):
    """Top-k's all-gather runs on the group's communicator: with ratio 1 (everything sent) it is the group's plain
    average, so each replica equals its own serial run."""
    m = nbdist.mesh(cluster4, dp=2, pp=2)
    results = cluster4.run(_train_replica, m, "topk", 2, ratio=1.0)
    assert all(r["hook"] == "topk" and r["comm_size"] == 2 for r in results)
    assert_replicas_equal_their_serial_runs(results, 2)


def test_mpi_hook_on_groups_of_no_mesh_makes_their_communicator_once(cluster4):
    """Groups [0, 3] and [1, 2] belong to no mesh: each gets an MPI communicator of its ranks, made by its members
    only and kept in the engine registry (listed by Cluster.holdings), reused on the next call."""
    where = [[0, 3], [1, 2]]
    first = cluster4.run(_train_replica, where, "mpi", 3)
    again = cluster4.run(_train_replica, where, "mpi", 3)
    assert [r["replica"] for r in first] == [0, 1, 1, 0]
    assert all(r["comm_size"] == 2 and not r["mesh_comm"] for r in first)
    assert_replicas_equal_their_serial_runs(first, 3)
    for a, b in zip(first, again):
        assert_params_close(a["params"], b["params"])
    held = [row for row in cluster4.holdings() if row["kind"] == "mpi-comm"]
    assert sorted((row["rank"], row["name"]) for row in held) == [
        (0, "ranks:0,3"), (1, "ranks:1,2"), (2, "ranks:1,2"), (3, "ranks:0,3")]  # once each, members only
    assert {row["what"] for row in held} == {"MPI communicator of ranks [0, 3]", "MPI communicator of ranks [1, 2]"}

"""SyncBatchNorm (nbdist/data_parallel/ranks/sync_batchnorm.py) on a real 2-engine cluster, each rank holding half
of a fixed batch, against one process on the whole batch computed here: forward outputs and running stats
(BatchNorm1d/2d/3d, momentum or a cumulative average, no running stats), input and weight gradients, and a small CNN
under torch DDP trained 3 SGD steps equal to one process (plain BatchNorm under DDP is not: the test can fail).
Also: a process group of one rank is a plain BatchNorm, a gloo group works, eval mode with running stats
communicates nothing (rank 0 alone runs it), and convert() keeps every parameter, buffer and other module.

The gradient convention tested (the module's docstring derives it): each rank's backward gives its part of the
gradient of the SUM of the ranks' losses. So with loss_r = Σ(y_r·w_r)/B, the ranks' input gradients put together,
and their weight gradients summed, are the one process's for Σ(y·w)/B; with loss_r = the mean over its own half
and DDP averaging, the steps are the one process's with the mean over the whole batch."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nbdist.data_parallel.ranks.sync_batchnorm import SyncBatchNorm, convert

ATOL = 1e-5
BATCH = 8  # the global batch, split evenly over the 2 ranks
LR = 0.1
KINDS = {"1d": nn.BatchNorm1d, "2d": nn.BatchNorm2d, "3d": nn.BatchNorm3d}


def make_bn(kind: str, channels: int, dtype: torch.dtype = torch.float32, **options) -> nn.Module:
    """A plain BatchNorm with non-trivial weight, bias and running stats (seeded: the same here and on the ranks)."""
    torch.manual_seed(0)
    bn = KINDS[kind](channels, dtype=dtype, **options)
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 1.5)
        if bn.bias is not None:
            bn.bias.uniform_(-1, 1)
        if bn.running_mean is not None:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return bn


def batch(shape: tuple, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of magnitude ~1..10: each channel its own offset and scale, so a wrong mean or variance shows."""
    g = torch.Generator().manual_seed(seed)
    channel = (1, shape[1]) + (1,) * (len(shape) - 2)
    offset = torch.rand(channel, generator=g, dtype=torch.float64) * 8 - 2
    scale = torch.rand(channel, generator=g, dtype=torch.float64) * 3 + 0.5
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)


def loss_weights(shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=dtype)


def build_cnn() -> nn.Sequential:
    """conv -> BN2d -> relu -> linear -> BN1d -> relu -> linear: two BatchNorms in a chain, parameters before each."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def cnn_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = batch((BATCH, 3, 6, 6), seed=3)
    return x, torch.randn(BATCH, 2, generator=torch.Generator().manual_seed(4))


def close(got: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


# -- engine-side (imported there from this module; keep imports inside, store nothing) ----------------------------------


def _forward(kind: str, shape: tuple, options: dict, steps: int, train: bool) -> dict:
    """`steps` forwards of a converted BatchNorm on this rank's half of batches 1..steps; outputs and state."""
    import torch.distributed as dist

    from nbdist.data_parallel.ranks.sync_batchnorm import convert

    rank, world = dist.get_rank(), dist.get_world_size()
    bn = convert(make_bn(kind, shape[1], **options)).train(train)
    outputs = [bn(batch(shape, seed).chunk(world)[rank]).detach() for seed in range(1, steps + 1)]
    return {"outputs": outputs, "state": {k: v.clone() for k, v in bn.state_dict().items()},
            "type": type(bn).__name__}


def _gradients(kind: str, shape: tuple, dtype: torch.dtype) -> dict:
    """loss = Σ(y·w)/B over this rank's half; the gradients of its input, weight and bias."""
    import torch.distributed as dist

    from nbdist.data_parallel.ranks.sync_batchnorm import convert

    rank, world = dist.get_rank(), dist.get_world_size()
    bn = convert(make_bn(kind, shape[1], dtype))
    x = batch(shape, dtype=dtype).chunk(world)[rank].clone().requires_grad_()
    loss = (bn(x) * loss_weights(shape, dtype).chunk(world)[rank]).sum() / shape[0]
    loss.backward()
    return {"x": x.grad, "weight": bn.weight.grad, "bias": bn.bias.grad}


def _ddp_steps(sync: bool, steps: int) -> dict:
    """`steps` SGD steps of the CNN (converted or not) under torch DDP on the default group, on this rank's half;
    loss = the mean over the half, DDP averages."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.data_parallel.ranks.sync_batchnorm import convert

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_cnn()
    model = DistributedDataParallel(convert(model) if sync else model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = (t.chunk(world)[rank] for t in cnn_batch())
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _groups(backend: str | None) -> dict:
    """A BatchNorm over a group of one rank (each its own), and over a new group of both ranks on `backend`."""
    import torch.distributed as dist

    from nbdist.data_parallel.ranks.sync_batchnorm import convert

    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes every group
    both = dist.new_group(list(range(world)), backend=backend)
    shape = (BATCH, 3, 4, 4)
    x = batch(shape).chunk(world)[rank]
    return {"alone": convert(make_bn("2d", 3), alone)(x).detach(), "both": convert(make_bn("2d", 3), both)(x).detach()}


def _eval_alone() -> torch.Tensor:
    """Eval mode on this rank alone: running stats only, nothing to wait for."""
    from nbdist.data_parallel.ranks.sync_batchnorm import convert

    bn = convert(make_bn("2d", 3)).eval()
    with torch.no_grad():
        return bn(batch((BATCH, 3, 4, 4)))


# -- forward and running stats -------------------------------------------------------------------------------------------


FORWARD_CASES = {
    "2d": ("2d", (BATCH, 3, 5, 5), {}, 2, True),
    "2d-cumulative-average": ("2d", (BATCH, 3, 5, 5), {"momentum": None}, 3, True),
    "2d-no-running-stats-eval": ("2d", (BATCH, 3, 5, 5), {"track_running_stats": False}, 2, False),
    "1d-NC": ("1d", (BATCH, 4), {}, 2, True),
    "1d-NCL": ("1d", (BATCH, 4, 6), {"momentum": 0.3}, 2, True),
    "3d": ("3d", (BATCH, 2, 3, 3, 3), {"affine": False}, 2, True),
}


@pytest.mark.parametrize("case", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_forward_and_running_stats_equal_one_process(cluster, case):
    kind, shape, options, steps, train = case
    ranks = cluster.run(_forward, *case)
    one = make_bn(kind, shape[1], **options).train(train)
    for step, seed in enumerate(range(1, steps + 1)):
        expected = one(batch(shape, seed)).detach()
        close(torch.cat([r["outputs"][step] for r in ranks]), expected)
        per_replica = make_bn(kind, shape[1], **options).train(train)(batch(shape, seed).chunk(2)[0]).detach()
        assert (per_replica - expected.chunk(2)[0]).abs().max() > 1e-2  # the halves' own stats differ: not trivial
    for r in ranks:
        assert r["type"] == "SyncBatchNorm"
        assert set(r["state"]) == set(one.state_dict())
        for key, value in one.state_dict().items():
            close(r["state"][key], value)
    if one.track_running_stats:
        assert int(ranks[0]["state"]["num_batches_tracked"]) == steps


# -- gradients -------------------------------------------------------------------------------------------------------------


GRADIENT_CASES = {
    "2d": ("2d", (BATCH, 3, 5, 5), torch.float32, ATOL),
    "1d-NC": ("1d", (BATCH, 4), torch.float32, ATOL),
    "1d-NCL": ("1d", (BATCH, 4, 6), torch.float32, ATOL),
    "2d-float64": ("2d", (BATCH, 3, 5, 5), torch.float64, 1e-12),
}


@pytest.mark.parametrize("case", GRADIENT_CASES.values(), ids=GRADIENT_CASES.keys())
def test_gradients_equal_one_process(cluster, case):
    """Input gradients put together, and weight/bias gradients summed over the ranks, are one process's."""
    kind, shape, dtype, atol = case
    ranks = cluster.run(_gradients, kind, shape, dtype)
    one = make_bn(kind, shape[1], dtype)
    x = batch(shape, dtype=dtype).requires_grad_()
    ((one(x) * loss_weights(shape, dtype)).sum() / shape[0]).backward()
    close(torch.cat([r["x"] for r in ranks]), x.grad, atol)
    close(ranks[0]["weight"] + ranks[1]["weight"], one.weight.grad, atol)
    close(ranks[0]["bias"] + ranks[1]["bias"], one.bias.grad, atol)
    assert (ranks[0]["weight"] - one.weight.grad).abs().max() > 1e-3  # each rank's own part is not the whole


def test_a_cnn_under_ddp_trains_as_one_process(cluster):
    """The claim that matters: 3 SGD steps of a converted CNN under DDP (each rank the mean over its half, DDP
    averaging) leave every weight and running stat where one process's 3 steps on the whole batch leave them."""
    steps = 3
    one = build_cnn()
    optimizer = torch.optim.SGD(one.parameters(), lr=LR)
    x, y = cnn_batch()
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(one(x), y).backward()
        optimizer.step()
    expected = one.state_dict()
    synced, plain = cluster.run(_ddp_steps, True, steps), cluster.run(_ddp_steps, False, steps)
    for state in synced:
        assert set(state) == set(expected)
        for key, value in expected.items():
            close(state[key], value)
    assert max((plain[0][k].double() - v.double()).abs().max().item() for k, v in expected.items()) > 1e-3


# -- groups, eval, convert -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [None, "gloo"], ids=["default-backend", "gloo"])
def test_the_process_group_is_the_one_given(cluster, backend):
    """Each rank alone in its group normalises its half by itself; a group of both (on gloo too) as one process."""
    shape = (BATCH, 3, 4, 4)
    ranks = cluster.run(_groups, backend)
    x = batch(shape)
    for rank, result in enumerate(ranks):
        close(result["alone"], make_bn("2d", 3)(x.chunk(2)[rank]).detach())
    close(torch.cat([r["both"] for r in ranks]), make_bn("2d", 3)(x).detach())


def test_eval_uses_running_stats_and_no_communication(cluster):
    """Rank 0 alone runs it (rank 1 never joins): it would wait forever for a collective."""
    [out] = cluster.run(_eval_alone, ranks=[0], timeout=30)
    expected = make_bn("2d", 3).eval()(batch((BATCH, 3, 4, 4))).detach()
    close(out, expected)
    assert (out - make_bn("2d", 3)(batch((BATCH, 3, 4, 4))).detach()).abs().max() > 1e-2  # not batch stats


def test_convert_keeps_every_parameter_buffer_and_other_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), make_bn("2d", 4),
                          nn.Sequential(nn.Flatten(), nn.Linear(4, 5), make_bn("1d", 5, momentum=None, eps=1e-3)),
                          make_bn("3d", 2, affine=False), make_bn("1d", 5, track_running_stats=False),
                          make_bn("1d", 5, bias=False), nn.SyncBatchNorm(6))
    model[1].weight.requires_grad_(False)
    model[1].num_batches_tracked.fill_(5)
    model[2][2].eval()
    before = dict(model.state_dict(keep_vars=True))
    modules = dict(model.named_modules())
    converted = convert(model, process_group=None)
    assert converted is model  # converted in place, as torch's convert_sync_batchnorm does
    after = converted.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key] is value  # the same tensors: values, device, requires_grad, an optimizer's references
    for name, module in converted.named_modules():
        old = modules[name]
        if isinstance(old, nn.modules.batchnorm._BatchNorm):
            assert type(module) is SyncBatchNorm and module.process_group is None
            for attribute in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
                assert getattr(module, attribute) == getattr(old, attribute)
            assert module.weight is old.weight and module.bias is old.bias
        else:
            assert type(module) is type(old)
    assert converted[1].weight.requires_grad is False and converted[2][2].training is False
    assert converted[5].bias is None and converted[5].weight is not None
    alone = nn.BatchNorm2d(3)
    assert type(convert(alone)) is SyncBatchNorm and convert(alone).weight is alone.weight
    already = SyncBatchNorm(3)
    assert convert(already) is already
    fresh = SyncBatchNorm(4)
    fresh.load_state_dict(make_bn("2d", 4).state_dict())  # and state_dicts load across, both ways
    make_bn("2d", 4).load_state_dict(fresh.state_dict())
    with pytest.raises(ValueError, match="lazy"):
        convert(nn.LazyBatchNorm2d())

"""fp16 loss scaling agreed by every rank (nbdist/training/ranks/loss_scaling.py), on a real cluster: when one
rank's gradients overflow and the other's do not, both skip the step and both halve their scale, as one process
holding every gradient would; when none overflows, both step."""
from __future__ import annotations


def _one_step(overflow_on: int | None) -> dict:
    """On each rank: a parameter and its scaled gradient (infinite on rank `overflow_on`), one scaler step."""
    import torch
    import torch.distributed as dist

    from nbdist.training.ranks.loss_scaling import AgreeingGradScaler

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scaler = AgreeingGradScaler("cpu", init_scale=8.0)
    scaler.scale(weight.sum()).backward()  # a gradient of 8 each: 1.0 once unscaled
    if dist.get_rank() == overflow_on:
        weight.grad[2] = float("inf")
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return {"weight": weight.detach().tolist(), "scale": scaler.get_scale()}


def test_one_rank_overflowing_makes_every_rank_skip(cluster):
    for rank, seen in enumerate(cluster.run(_one_step, 1)):
        assert seen == {"weight": [1.0] * 4, "scale": 4.0}, (rank, seen)  # not stepped, scale halved


def test_no_rank_overflowing_lets_every_rank_step(cluster):
    for rank, seen in enumerate(cluster.run(_one_step, None)):
        assert seen == {"weight": [0.5] * 4, "scale": 8.0}, (rank, seen)  # 1 - 0.5 x 1.0; scale kept

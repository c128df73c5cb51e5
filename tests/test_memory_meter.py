"""What a rank holds, measured (nbdist/runtime/ranks/memory.py): parameters, gradients and optimizer state by storage, and
the activations autograd saves for backward. In one process against hand counts; on a real 2-rank cluster,
ZeroRedundancyOptimizer and FSDP2 against what the plan predicts for them (nbdist/sharding/memory.py)."""
from __future__ import annotations

import gc

import pytest
import torch
from test_sharding_predictions import gpt, tokens
from torch import nn

from nbdist.runtime.ranks.memory import ActivationMeter, state_bytes
from nbdist.sharding.memory import predict_memory, zero1_shares
from nbdist.sharding.profile import profile_layers

F32 = 4


def build_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def build_odd_mlp() -> nn.Sequential:
    """Rows that 2 ranks cannot share evenly: FSDP2 pads the shards."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def psi(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int = 4) -> None:
    x = torch.randn(batch, model[0].in_features)
    model(x).pow(2).mean().backward()
    optimizer.step()


# -- one process ------------------------------------------------------------------------------------------------------


def test_adam_after_one_step_holds_params_grads_and_two_states_exactly():
    model = build_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    one_step(model, optimizer)
    assert state_bytes(model, optimizer) == {"params": F32 * psi(model), "grads": F32 * psi(model),
                                             "optimizer": 2 * F32 * psi(model)}


@pytest.mark.parametrize("momentum,states", [(0.0, 0), (0.9, 1)])
def test_sgd_holds_no_state_and_momentum_one(momentum, states):
    model = build_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    one_step(model, optimizer)
    assert state_bytes(model, optimizer)["optimizer"] == states * F32 * psi(model)


def test_before_backward_there_are_no_gradients_and_views_count_once():
    model = build_mlp()
    model[0].weight.grad = torch.zeros(16, 8)
    model[2].weight.grad = model[0].weight.grad.T  # a view of the same storage
    assert state_bytes(model) == {"params": F32 * psi(model), "grads": F32 * 16 * 8, "optimizer": 0}


def test_activation_meter_counts_a_linear_stack_by_hand():
    """Linear(8,16) ReLU Linear(16,8) ReLU Linear(8,4), batch B: the first Linear saves its input (B x 8), each ReLU
    its output (B x 16, B x 8), which the next Linear saves again (the same storage, counted once); the weights
    the Linear layers save are parameters, not counted."""
    model, batch = build_mlp(), 5
    with ActivationMeter() as meter:
        out = model(torch.randn(batch, 8))
        assert meter.live_bytes == F32 * batch * (8 + 16 + 8)
        out.sum().backward()
    assert meter.peak_bytes == F32 * batch * (8 + 16 + 8)
    assert meter.live_bytes == 0  # backward released every saved tensor


@pytest.mark.slow
def test_activation_meter_releases_a_graph_dropped_without_backward():
    model = build_mlp()
    with ActivationMeter() as meter:
        out = model(torch.randn(3, 8))
    assert meter.live_bytes == F32 * 3 * (8 + 16 + 8)
    del out
    gc.collect()
    assert meter.live_bytes == 0 and meter.peak_bytes == F32 * 3 * (8 + 16 + 8)


def test_activation_meter_peak_is_one_micro_batch_under_gradient_accumulation():
    model = build_mlp()
    with ActivationMeter() as meter:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    assert meter.peak_bytes == F32 * 4 * (8 + 16 + 8)


# -- on two ranks --------------------------------------------------------------------------------------------------


def zero1_on_rank(build, x, y) -> dict:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from nbdist.runtime.ranks.memory import state_bytes

    model = build()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    rank, size = dist.get_rank(), dist.get_world_size()
    nn.functional.mse_loss(model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
    optimizer.step()
    return state_bytes(model, optimizer)


def fsdp2_on_rank(build, x, y, reshard: bool) -> dict:
    """FSDP2 per layer and at the root (nbdist's ZeRO-2/3), on an explicitly CPU mesh: parameters held at each layer's start in
    forward (that layer gathered), after forward, and everything after the step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nbdist.data_parallel.ranks import zero
    from nbdist.runtime.ranks.memory import state_bytes

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = zero.shard(build(), mesh, 3 if reshard else 2)  # per layer and the root; 3 reshards after forward
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    during = []
    for layer in model:  # runs after FSDP2's own pre-forward hook, which gathers the layer
        layer.register_forward_pre_hook(lambda module, args: during.append(state_bytes(model)["params"]))
    rank, size = dist.get_rank(), dist.get_world_size()
    loss = nn.functional.mse_loss(model(x.chunk(size)[rank]), y.chunk(size)[rank])
    after_forward = state_bytes(model)["params"]
    loss.backward()
    optimizer.step()
    return {"during_forward": max(during), "after_forward": after_forward, "after_step": state_bytes(model, optimizer)}


def tensor_parallel_on_rank(build, x) -> dict:
    """The model split by DTensor as the plan splits it (tp_plan's column and row layers), one Adam step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from nbdist.runtime.ranks.memory import ActivationMeter, state_bytes
    from nbdist.tensor_parallel.pairs import tp_plan

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    model = parallelize_module(build(), mesh, {name: styles[style]() for name, style in tp_plan(build()).items()})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with ActivationMeter() as meter:
        model(x).pow(2).mean().backward()
    optimizer.step()
    return {**state_bytes(model, optimizer), "activations": meter.peak_bytes}


def data(build):
    generator = torch.Generator().manual_seed(1)
    model = build()
    return torch.randn(8, model[0].in_features, generator=generator), \
        torch.randn(8, model[-1].out_features, generator=generator)


def predicted(build, zero: int):
    layers = profile_layers(build(), data(build)[0])
    [rank] = predict_memory(layers, dp=2, pp=1, tp=1, zero=zero, boundaries=None, microbatches=1,
                            schedule="1f1b", batch=8)
    return rank, layers


def test_zero_redundancy_optimizer_states_per_rank_sum_to_the_unsharded_optimizers(cluster):
    held = cluster.run(zero1_on_rank, build_mlp, *data(build_mlp))
    whole = psi(build_mlp())
    assert sum(h["optimizer"] for h in held) == 2 * F32 * whole  # Adam unsharded: 8 bytes per parameter
    assert all(h["params"] == h["grads"] == F32 * whole for h in held)  # ZeRO-1 keeps parameters and gradients
    prediction, layers = predicted(build_mlp, zero=1)
    shares = zero1_shares([t for layer in layers for t in layer.tensors], 2)
    assert [h["optimizer"] for h in held] == [2 * F32 * s for s in shares]  # torch's greedy partition, rank by rank
    assert prediction.optimizer == max(h["optimizer"] for h in held)


@pytest.mark.parametrize("reshard,zero", [(True, 3), (False, 2)])
def test_fsdp2_holds_shards_after_the_step_and_what_the_plan_predicts_in_forward(cluster, reshard, zero):
    held = cluster.run(fsdp2_on_rank, build_mlp, *data(build_mlp), reshard)
    whole = psi(build_mlp())
    prediction, _ = predicted(build_mlp, zero=zero)
    for h in held:
        assert h["after_step"] == {"params": F32 * whole // 2, "grads": F32 * whole // 2,
                                   "optimizer": 2 * F32 * whole // 2}
        # ZeRO-3 gathers one layer at a time; ZeRO-2 keeps every layer gathered from forward to backward
        peak = h["during_forward"] if zero == 3 else h["after_forward"]
        assert peak == prediction.params
    if zero == 3:
        assert all(h["after_forward"] < h["during_forward"] for h in held)  # resharded after forward


def test_fsdp2_pads_uneven_shards_as_the_plan_predicts(cluster):
    """Linear(6,5) and Linear(5,3) on 2 ranks: dim 0 is cut in ceil(rows / 2) rows, rank 1's last shard padded.
    Parameters and gradients live in padded storage on both ranks; Adam's states are the size of a rank's own
    rows, so rank 1 holds fewer and the prediction (the largest rank's) is rank 0's."""
    held = cluster.run(fsdp2_on_rank, build_odd_mlp, *data(build_odd_mlp), True)
    prediction, _ = predicted(build_odd_mlp, zero=3)
    padded = 3 * 6 + 3 + 2 * 5 + 2  # per rank: 3 of 5 rows of 6, 3 of 5 biases, 2 of 3 rows of 5, 2 of 3 biases
    assert prediction.grads == F32 * padded > F32 * psi(build_odd_mlp()) / 2
    for h in held:
        assert h["after_step"]["grads"] == h["after_step"]["params"] == prediction.grads
        assert h["during_forward"] == prediction.params  # the shards and layer 0's all-gather buffers (2 x padded)
    own_rows = [padded, 2 * 6 + 2 + 1 * 5 + 1]
    assert [h["after_step"]["optimizer"] for h in held] == [2 * F32 * n for n in own_rows]
    assert prediction.optimizer == max(h["after_step"]["optimizer"] for h in held)


@pytest.mark.parametrize("build,x", [(build_mlp, torch.randn(6, 8)), (gpt, tokens(6))], ids=["mlp", "gpt"])
def test_tensor_parallel_holds_what_the_plan_predicts(cluster, build, x):
    """Real DTensor tensor parallelism on 2 ranks against the prediction from the kernel's profile (whose split
    part was measured on a sliced copy): parameters, gradients and Adam exactly, activations within 10 %."""
    [prediction] = predict_memory(profile_layers(build(), x[:2]), dp=1, pp=1, tp=2, zero=0, boundaries=None,
                                  microbatches=1, schedule="1f1b", batch=len(x))
    for h in cluster.run(tensor_parallel_on_rank, build, x):
        assert (h["params"], h["grads"], h["optimizer"]) == (prediction.params, prediction.grads,
                                                             prediction.optimizer)
        assert abs(prediction.activations - h["activations"]) <= 0.10 * h["activations"]
    assert prediction.params < F32 * psi(build())  # something was split

"""The claims labs 39 (training choices) and 42 (backends and frameworks) rest on, checked against references that
do not come from the lab: torch's own autograd and GradScaler, nccl-tests' bus-bandwidth rule, the device rules (the lab
conventions, predict-then-run and nbgrader exercises: tests/test_lab_conventions.py).

The two exercise solutions are read from the notebooks and run here, so a lab's answer key cannot drift from what
its test cell and its prose say."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nbdist import models
from nbdist.collectives.sweep import busbw_factor
from nbdist.runtime.ranks import devices
from nbdist.sharding.memory import predict_memory
from nbdist.sharding.profile import profile_layers, sample_input
from nbdist.training.ranks.loss_scaling import AgreeingGradScaler

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LABS = ("39_training_choices.ipynb", "42_backends_and_frameworks.ipynb")


def _cells(name: str) -> list[dict]:
    return json.loads((NOTEBOOKS / name).read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _solution(name: str, grade_id: str) -> dict:
    """The namespace a lab's solution cell defines (its markers are comments: the cell runs as written)."""
    cell = next(c for c in _cells(name) if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)
    namespace = {"models": models, "torch": torch}
    exec(compile(_source(cell), f"{name}:{grade_id}", "exec"), namespace)  # noqa: S102 - the lab's own answer key
    return namespace


def _tiny_gpt() -> torch.nn.Sequential:
    return models.gpt(vocab=256, seq=16, layers=2, hidden=32, heads=4, seed=0)


def _batch(size: int = 16, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_accumulation_answer_equals_one_step_on_the_whole_batch(k):
    accumulate = _solution(LABS[0], "39-accumulate")["accumulate"]
    x, y = _batch()
    whole = _tiny_gpt()
    models.lm_loss(whole(x), y).backward()
    mine = _tiny_gpt()
    mine(x).sum().backward()  # stale gradients: the answer must start from cleared ones
    accumulate(mine, x, y, k)
    for (name, a), b in zip(whole.named_parameters(), mine.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_the_bus_bandwidth_answer_is_nccl_tests_rule(ranks):
    busbw = _solution(LABS[1], "42-busbw")["all_reduce_busbw"]
    for size, seconds in ((1024, 1e-5), (2**24, 3e-3)):
        assert math.isclose(busbw(size, seconds, ranks), size / seconds / 1e9 * busbw_factor("all_reduce", ranks))


def _fp16_run(scaler: torch.amp.GradScaler, steps: int) -> list[tuple[float, bool]]:
    """(scale used, whether the weights stayed unchanged) per fp16 autocast step."""
    model = _tiny_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x, y = _batch(8)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = models.lm_loss(model(x), y)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        out.append((scale, all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))))
    return out


@pytest.mark.slow
def test_a_scale_too_high_skips_steps_halving_it_as_torch_does():
    """Lab 39's fp16 section: every overflow skips the step (weights unchanged) and halves the scale, a step taken
    keeps it (torch doubles it only after 2000 clean steps); nbdist's agreeing scaler does on one process exactly
    what torch's GradScaler does."""
    ours = _fp16_run(AgreeingGradScaler("cpu", init_scale=2.0**40), 30)
    torchs = _fp16_run(torch.amp.GradScaler("cpu", init_scale=2.0**40), 30)
    assert ours == torchs
    assert ours[0][1] and not all(skipped for _, skipped in ours)  # 2^40 overflows; a lower scale fits
    for (scale, skipped), (following, _) in zip(ours, ours[1:]):
        assert following == (scale / 2 if skipped else scale)


def test_accumulation_keeps_the_activations_of_one_micro_batch():
    """Lab 39's memory panel: k micro-batches of a fixed size hold one micro-batch's activations, the same samples
    taken at once hold k times as many."""
    model = _tiny_gpt()
    layers = profile_layers(model, sample_input(model))

    def activations(microbatches: int, batch: int) -> int:
        return max(m.activations for m in predict_memory(layers, dp=2, pp=1, tp=1, zero=0, boundaries=None,
                                                         microbatches=microbatches, schedule="1f1b", batch=batch))

    one = activations(1, 2 * 4)
    for k in (2, 4, 8):
        assert activations(k, 2 * 4 * k) == one
        assert activations(1, 2 * 4 * k) > (k - 1) * one


def test_nbdist_starts_nccl_where_it_finds_gpus_and_mpi_where_it_finds_none():
    """Lab 42's NCCL paragraph: the rule boot.py applies on every engine."""
    assert devices.bind("auto", False, 1, 2, 8, "node1") == devices.Binding("cuda:1", "cpu:gloo,cuda:nccl")
    assert devices.bind("auto", False, 0, 2, 0, "node1") == devices.Binding("cpu", "mpi4py")
    assert devices.bind("gloo", False, 0, 2, 8, "node1") == devices.Binding("cpu", "gloo")

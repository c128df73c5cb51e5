"""ZeRO-3 accumulation with zero3_sync="last" (nbdist/layout.py, data_parallel/ranks/data_parallel.py: sync_on):
the micro-batches before the last skip FSDP2's reduce-scatter and keep their parameters gathered after backward.

Claims checked on a real 2-rank cluster: the step still equals one process's step on the whole batch; the flight
recorder (debugging/ranks/recorder.py, every call of nbdist's MPI backend) counts the reduce-scatters and all-gathers
FSDP2's rules give with and without it; the bytes held between micro-batches grow by what it keeps unsharded.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import nbdist
from nbdist import models
from nbdist.errors import DistUsageError
from nbdist.layout import Layout

MICRO = 4  # micro-batches per replica and step


def _gpt():
    from nbdist import models

    return models.gpt(vocab=256, seq=8, layers=2, hidden=32, heads=4, seed=0)


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.1)


def _batch(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (size, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _forget_calls() -> None:
    from nbdist.debugging.ranks import recorder

    recorder.clear()


def _recorded_calls() -> list[dict]:
    from nbdist.debugging.ranks import recorder

    return recorder.tail(recorder.SIZE)


def _measured(cluster, zero3_sync: str) -> dict:
    """One warm-up step, then one step counted: rank 0's calls by name and its memory report."""
    x, y = _batch()
    model = nbdist.shard(_gpt, dp=2, zero=3, microbatches=MICRO, zero3_sync=zero3_sync, cluster=cluster).apply(_sgd)
    try:
        model.step(x, y, models.lm_loss)
        cluster.run(_forget_calls)
        model.step(x, y, models.lm_loss, memory=True)
        calls = Counter(c["call"] for c in cluster.run(_recorded_calls)[0] for _ in range(c["calls"]))
        return {"calls": calls, "memory": model.measured_memory()[0]}
    finally:
        model.close()


def _units(model: torch.nn.Module) -> int:
    """FSDP2 units with parameters, as data_parallel/ranks/zero.py makes them: each top-level layer that has some
    (the root then holds none of its own)."""
    return sum(1 for layer in model.children() if any(True for _ in layer.parameters()))


def test_the_accumulated_step_equals_one_process(cluster):
    x, y = _batch()
    plan = nbdist.shard(_gpt, dp=2, zero=3, microbatches=MICRO, zero3_sync="last", cluster=cluster)
    equality = plan.check_equal(x, y, models.lm_loss, steps=3, optimizer_fn=_sgd, atol=1e-5)
    assert equality.equal, equality

    reference = _gpt()
    models.lm_loss(reference(x), y).backward()
    model = plan.apply(_sgd)
    try:
        model.step(x, y, models.lm_loss)
        grads = model.grads()
    finally:
        model.close()
    for key, p in reference.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, rtol=1e-5, atol=1e-6, msg=key)


def test_the_flight_recorder_counts_one_reduce_scatter_per_unit_and_fewer_gathers(cluster):
    """FSDP2's rules, per step of m micro-batches over U units: syncing every micro-batch reduce-scatters U·m times
    and gathers 2·U·m times (each forward, and each backward again: ZeRO-3 frees a unit after its forward); syncing
    the last only reduce-scatters U times, and the forwards after the first gather nothing (the parameters stayed
    gathered after backward), so U·(m + 1) gathers."""
    every, last = _measured(cluster, "every")["calls"], _measured(cluster, "last")["calls"]
    units = _units(_gpt())
    assert every["reduce_scatter_tensor"] == units * MICRO, every
    assert every["all_gather_into_tensor"] == 2 * units * MICRO, every
    assert last["reduce_scatter_tensor"] == units, last
    assert last["all_gather_into_tensor"] == units * (MICRO + 1), last


def test_it_holds_the_unsharded_parameters_and_gradients_between_micro_batches(cluster):
    """Between micro-batches a rank holds its shards of the parameters and gradients (P / dp each, P the model's
    float32 bytes) when every micro-batch syncs; with the last only, its shard of the parameters, the whole
    parameters gathered and the whole accumulated gradient: P / 2 + 2 P on 2 ranks (FSDP2 pads a shard to equal
    rows, so a little more)."""
    whole = 4 * sum(p.numel() for p in _gpt().parameters())
    every = _measured(cluster, "every")["memory"]["held_between"]
    last = _measured(cluster, "last")["memory"]["held_between"]
    assert whole <= every <= 1.02 * whole, (every, whole)
    assert 2.5 * whole <= last <= 1.02 * 2.5 * whole, (last, whole)


@pytest.mark.parametrize("choices, message", [
    (dict(dp=2, zero=2, microbatches=4, zero3_sync="last"), "this layout has zero=2"),
    (dict(dp=2, zero=3, zero3_sync="last"), "there is one micro-batch"),
    (dict(dp=2, zero=3, microbatches=4, zero3_sync="sometimes"), "zero3_sync must be 'every'"),
    (dict(dp=1, pp=2, zero=3, microbatches=4, zero3_sync="last"), "for pp = 1 plans"),
])
def test_bad_input_is_one_line(choices, message):
    with pytest.raises(DistUsageError, match=message) as caught:
        Layout(**choices)
    assert "\n" not in str(caught.value)


def test_the_trainer_takes_it_as_a_keyword_or_in_its_plan(cluster):
    """Trainer(zero3_sync="last", grad_accum=k, plan={... zero: 3}), or the key in the plan itself, trains as with
    every micro-batch synced."""
    losses = {}
    ways = {"every": ({}, {}), "keyword": ({"zero3_sync": "last"}, {}), "plan": ({}, {"zero3_sync": "last"})}
    for way, (keywords, in_plan) in ways.items():
        tr = nbdist.Trainer(_gpt, _text, models.lm_loss, _sgd, plan={"dp": 2, "zero": 3, **in_plan}, batch_size=16,
                            grad_accum=MICRO, live=False, cluster=cluster, **keywords)
        try:
            losses[way] = [r["loss"] for r in tr.fit(steps=3)]
            assert tr.plan.layout.zero3_sync == ("every" if way == "every" else "last")
        finally:
            tr.close()
    torch.testing.assert_close(losses["keyword"], losses["every"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses["plan"], losses["every"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options, message", [
    (dict(zero3_sync="last", grad_accum=4), "plan=None is plain data parallelism"),
    (dict(zero3_sync="last", grad_accum=4, plan={"dp": 2, "zero": 3, "zero3_sync": "every"}), "in one place"),
    (dict(zero3_sync="last", plan={"dp": 2, "zero": 3}), "there is one micro-batch"),
    (dict(zero3_sync="last", grad_accum=4, plan={"dp": 2, "zero": 1}), "this layout has zero=1"),
    (dict(zero3_sync="sometimes"), "zero3_sync must be 'every'"),
])
def test_the_trainer_says_bad_input_in_one_line(cluster, options, message):
    with pytest.raises(DistUsageError, match=message) as caught:
        nbdist.Trainer(_gpt, _text, models.lm_loss, _sgd, batch_size=16, live=False, cluster=cluster, **options)
    assert "\n" not in str(caught.value)


def _text():
    from nbdist import data

    return data.text_dataset(seq=8, max_bytes=1 << 12)

"""The local table of the plans' claims (nbdist.sharding.accuracy): each strategy planned, predicted, built and
measured on a real cluster, the prediction's terms adding up to it, memory per rank beside its prediction."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from nbdist import data, models
from nbdist.errors import DistUsageError
from nbdist.sharding import accuracy

SEQ, BATCH = 16, 8
tiny_gpt = partial(models.gpt, vocab=256, seq=SEQ, layers=2, hidden=32, heads=2, seed=0)
adam = partial(torch.optim.Adam, lr=1e-3)
CORPUS = data.byte_corpus()


def batches(step: int):
    return data.token_batch(CORPUS, step, BATCH, SEQ)


def test_each_strategy_is_predicted_then_measured(cluster):
    strategies = [dict(dp=2), dict(pp=2, microbatches=2)]
    rows = accuracy.check_all(tiny_gpt, strategies, batch=BATCH, steps=2, batches=batches, loss_fn=models.lm_loss,
                              optimizer_fn=adam, cluster=cluster)
    assert [row.strategy for row in rows] == ["dp=2", "pp=2 microbatches=2"]
    for row in rows:
        assert row.predicted_s > 0 and len(row.measured_s) == 2 and all(t > 0 for t in row.measured_s)
        assert sum(row.terms.values()) == pytest.approx(row.predicted_s)
        assert row.dominant in row.terms
        assert row.error == pytest.approx(row.measured_median_s / row.predicted_s - 1)
        assert sorted(rank for rank, _, _ in row.memory) == [0, 1]
        assert row.memory_error < 0.10, row.memory  # the plan's memory claim, on every rank
    assert rows[1].terms["pipeline bubbles and messages"] > 0 and rows[0].terms["pipeline bubbles and messages"] == 0
    text = accuracy.table(rows)
    assert text.splitlines()[0].split()[:3] == ["strategy", "predicted", "measured"]
    for row in rows:
        line = next(line for line in text.splitlines() if line.startswith(row.strategy + " "))
        assert f"{row.error:+.1%}" in line and row.dominant in line
        assert line.endswith("MISS") == (abs(row.error) > 0.25)


def test_a_miss_is_marked_by_the_tolerance_given():
    row = accuracy.Checked("dp=2", 0.1, {"compute": 0.1}, [0.2, 0.2, 0.2], [(0, 100.0, 100.0)])
    assert row.error == pytest.approx(1.0) and row.memory_error == 0
    assert accuracy.table([row]).endswith("MISS")
    assert not accuracy.table([row], tolerance=1.5).endswith("MISS")


def test_bad_steps_are_one_line(cluster):
    with pytest.raises(DistUsageError, match="steps"):
        accuracy.check(tiny_gpt, dict(dp=2), batch=BATCH, steps=0, batches=batches, loss_fn=models.lm_loss,
                       optimizer_fn=adam, cluster=cluster)

"""The Trainer's options grouped by concern (layout, data, optimisation, checkpoints, telemetry): the same run
from keywords or from one object per concern, both at once refused in one line, and a Layout as the plan; the
grouped run trains exactly as the keyword run (the Trainer's fidelity tests run the keyword form)."""
from __future__ import annotations

import pytest

import nbdist
from nbdist import models
from nbdist.errors import DistUsageError
from nbdist.layout import Layout
from nbdist.training.spec import Checkpointing, Data, Optimization, Telemetry
from test_trainer import BATCH, adam, assert_same, data_fn, model_fn, warm_then_decay


def test_keywords_and_groups_make_the_same_run(cluster, tmp_path):
    by_keywords = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, cluster=cluster, batch_size=BATCH,
                                 seed=3, grad_accum=2, clip=1.0, lr_schedule=warm_then_decay,
                                 checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2, live=False)
    by_groups = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, cluster=cluster,
                               data=Data(batch_size=BATCH, seed=3),
                               optimization=Optimization(grad_accum=2, clip=1.0, lr_schedule=warm_then_decay),
                               checkpointing=Checkpointing(dir=str(tmp_path / "b"), every=2),
                               telemetry=Telemetry(live=False))
    try:
        assert by_keywords.data == by_groups.data and by_keywords.optimization == by_groups.optimization
        assert by_keywords.telemetry == by_groups.telemetry
        assert by_keywords.plan.layout == by_groups.plan.layout == Layout(dp=2, microbatches=2)
        by_keywords.fit(steps=3)
        by_groups.fit(steps=3)
        assert [r["loss"] for r in by_keywords.history.records] == [r["loss"] for r in by_groups.history.records]
        assert_same(by_groups.state_dict(), by_keywords.state_dict(), atol=0)
        written = [sorted(p.name for p in (tmp_path / d).iterdir()) for d in ("a", "b")]
        assert written[0] == written[1] == ["step_00000002"]
    finally:
        by_keywords.close()
        by_groups.close()


@pytest.mark.parametrize("options, line", [
    (dict(data=Data(batch_size=8), batch_size=16), "give the data options in one place"),
    (dict(optimization=Optimization(), precision="bf16"), "give the optimization options in one place"),
    (dict(checkpointing={"dir": "x"}), "checkpointing must be a Checkpointing, got dict"),
    (dict(checkpointing=Checkpointing(every=2)), "checkpoint_every needs a checkpoint_dir"),
])
def test_options_given_twice_or_wrong_are_refused_in_one_line(cluster, options, line):
    before = cluster.holdings()
    with pytest.raises(DistUsageError, match=line) as raised:
        nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, cluster=cluster, live=False, **options)
    assert "\n" not in str(raised.value)
    assert cluster.holdings() == before  # refused before anything was built on the ranks


def test_a_layout_is_a_plan(cluster):
    tr = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, cluster=cluster, batch_size=BATCH, live=False,
                        plan=Layout(tp=2))
    try:
        assert tr.plan.layout == Layout(tp=2) and tr.plan.tp == 2
        held = [h for h in cluster.holdings() if h.get("name") == tr.model.id]
        assert held and all("dp=1 tp=2 zero=0" in h["what"] for h in held), held  # what %dist_status shows
    finally:
        tr.close()

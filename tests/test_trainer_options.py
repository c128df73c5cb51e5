"""The Trainer's options grouped by concern (layout, data, optimisation, checkpoints, telemetry): the same run
from keywords or from one object per concern, both at once refused in one line, and a Layout as the plan; the
grouped run trains exactly as the keyword run (the Trainer's fidelity tests run the keyword form). Each field is one
keyword (an unknown one is named, with a guess), and a Trainer builds nothing on the ranks before its first need."""
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
        name = tr.model.id  # built on the ranks at this first need (not when the Trainer is made)
        held = [h for h in cluster.holdings() if h.get("name") == name]
        assert held and all("dp=1 tp=2 zero=0" in h["what"] for h in held), held  # what %dist_status shows
    finally:
        tr.close()


# -- each option given once; nothing on the ranks until it is needed -------------------------------------------------

UNKNOWN_OR_TWICE = [  # (options, the line)
    ({"batchsize": 8}, (r"^Trainer has no option 'batchsize' \(did you mean batch_size\?\): its options are data: "
                        r"batch_size, seed, ")),
    ({"dir": "ckpt"}, r"^Trainer has no option 'dir' \(did you mean checkpoint_dir\?\)"),
    ({"learning_rate": 0.1}, (r"^Trainer has no option 'learning_rate': its options are .*; checkpointing: "
                              r"checkpoint_dir, checkpoint_every, async_checkpoint; telemetry: live, tensorboard, "
                              r"trace, straggler$")),
    ({"data": Data(batch_size=8), "seed": 3}, (r"^give the data options in one place: seed given beside "
                                               r"data=Data\(\.\.\.\); give Data\(\.\.\., seed=\.\.\.\) or every data "
                                               r"option as a keyword$")),
    ({"checkpointing": Checkpointing(), "checkpoint_dir": "x"},
     (r"^give the checkpointing options in one place: checkpoint_dir given beside "
      r"checkpointing=Checkpointing\(\.\.\.\); give Checkpointing\(\.\.\., dir=\.\.\.\)")),
]


@pytest.mark.parametrize("options, line", UNKNOWN_OR_TWICE)
def test_an_option_unknown_or_given_twice_is_one_line_before_a_cluster_is_asked(options, line):
    with pytest.raises(DistUsageError, match=line) as raised:
        nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, **options)
    assert "\n" not in str(raised.value)


def test_every_field_of_the_four_concerns_is_one_keyword_in_the_signature_and_the_docstring():
    import inspect
    from dataclasses import MISSING, fields

    from nbdist.training import options

    parameters, doc = inspect.signature(nbdist.Trainer).parameters, nbdist.Trainer.__doc__
    keywords = {where: keyword for keyword, where in options.KEYWORDS.items()}
    for group, cls in options.GROUPS.items():
        assert f"{group}={cls.__name__}(" in doc
        for f in fields(cls):
            keyword = keywords[(group, f.name)]
            default = f.default if f.default is not MISSING else f.default_factory()
            assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY and parameters[keyword].default == default
            assert f"{f.name}=" in doc and keyword in doc, keyword
    assert set(options.KEYWORDS) == {name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY} - set(
        options.GROUPS) - {"cluster"}


def test_a_trainer_is_built_on_the_ranks_at_its_first_need_and_not_after_close(cluster):
    from nbdist.runtime.ranks import registry

    def held() -> list:
        return [cluster.run(registry.names, kind) for kind in ("sharded", "pipeline", "trainer")]

    before = held()
    piped = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, cluster=cluster, batch_size=BATCH, live=False,
                           plan={"pp": 2, "microbatches": 2})
    with pytest.raises(DistUsageError, match=r"^no pipeline step reported by every rank yet: train first \(fit\)$"):
        piped.bubbles()
    tr = nbdist.Trainer(model_fn, data_fn, models.lm_loss, adam, cluster=cluster, batch_size=BATCH, live=False)
    try:
        assert held() == before  # options checked and layouts planned in the kernel; nothing built
        tr.fit(steps=1)
        assert all(tr.id in names for names in held()[2]) and tr.step == 1
    finally:
        tr.close()
        piped.close()
    assert held() == before
    with pytest.raises(DistUsageError, match=rf"^Trainer {tr.id} is closed \(close\(\) freed it on the ranks\): make "
                                             r"a new Trainer$"):
        tr.fit(steps=1)

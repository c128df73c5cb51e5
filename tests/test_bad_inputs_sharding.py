"""Bad input to nbdist.shard, to a sharded model or pipeline, and to checkpoints is one line (issue 22).

Each case gives nbdist.shard, a built model's step, or a checkpoint something wrong and checks what a person sees:
ONE DistUsageError line naming the problem, no rank output (no rank traceback), nothing left on the ranks (no
sharded model, pipeline or trainer more than before) and the cluster as usable as before. On the shared 2-engine
`cluster` (tests/conftest.py); the checkpoints are real ones a Trainer wrote, then damaged.
"""
from __future__ import annotations

import functools
import os
import re
import shutil

import pytest
import torch

import nbdist
from nbdist import data, models
from nbdist.errors import DistUsageError


def mlp():
    from nbdist import models

    return models.mlp(width=16, layers=2, inputs=8, outputs=1, seed=0)


def odd_width():
    from nbdist import models

    return models.mlp(width=15, layers=2, inputs=8, outputs=1, seed=0)


def not_a_module():
    return 5


def raising_model():
    raise ValueError("no weights here")


def sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.1)


def mse(output, target):
    import torch

    return torch.nn.functional.mse_loss(output, target)


X, Y = torch.randn(8, 8), torch.randn(8, 1)

BAD_PLANS = [  # (id, shard's arguments, the line)
    ("dp=3 on 2 ranks", dict(dp=3), r"dp × pp × tp = 3 × 1 × 1 = 3, but the cluster has 2 ranks"),
    ("dp=0", dict(dp=0), r"dp must be at least 1, got 0"),
    ("dp=1.5", dict(dp=1.5), r"dp must be a whole number, got 1\.5"),
    ("tp over an odd width", dict(model_fn=odd_width, tp=2), r"tp=2 does not divide the 15 features"),
    ("model_fn not a function", dict(model_fn=5, dp=2), r"model_fn must be a function that builds the model, got int"),
    ("model_fn gives no module", dict(model_fn=not_a_module, dp=2), r"model_fn must return an nn\.Module"),
    ("model_fn raises", dict(model_fn=raising_model, dp=2), r"model_fn raised ValueError: no weights here"),
    ("zero=5", dict(dp=2, zero=5), r"zero must be a ZeRO stage 0, 1, 2 or 3, got 5"),
    ("unknown schedule", dict(pp=2, microbatches=2, schedule="bogus"), r"unknown schedule 'bogus': choose gpipe"),
    ("microbatches=0", dict(pp=2, microbatches=0), r"microbatches must be at least 1, got 0"),
    ("chunks without a pipeline", dict(dp=2, chunks=2), r"chunks=2 cuts pipeline stages, but pp=1 has none"),
    ("unknown optimizer", dict(dp=2, optimizer="lion"), r"unknown optimizer 'lion': choose adam, adamw"),
    ("unknown hook", dict(dp=2, hook="zip"), r"unknown hook 'zip': choose auto, mpi, torch"),
    ("bucket_cap_mb=-1", dict(dp=2, bucket_cap_mb=-1), r"bucket_cap_mb must be a positive number of MiB"),
    ("batch=0", dict(dp=2, batch=0), r"batch must be at least 1, got 0"),
    ("a layout and keywords", dict(dp=nbdist.Layout(dp=2), tp=2), r"give the layout's choices in one place"),
    ("more pieces than layers", dict(pp=2, chunks=4, microbatches=4, schedule="interleaved-1f1b"),
     r"the model has 3 layers, fewer than pp × chunks = 8 stages"),
]


def held(cluster) -> list:
    from nbdist.runtime.ranks import registry

    return [cluster.run(registry.names, kind) for kind in ("sharded", "pipeline", "trainer")]


def refused(cluster, capfd, call, line: str) -> None:
    """`call()` raises one DistUsageError line matching `line`, prints nothing, leaves nothing on the ranks, and
    the cluster is usable after."""
    before = held(cluster)
    capfd.readouterr()
    with pytest.raises(DistUsageError) as raised:
        call()
    said = str(raised.value)
    assert "\n" not in said and type(raised.value) is DistUsageError, said
    assert re.search(line, said), said
    out, err = capfd.readouterr()
    assert out + err == "", out + err
    assert held(cluster) == before
    assert cluster.run(lambda: 1) == [1, 1]


@pytest.mark.parametrize("options, line", [c[1:] for c in BAD_PLANS], ids=[c[0] for c in BAD_PLANS])
def test_a_bad_plan_is_one_line(cluster, capfd, options, line):
    options = {"model_fn": mlp, **options}
    refused(cluster, capfd, lambda: nbdist.shard(options.pop("model_fn"), **options), line)


@pytest.fixture
def sharded(cluster):
    """A dp=2 plan and its model, made for each test (the shared cluster's entries are dropped after each)."""
    plan = nbdist.shard(mlp, dp=2)
    model = plan.apply(sgd)
    yield plan, model
    model.close()


@pytest.fixture
def piped(cluster, request):
    """A pp=2 pipeline of the same model, for the cases that step one (made before the case, closed after)."""
    model = nbdist.shard(mlp, pp=2, microbatches=2).apply(sgd) if "pipeline" in request.node.callspec.id else None
    yield model
    if model is not None:
        model.close()


BAD_STEPS = [  # (id, call on (plan, sharded model, pipeline), the line)
    ("apply a number", lambda plan, m, p: plan.apply(5), r"optimizer_fn must be a function, got int"),
    ("apply a negative lr", lambda plan, m, p: plan.apply(lambda ps: torch.optim.SGD(ps, lr=-1)),
     r"optimizer_fn: Invalid learning rate: -1"),
    ("apply no optimizer", lambda plan, m, p: plan.apply(lambda ps: list(ps)),
     r"optimizer_fn must return a torch\.optim\.Optimizer"),
    ("profile repeats=0", lambda plan, m, p: plan.profile(repeats=0), r"repeats must be at least 1, got 0"),
    ("a batch that does not split", lambda plan, m, p: m.step(torch.randn(3, 8), torch.randn(3, 1), mse),
     r"batch of 3 inputs does not split into 2 replicas × 1 equal micro-batches"),
    ("five features for eight", lambda plan, m, p: m.step(torch.randn(8, 5), Y, mse),
     r"the batch gives inputs of torch\.float32 \(one sample shaped \(5,\)\), but the model's first layer, "
     r"Linear\(8, 16\), takes 8 features"),
    ("float64 inputs", lambda plan, m, p: m.step(X.double(), Y.double(), mse),
     r"the batch gives inputs of torch\.float64 .* has torch\.float32 weights"),
    ("token ids into a Linear", lambda plan, m, p: m.step(torch.zeros(8, 8, dtype=torch.long), Y, mse),
     r"the batch gives inputs of torch\.int64 .* takes torch\.float32 values"),
    ("a loss that is a number", lambda plan, m, p: m.step(X, Y, 5), r"loss_fn must be a function, got int"),
    ("a loss of one argument", lambda plan, m, p: m.step(X, Y, lambda out: out.sum()),
     r"loss_fn is called as loss_fn\(output, target\)"),
    ("inputs and targets disagree", lambda plan, m, p: m.step(X, torch.randn(6, 1), mse), r"8 inputs but 6 targets"),
    ("inputs a list", lambda plan, m, p: m.step([1, 2], Y, mse),
     r"inputs must be a tensor, a tuple of tensors or a dict of tensors .*got list"),
    ("step timeout=-1", lambda plan, m, p: m.step(X, Y, mse, timeout=-1), r"timeout must be a positive number"),
    ("memory before measuring", lambda plan, m, p: m.measured_memory(), r"no step measured memory yet"),
    ("pipeline: float64 inputs", lambda plan, m, p: p.step(X.double(), Y.double(), mse),
     r"the batch gives inputs of torch\.float64"),
    ("pipeline: a loss that is a number", lambda plan, m, p: p.step(X, Y, 5), r"loss_fn must be a function"),
    ("pipeline: a batch that does not split", lambda plan, m, p: p.step(torch.randn(3, 8), torch.randn(3, 1), mse),
     r"batch of 3 inputs does not split into 2 equal micro-batches"),
]


@pytest.mark.parametrize("call, line", [c[1:] for c in BAD_STEPS], ids=[c[0] for c in BAD_STEPS])
def test_a_bad_step_is_one_line_and_the_model_steps_after(cluster, capfd, sharded, piped, call, line):
    plan, model = sharded
    refused(cluster, capfd, lambda: call(plan, model, piped), line)
    assert torch.isfinite(torch.tensor(model.step(X, Y, mse)))


# -- checkpoints ---------------------------------------------------------------------------------------------------

def trainer(model_fn=mlp, **options):
    return nbdist.Trainer(model_fn, functools.partial(data.regression_dataset, samples=64, inputs=8), mse, sgd,
                          batch_size=8, live=False, **options)


def wider():
    from nbdist import models

    return models.mlp(width=32, layers=2, inputs=8, outputs=1, seed=0)


@pytest.fixture(scope="module")
def saved(cluster, tmp_path_factory) -> str:
    """A checkpoint a Trainer wrote after 2 steps."""
    folder = tmp_path_factory.mktemp("checkpoints")
    t = trainer(checkpoint_dir=str(folder))
    try:
        t.fit(steps=2)
        return t.save()
    finally:
        t.close()


def damaged(saved: str, tmp_path, damage) -> str:
    """A copy of the checkpoint (a step_* folder) with `damage(folder)` done to it."""
    copy = tmp_path / "copy" / os.path.basename(saved)
    shutil.copytree(saved, copy)
    damage(str(copy))
    return str(copy)


def _truncate_a_shard(folder: str) -> None:
    shard = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))[0]
    with open(os.path.join(folder, shard), "r+b") as f:
        f.truncate(10)


def _overwrite_rng(folder: str) -> None:
    for name in os.listdir(folder):
        if name.endswith(".rng"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b"not a tensor" * 8)


def _remove_trainer_json(folder: str) -> None:
    os.remove(os.path.join(folder, "trainer.json"))


BAD_CHECKPOINTS = [  # (id, Trainer options, what is given to resume (a function of saved, tmp_path), the line)
    ("no such folder", {}, lambda saved, tmp: str(tmp / "nope"), r"no checkpoint at .*nope: the folder does not exist"),
    ("a file", {}, lambda saved, tmp: str(_file(tmp)), r"no checkpoint at .*a-file: a file, not a checkpoint folder"),
    ("an empty folder", {}, lambda saved, tmp: str(tmp), r"no complete checkpoint in "),
    ("nothing given", {}, lambda saved, tmp: None, r"resume\(\) needs a checkpoint: give resume\(path\)"),
    ("a truncated shard", {}, lambda saved, tmp: damaged(saved, tmp, _truncate_a_shard),
     r"cannot be loaded \(__0_0\.distcp is corrupt or incomplete: 10 bytes"),
    ("garbage random state", {}, lambda saved, tmp: damaged(saved, tmp, _overwrite_rng),
     r"cannot be loaded \(rank\d\.rng is corrupt or incomplete"),
    ("a save that did not finish", {}, lambda saved, tmp: damaged(saved, tmp, _remove_trainer_json),
     r"is not a complete checkpoint \(no \.metadata or trainer\.json"),
    ("another model's checkpoint", {"model_fn": wider}, lambda saved, tmp: saved,
     r"cannot be loaded \(rank 0: UnreadableCheckpoint: ValueError: Size mismatch between saved "
     r"torch\.Size\(\[16, 8\]\) and current: torch\.Size\(\[32, 8\]\)"),
]


def _file(tmp):
    path = tmp / "a-file"
    path.write_text("")
    return path


@pytest.mark.parametrize("options, given, line", [c[1:] for c in BAD_CHECKPOINTS],
                         ids=[c[0] for c in BAD_CHECKPOINTS])
def test_a_bad_checkpoint_is_one_line_and_the_trainer_trains_after(cluster, capfd, saved, tmp_path, options, given,
                                                                     line):
    t = trainer(**options)
    try:
        path = given(saved, tmp_path)
        refused(cluster, capfd, lambda: t.resume(path), line)
        assert len(t.fit(steps=1)) == 1
    finally:
        t.close()


@pytest.mark.parametrize("where", ["file", "none"])
def test_saving_where_nothing_can_be_written_is_one_line(cluster, capfd, tmp_path, where):
    t = trainer()
    try:
        if where == "file":
            refused(cluster, capfd, lambda: t.save(str(_file(tmp_path))), r"checkpoint folder .*a-file is not "
                                                                            r"writable \(a file, not a folder\)")
        else:
            refused(cluster, capfd, t.save, r"save\(\) needs a folder: give save\(directory\)")
    finally:
        t.close()


def test_at_least_thirty_bad_inputs_are_covered_here():
    assert len(BAD_PLANS) + len(BAD_STEPS) + len(BAD_CHECKPOINTS) + 2 >= 30


def test_the_test_model_is_what_the_cases_assume():
    assert len(mlp()) == 3 and isinstance(models.mlp(width=16, layers=2, inputs=8, outputs=1)[0], torch.nn.Linear)

"""Bad input to nbdist.Trainer is one line, and a NaN loss stops the fit (issue 22), on real clusters.

Each bad input (a data set that does not fit the model, a loss that is not one number, an optimizer function that
gives no optimizer or a bad learning rate, a model function that gives no module, out-of-range counts, eval
options that do not go together...) raises one DistUsageError line naming it, with no rank output (no rank
traceback), and the cluster trains normally after it. A NaN loss stops the fit after the step where the ranks
learn of it, in one line naming the step and the ranks whose loss it was (under every plan and sync mode), and
says truthfully what the weights hold; on_nonfinite="warn" / "ignore" train on and return the NaN losses.
"""
from __future__ import annotations

import math
import os
import re
import tempfile

import pytest
import torch

import nbdist
from nbdist import data
from nbdist.errors import DistUsageError
from nbdist.training.spec import Optimization
from nbdist.training.trainer import NonFiniteLoss

BATCH = 8
SAMPLES = 64
PIPELINE = {"pp": 2, "microbatches": 2}
NAN_STEP = 3


def mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def regression():
    from nbdist import data

    return data.regression_dataset(samples=64, inputs=8)


def as_float64():
    import torch

    from nbdist import data

    x, y = data.regression(samples=64, inputs=8)
    return torch.utils.data.TensorDataset(x.double(), y.double())


def five_features():
    from nbdist import data

    return data.regression_dataset(samples=64, inputs=5)


def nan_at_step_3():
    """The regression data with one NaN sample: the first of global batch 3 (so in rank 0's share under dp=2)."""
    import torch

    from nbdist import data

    x, y = data.regression(samples=64, inputs=8)
    x[int(data.batch_indices(64, 3, 8, 0)[0])] = float("nan")
    return torch.utils.data.TensorDataset(x, y)


def mse(output, target):
    import torch

    return torch.nn.functional.mse_loss(output, target)


def per_sample(output, target):
    return ((output - target) ** 2).mean(dim=1)


def class_loss(output, target):  # wants integer class targets, gets the regression's floats
    import torch

    return torch.nn.functional.nll_loss(output, target)


def sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.01)


def negative_lr(params):
    import torch

    return torch.optim.SGD(params, lr=-0.1)


def zero_lr(params):
    import torch

    return torch.optim.SGD(params, lr=0.0)


def parameters_list(params):
    return list(params)


def other_tensors(params):  # passed the model's parameters, steps tensors of its own
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)


def first_layer_only(params):  # the first Linear's weight and bias; the second Linear is left out
    import torch

    return torch.optim.SGD(list(params)[:2], lr=0.1)


def stream_of_64():
    """An iterable data set of 64 samples (no len()): a step of 128 would read each sample twice."""
    import torch

    from nbdist import data

    x, y = data.regression(samples=64, inputs=8)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(x, y))

    return Stream()


def not_a_module():
    return 42


class TwoLayers(torch.nn.Module):  # not a Sequential: its first layer cannot be told without running it
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def two_layers():
    return TwoLayers()


def nan_factor(step):
    return float("nan")


def no_data():
    return 5


def one_argument_loss(output):
    return output.sum()


def run(cluster, model_fn=mlp, data_fn=regression, loss_fn=mse, optimizer_fn=sgd, fit=None, **options):
    """A Trainer on the shared cluster, fitted (`fit`: fit's keywords, 2 steps by default); closed after."""
    trainer = None
    try:
        trainer = nbdist.Trainer(model_fn, data_fn, loss_fn, optimizer_fn, cluster=cluster,
                                 **{"batch_size": BATCH, "live": False, **options})
        return trainer.fit(**(fit or {"steps": 2}))
    finally:
        if trainer is not None:
            trainer.close()


def trains_normally(cluster) -> None:
    losses = [r["loss"] for r in run(cluster, fit={"steps": 2})]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses


def held(cluster) -> list:
    from nbdist.runtime.ranks import registry

    return [cluster.run(registry.names, kind) for kind in ("sharded", "pipeline", "trainer")]


BAD_INPUTS = [  # (id, Trainer / fit options, the line)
    ("float64 data", dict(data_fn=as_float64),
     r"data_fn as_float64 gives inputs of torch\.float64 \(one sample shaped \(8,\)\), but the model's first layer, "
     r"Linear\(8, 16\), has torch\.float32 weights"),
    ("float64 data, pipeline", dict(data_fn=as_float64, plan=PIPELINE),
     r"data_fn as_float64 gives inputs of torch\.float64"),
    ("float64 data, ssp", dict(data_fn=as_float64, sync="ssp"), r"data_fn as_float64 gives inputs of torch\.float64"),
    ("float64 data, zero 3", dict(data_fn=as_float64, plan={"dp": 2, "zero": 3}), r"has torch\.float32 weights"),
    ("five features for eight", dict(data_fn=five_features),
     r"data_fn five_features gives inputs of torch\.float32 \(one sample shaped \(5,\)\), but the model's first "
     r"layer, Linear\(8, 16\), takes 8 features \(the last dimension\)"),
    ("float64 into a custom model", dict(model_fn=two_layers, data_fn=as_float64, sync="local-sgd"),
     r"the model's forward failed on data_fn as_float64's first batch \(inputs torch\.float64 \(4, 8\), targets "
     r"torch\.float64 \(4, 1\); the model's parameters are torch\.float32\): RuntimeError: mat1 and mat2 must have "
     r"the same dtype"),
    ("float targets for a class loss", dict(loss_fn=class_loss),
     r"loss_fn failed on the model's outputs torch\.float32 \(4, 1\), targets torch\.float32 \(4, 1\): RuntimeError"),
    ("a loss per sample", dict(loss_fn=per_sample),
     r"loss_fn must return one number per batch \(a tensor, e\.g\. a mean\), got a tensor of shape \(4,\)"),
    ("a loss per sample, pipeline", dict(loss_fn=per_sample, plan=PIPELINE), r"got a tensor of shape \(4,\)"),
    ("a loss of one argument", dict(loss_fn=one_argument_loss),
     r"loss_fn is called as loss_fn\(output, target\), but it takes \(output\)"),
    ("negative lr", dict(optimizer_fn=negative_lr), r"optimizer_fn: Invalid learning rate: -0\.1"),
    ("zero lr", dict(optimizer_fn=zero_lr), r"optimizer_fn's learning rate must be > 0, got lr=0\.0"),
    ("no optimizer", dict(optimizer_fn=parameters_list),
     r"optimizer_fn must return a torch\.optim\.Optimizer .*got list"),
    ("an optimizer over other tensors", dict(optimizer_fn=other_tensors),
     r"^optimizer_fn's optimizer holds none of the model's parameters \(it was passed them and steps other tensors\): "
     r"training would leave the model unchanged; build it over the parameters it is passed"),
    ("an optimizer over other tensors, pipeline", dict(optimizer_fn=other_tensors, plan=PIPELINE),
     r"^optimizer_fn's optimizer holds none of the model's parameters"),
    ("an optimizer over other tensors, tp zero 1", dict(optimizer_fn=other_tensors, plan={"tp": 2, "zero": 1}),
     r"^optimizer_fn's optimizer holds none of the model's parameters"),
    ("an optimizer over other tensors, local-sgd", dict(optimizer_fn=other_tensors, sync="local-sgd"),
     r"^optimizer_fn's optimizer holds none of the model's parameters"),
    ("batch_size over an iterable's samples", dict(data_fn=stream_of_64, batch_size=128),
     r"^batch_size 128 is larger than data_fn stream_of_64's 64 samples \(one pass of the iterable\): a step would "
     r"read some twice; give batch_size <= 64$"),
    ("no module", dict(model_fn=not_a_module), r"model_fn must return an nn\.Module .*got int"),
    ("no module, local-sgd", dict(model_fn=not_a_module, sync="local-sgd"),
     r"model_fn must return an nn\.Module, got int"),
    ("no data set", dict(data_fn=no_data), r"data_fn no_data must return a map-style data set .*got int"),
    ("batch_size 0", dict(batch_size=0), r"batch_size must be at least 1, got 0"),
    ("batch_size 2.5", dict(batch_size=2.5), r"batch_size must be a whole number, got 2\.5"),
    ("steps 0", dict(fit={"steps": 0}), r"steps must be at least 1, got 0"),
    ("steps 1.5", dict(fit={"steps": 1.5}), r"steps must be a whole number, got 1\.5"),
    ("epochs -1", dict(fit={"epochs": -1}), r"epochs must be a positive number, got -1"),
    ("epochs nan", dict(fit={"epochs": float("nan")}), r"epochs must be a positive number, got nan"),
    ("a NaN learning-rate factor", dict(lr_schedule=nan_factor), r"lr_schedule\(0\) gave nan"),
    ("eval data without eval_every", dict(eval_data_fn=regression),
     r"eval_data_fn is evaluated every eval_every steps"),
    ("float64 eval data", dict(eval_data_fn=as_float64, eval_every=1),
     r"eval_data_fn gives inputs of torch\.float64"),
    ("local-sgd period 0", dict(sync="local-sgd", sync_options={"period": 0}),
     r"local-sgd: period must be an integer >= 1"),
    ("a straggler beyond the ranks", dict(straggler={5: 1.0}), r"straggler names rank 5, but the ranks are 0\.\.1"),
    ("unknown on_nonfinite", dict(on_nonfinite="skip"), r"unknown on_nonfinite 'skip': choose stop, warn, ignore"),
]


@pytest.mark.parametrize("options, line", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_a_bad_input_is_one_line_and_the_cluster_trains_after(cluster, capfd, options, line):
    before = held(cluster)
    capfd.readouterr()
    with pytest.raises(DistUsageError, match=line) as raised:
        run(cluster, **options)
    said = str(raised.value)
    assert "\n" not in said and type(raised.value) is DistUsageError, said
    out, err = capfd.readouterr()
    assert out + err == "", out + err  # no rank traceback, nor anything else
    assert held(cluster) == before  # nothing left on the ranks
    trains_normally(cluster)


def test_at_least_a_dozen_bad_inputs_are_covered():
    assert len(BAD_INPUTS) >= 12


def test_an_optimizer_leaving_parameters_out_is_one_warning_line_before_training(cluster, capfd):
    """Those it leaves out get gradients and never change: said once, before the first step; the rest trains."""
    trainer = nbdist.Trainer(mlp, regression, mse, first_layer_only, cluster=cluster, batch_size=BATCH, live=False)
    try:
        capfd.readouterr()
        before = trainer.state_dict()  # the first need of the ranks' side: built, and said, here
        trainer.fit(steps=2)
        out, err = capfd.readouterr()
        assert out == "" and err == (
            "warning: optimizer_fn's optimizer leaves out 2 of the model's trainable parameters (2.bias, 2.weight): "
            "they get gradients and never change; build it over every parameter it is passed, or set "
            "requires_grad=False on those it should not train\n"), err
        after = trainer.state_dict()
        assert sorted(k for k in before if torch.equal(before[k], after[k])) == ["2.bias", "2.weight"]
    finally:
        trainer.close()


def test_a_pipeline_plan_without_microbatches_gets_a_valid_default(cluster):
    """pp=2 with the Trainer's defaults (grad_accum 1, no micro-batches given): 1F1B refused one micro-batch; the
    Trainer now picks 2·pp = 4 (micro-batches of 2 samples of the 8) and trains like microbatches=4 given."""
    chosen = nbdist.Trainer(mlp, regression, mse, sgd, plan={"pp": 2}, cluster=cluster, batch_size=BATCH,
                            live=False)
    given = nbdist.Trainer(mlp, regression, mse, sgd, plan={"pp": 2, "microbatches": 4}, cluster=cluster,
                           batch_size=BATCH, live=False)
    try:
        assert chosen.plan.microbatches == 4 and chosen.plan.schedule.name == "1f1b"
        losses = [[r["loss"] for r in t.fit(steps=3)] for t in (chosen, given)]
        assert losses[0] == losses[1] and all(math.isfinite(v) for v in losses[0]), losses
    finally:
        chosen.close()
        given.close()


# -- a loss that is not finite ------------------------------------------------------------------------------------

NAN_CASES = [  # (id, options, the ranks whose loss is NaN, the last step trained, what the weights hold)
    ("ddp", {}, "rank 0", NAN_STEP, "now non-finite on ranks 0, 1"),
    ("zero 3", {"plan": {"dp": 2, "zero": 3}}, "rank 0", NAN_STEP, "now non-finite on ranks 0, 1"),
    ("tp", {"plan": {"tp": 2}}, "ranks 0, 1", NAN_STEP, "now non-finite on ranks 0, 1"),
    ("pipeline", {"plan": PIPELINE}, "rank 1", NAN_STEP, "now non-finite on ranks 0, 1"),
    ("fp16, the scaler skips the step", {"precision": "fp16"}, "rank 0", NAN_STEP, "still finite"),
    ("ssp", {"sync": "ssp"}, "rank 0", NAN_STEP + 3, None),  # agreed staleness + 1 = 3 steps late
    ("local-sgd", {"sync": "local-sgd", "sync_options": {"period": 2}}, "rank 0", NAN_STEP + 2, None),
    ("easgd", {"sync": "easgd"}, "rank 0", NAN_STEP + 1, None),
]


@pytest.mark.parametrize("options, ranks, last, weights", [c[1:] for c in NAN_CASES], ids=[c[0] for c in NAN_CASES])
def test_a_nan_loss_stops_the_fit_at_its_step_naming_the_ranks(cluster, capfd, options, ranks, last, weights):
    tr = nbdist.Trainer(mlp, nan_at_step_3, mse, sgd, cluster=cluster, batch_size=BATCH, live=False, **options)
    try:
        capfd.readouterr()
        with pytest.raises(NonFiniteLoss) as raised:
            tr.fit(steps=10)
        said = str(raised.value)
        assert "\n" not in said
        assert said.startswith(f"step {NAN_STEP}: the loss is nan on {ranks} (the first non-finite loss of this fit); "
                               ), said
        if last == NAN_STEP:
            assert f"the fit stopped after it, and its optimizer step had run: the weights are {weights}" in said
        else:
            assert f"the fit stopped after step {last} (the replicas learn each other's losses" in said, said
        assert tr.step == last + 1  # every rank stopped after the same step
        losses = tr.history.losses()
        assert all(math.isfinite(v) for v in losses[:NAN_STEP]) and math.isnan(losses[NAN_STEP]), losses
        out, err = capfd.readouterr()
        assert "[rank" not in out + err and "Traceback" not in out + err
    finally:
        tr.close()
    trains_normally(cluster)


def test_on_nonfinite_warn_trains_on_returns_the_nan_losses_and_says_so_once(cluster, capfd):
    capfd.readouterr()
    losses = [r["loss"] for r in run(cluster, data_fn=nan_at_step_3, fit={"steps": 6},
                                      optimization=Optimization(on_nonfinite="warn"))]
    assert len(losses) == 6
    assert all(math.isfinite(v) for v in losses[:NAN_STEP]) and all(math.isnan(v) for v in losses[NAN_STEP:])
    _, err = capfd.readouterr()
    assert err.count("\n") == 1 and re.match(
        rf"warning: step {NAN_STEP}: the loss is nan on rank 0 \(the first non-finite loss of this fit\); "
        r"on_nonfinite='warn' trained on to step 5 \(3 non-finite steps\): the weights are now non-finite on "
        r"ranks 0, 1$", err), err


def test_on_nonfinite_ignore_trains_on_silently(cluster, capfd):
    capfd.readouterr()
    losses = [r["loss"] for r in run(cluster, data_fn=nan_at_step_3, fit={"steps": 5}, on_nonfinite="ignore")]
    assert len(losses) == 5 and math.isnan(losses[-1])
    assert capfd.readouterr() == ("", "")


def test_the_nan_sample_is_where_the_tests_say():
    """The test data's NaN sample is the first of global batch NAN_STEP (rank 0's share under dp=2), not earlier."""
    dataset = nan_at_step_3()
    bad = [i for i in range(SAMPLES) if torch.isnan(dataset[i][0]).any()]
    assert bad == [int(data.batch_indices(SAMPLES, NAN_STEP, BATCH, 0)[0])]
    assert all(bad[0] not in data.batch_indices(SAMPLES, k, BATCH, 0).tolist() for k in range(NAN_STEP))


def nan_eval_data():
    import torch

    from nbdist import data

    x, y = data.regression(samples=16, inputs=8)
    x[:] = float("nan")
    return torch.utils.data.TensorDataset(x, y)


def test_a_nan_eval_loss_is_one_warning_line_and_the_fit_goes_on(cluster, capfd):
    """The training losses are finite (the weights too): the fit goes on, and says once where evaluation was not."""
    capfd.readouterr()
    records = run(cluster, eval_data_fn=nan_eval_data, eval_every=1, fit={"steps": 3})
    assert [math.isfinite(r["loss"]) for r in records] == [True] * 3
    assert all(math.isnan(r["eval_loss"]) for r in records)
    out, err = capfd.readouterr()
    assert out == "" and re.fullmatch(r"warning: step 0: the eval loss is nan \(3 of this fit's 3 evaluations not "
                                      r"finite\): eval_data_fn's data, or the model's output on it, is not finite\n",
                                      err), err
    run(cluster, eval_data_fn=nan_eval_data, eval_every=1, on_nonfinite="ignore")
    assert capfd.readouterr() == ("", "")


def raises_on_rank_1(output, target):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ZeroDivisionError("the last stage's loss")
    return output.sum()


def test_a_pipeline_rank_failing_shows_its_traceback_not_the_interrupted_ranks(cluster, capfd):
    """Rank 1 (the last stage) raises in the loss; rank 0, waiting on it, is interrupted by nbdist: the cell shows
    rank 1's traceback and one line naming both, not rank 0's KeyboardInterrupt."""
    capfd.readouterr()
    with pytest.raises(Exception, match=r"rank 1 raised ZeroDivisionError: the last stage's loss; nbdist "
                                        r"interrupted rank\(s\) 0") as raised:
        run(cluster, loss_fn=raises_on_rank_1, plan=PIPELINE)
    assert "\n" not in str(raised.value)
    _, err = capfd.readouterr()
    assert "[rank 1]" in err and "[rank 0]" not in err and "KeyboardInterrupt" not in err, err
    trains_normally(cluster)

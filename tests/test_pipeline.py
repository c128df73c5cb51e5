"""Pipeline parallelism on a real 4-engine cluster: every schedule equals the same model run whole in one process."""
import statistics
import time

import pytest
import torch
from torch import nn

import nbdist
from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel.pipedream import pipedream_reference
from nbdist.schedules import NAMES, build

LOSS = nn.functional.mse_loss
ATOL = 1e-5


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i in range(8):
        layers += [nn.Linear(12, 12), nn.Tanh()] if i < 7 else [nn.Linear(12, 3)]
    return nn.Sequential(*layers)


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(1)
    return torch.randn(16, 12), torch.randn(16, 3)


def serial(batch):
    model = build_model()
    loss = LOSS(model(batch[0]), batch[1])
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}


def assert_same_grads(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=ATOL, rtol=0)


SYNCHRONOUS = [name for name in NAMES if name != "pipedream"]


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_schedule_equals_serial(cluster4, batch, name):
    chunks = 2 if name.startswith("interleaved") else 1
    pipe = nbdist.pipeline(build_model, 4, name, microbatches=4, chunks=chunks, cluster=cluster4)
    loss = pipe.step(*batch, LOSS)
    expected_loss, expected_grads = serial(batch)
    assert loss == pytest.approx(expected_loss, abs=ATOL)
    assert_same_grads(pipe.grads(), expected_grads)
    pipe.close()


def test_module_split_unevenly_equals_serial(cluster4, batch):
    model = build_model()
    pipe = nbdist.pipeline(model, 3, "gpipe", microbatches=8, balance=[2, 9, 4], cluster=cluster4)
    loss = pipe.step(*batch, LOSS)
    expected_loss, expected_grads = serial(batch)
    assert pipe.balance == [2, 9, 4]
    assert loss == pytest.approx(expected_loss, abs=ATOL)
    assert_same_grads(pipe.grads(), expected_grads)
    torch.testing.assert_close(pipe.state_dict(), model.state_dict(), atol=0, rtol=0)


def test_pipedream_follows_weight_stashing_semantics(cluster4, batch):
    lr = 0.05
    pipe = nbdist.pipeline(build_model, 4, "pipedream", microbatches=8, lr=lr, cluster=cluster4)
    loss = pipe.step(*batch, LOSS)
    reference = pipedream_reference(build_model(), pipe.schedule, pipe.ranges, *batch, LOSS, lr)
    assert loss == pytest.approx(reference["loss"], abs=ATOL)
    assert_same_grads(pipe.grads(), reference["grads"])
    torch.testing.assert_close(pipe.state_dict(), reference["state_dict"], atol=ATOL, rtol=0)
    assert max(reference["versions"].values()) > 0  # later micro-batches really saw updated (newer) weights


def test_optimizer_steps_after_the_schedule(cluster4, batch):
    pipe = nbdist.pipeline(build_model, 2, "1f1b", microbatches=4, cluster=cluster4,
                           optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    pipe.step(*batch, LOSS)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    LOSS(model(batch[0]), batch[1]).backward()
    opt.step()
    torch.testing.assert_close(pipe.state_dict(), model.state_dict(), atol=ATOL, rtol=0)


def test_stepper_runs_tick_by_tick_to_the_same_result(cluster4, batch):
    pipe = nbdist.pipeline(build_model, 4, "1f1b", microbatches=4, cluster=cluster4)
    stepper = pipe.stepper(*batch, LOSS)
    state = stepper.next()
    assert state.tick == 1 and state.last_actions[0] == "0F0" and state.last_actions[3] is None
    state = stepper.next(3)
    assert state.tick == 4 and state.activations[0] == 2
    assert "rank 0 sends F1 → rank 1 receives it" in state.in_flight, state.in_flight  # words, not '0SEND_F1'
    assert not any("SEND" in message or "RECV" in message for message in state.in_flight)
    loss = stepper.run()
    assert stepper.done and stepper.state().in_flight == []
    expected_loss, expected_grads = serial(batch)
    assert loss == pytest.approx(expected_loss, abs=ATOL)
    assert_same_grads(pipe.grads(), expected_grads)
    with pytest.raises(DistUsageError, match="the step is complete"):
        stepper.next()


def test_measured_timeline_has_every_action(cluster4, batch):
    pipe = nbdist.pipeline(build_model, 4, "gpipe", microbatches=4, cluster=cluster4)
    pipe.step(*batch, LOSS)
    timeline = pipe.timeline
    assert timeline.makespan > 0 and 0 <= timeline.bubble_fraction < 1
    expected = build("gpipe", 4, 4).actions
    for rank in range(4):
        assert [str(span.action) for span in timeline.spans[rank]] == expected[rank]
    assert timeline.peak_activations == {0: 4, 1: 4, 2: 4, 3: 4}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stages=5), "stages=5 needs 5 ranks but the cluster has 4"),
        (dict(stages=2, chunks=2, schedule="interleaved-1f1b", model=nn.Sequential(nn.Linear(2, 2))), "fewer than"),
        (dict(stages=2, balance=[1, 1]), "sums to 2, but the model has 15 layers"),
        (dict(stages=2, schedule="zigzag"), "unknown schedule 'zigzag'"),
        (dict(stages=2, zero=1), r"zero=1 shards over data-parallel replicas, but this pipeline has none \(dp = 1\)"),
        (dict(stages=2, zero=4), "a pipeline takes zero=0, 1, 2 or 3"),
    ],
)
def test_bad_pipelines_name_the_constraint(cluster4, kwargs, message):
    kwargs = {"model": build_model, "cluster": cluster4, "microbatches": 4, **kwargs}
    with pytest.raises(DistUsageError, match=message):
        nbdist.pipeline(**kwargs)


def test_batch_that_microbatches_do_not_divide(cluster4, batch):
    pipe = nbdist.pipeline(build_model, 2, "1f1b", microbatches=3, cluster=cluster4)
    with pytest.raises(DistUsageError, match="batch of 16 inputs does not split into 3 equal micro-batches"):
        pipe.step(*batch, LOSS)
    pipe2 = nbdist.pipeline(build_model, 2, "1f1b", microbatches=4, cluster=cluster4)
    assert pipe2.step(*batch, LOSS) == pytest.approx(serial(batch)[0], abs=ATOL)  # nothing left hanging


def test_a_rank_failing_mid_step_frees_the_others(cluster4, batch):
    """The last stage raises in its loss; the ranks waiting for its gradients are interrupted, not left stuck."""

    def broken_loss(output, target):
        raise ValueError("loss exploded")

    pipe = nbdist.pipeline(build_model, 4, "1f1b", microbatches=4, cluster=cluster4)
    with pytest.raises(nbdist.DistError, match=r"rank 3 raised ValueError: loss exploded.*interrupted rank\(s\)"):
        pipe.step(*batch, broken_loss, timeout=60)
    assert pipe.step(*batch, LOSS) == pytest.approx(serial(batch)[0], abs=ATOL)  # same pipeline, next step works


def build_wide_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_stepper_with_large_messages_never_hangs(cluster4, name):
    """128 KiB activations take MPI's rendezvous path: paused senders must keep their messages moving."""
    torch.manual_seed(2)
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    pipe = nbdist.pipeline(build_wide_model, 2, name, microbatches=8, cluster=cluster4)
    stepper = pipe.stepper(x, y, LOSS)
    while not stepper.done:
        stepper.next()
    model = build_wide_model()
    assert stepper.loss == pytest.approx(LOSS(model(x), y).item(), abs=ATOL)


def test_ideal_is_the_schedule_simulated_with_median_durations(cluster4, batch):
    pipe = nbdist.pipeline(build_model, 4, "1f1b", microbatches=4, cluster=cluster4)
    for _ in range(3):
        pipe.step(*batch, LOSS)
    ideal = pipe.ideal()
    assert ideal.unit == "s" and ideal.makespan > 0 and len(pipe.recent) == 3
    for stage in range(4):  # each stage's forward: the median of its measured forwards over the last steps
        measured = [s.busy for t in pipe.recent for s in t.spans[stage] if str(s.action).startswith(f"{stage}F")]
        assert len(measured) == 3 * 4
        ideal_forwards = [s.duration for s in ideal.spans[stage] if s.action.kind == "F"]
        assert ideal_forwards == pytest.approx([statistics.median(measured)] * 4, rel=1e-9)


def test_a_full_speed_step_is_one_call_with_nothing_cut(cluster4, batch):
    pipe = nbdist.pipeline(build_model, 2, "1f1b", microbatches=4, cluster=cluster4)
    pipe.step(*batch, LOSS)
    assert pipe.timeline.cuts == [] and pipe.timeline.name == "1f1b (measured)"


def test_stepping_with_pauses_measures_the_work_not_the_pauses(cluster4, batch):
    """Three Steps with a pause after each, then Run: the raw clock spans the pauses, the work timeline does not."""
    pause = 1.0
    pipe = nbdist.pipeline(build_model, 2, "1f1b", microbatches=4, cluster=cluster4)
    stepper = pipe.stepper(*batch, LOSS)
    for _ in range(3):
        stepper.next()
        time.sleep(pause)
    stepper.run()
    raw = [s for row in stepper.spans().values() for s in row]
    assert max(s[2] for s in raw) - min(s[1] for s in raw) > 3 * pause  # as timed on the ranks
    work = pipe.timeline
    assert work.name == "1f1b (measured work, pauses between calls removed)"
    assert len(work.cuts) == 3 and work.paused > 3 * pause
    assert work.makespan < 0.2 * pause  # a step of this model is milliseconds of work
    for rank in (0, 1):
        assert [str(s.action) for s in work.spans[rank]] == pipe.schedule.actions[rank]
        starts = [s.start for s in work.spans[rank]]
        assert starts == sorted(starts)
    assert stepper.loss == pytest.approx(serial(batch)[0], abs=ATOL)


def test_tick_timeline_puts_every_action_at_its_tick(cluster4, batch):
    pipe = nbdist.pipeline(build_model, 2, "1f1b", microbatches=4, cluster=cluster4)
    stepper = pipe.stepper(*batch, LOSS)
    stepper.next(3)
    ticks = stepper.tick_timeline()
    assert ticks.unit == "tick" and ticks.end == 3
    for rank in (0, 1):
        done = [(str(a), t) for a, t in zip(pipe.schedule.actions[rank], pipe.ticks[rank]) if t < 3]
        assert [(str(s.action), s.start) for s in ticks.spans[rank]] == done
    stepper.run()

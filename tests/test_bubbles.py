"""Where a pipeline step's idle time comes from: the breakdown against the simulator (steps it made itself, where the
answer is known), then on real engines with stages whose times the test sets (each stage sleeps a fixed time per
micro-batch, so 2 cores are not contended and the stage times are what the test says)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nbdist
from nbdist.debugging.bubbles import HOST, IMBALANCE, LATE_PEER, SCHEDULE, STEPPING, TRANSFER, decompose
from nbdist.schedules import build
from nbdist.schedules.simulate import measured_durations

MS = 1e-3


def _measured(schedule, **durations):
    timeline = schedule.simulate(**durations)
    timeline.unit = "s"
    return timeline


def _idle(timeline) -> float:
    return timeline.ranks * timeline.makespan - sum(timeline.busy_time.values())


def test_equal_stages_idle_only_in_warm_up_and_cool_down():
    schedule = build("1f1b", 4, 8)
    breakdown = decompose(_measured(schedule, forward=MS, backward=2 * MS), schedule)
    assert breakdown.total() == pytest.approx(_idle(schedule.simulate(forward=MS, backward=2 * MS)))
    assert breakdown.total(SCHEDULE) == pytest.approx(breakdown.total())
    assert [breakdown.total(c) for c in (IMBALANCE, HOST, LATE_PEER)] == pytest.approx([0, 0, 0], abs=1e-12)
    assert breakdown.changes[0].what == "a zero-bubble schedule (zb-h1)"  # fewer bubbles, same work


def test_a_slow_stage_is_named_and_its_idle_is_imbalance():
    schedule = build("1f1b", 4, 8)
    balanced = _measured(schedule, forward=MS, backward=2 * MS)
    slow = _measured(schedule, forward=[MS, MS, 2 * MS, MS], backward=[2 * MS, 2 * MS, 4 * MS, 2 * MS])
    breakdown = decompose(slow, schedule)
    added = _idle(slow) - _idle(balanced)
    assert breakdown.total(IMBALANCE) > 0.5 * added
    assert breakdown.slowest_stage == (2, pytest.approx(1.6))
    assert breakdown.changes[0].what.startswith("balance the stages (stage 2 takes 1.60x")
    assert breakdown.changes[0].step < slow.makespan
    for rank, row in breakdown.idle.items():  # each rank's bar is its measured idle time
        assert sum(row.values()) == pytest.approx(slow.makespan - slow.busy_time[rank])


def test_message_latency_is_transfer():
    schedule = build("gpipe", 2, 4)
    breakdown = decompose(_measured(schedule, forward=MS, backward=2 * MS, comm=0.5 * MS), schedule)
    assert breakdown.total(TRANSFER) > 0
    assert breakdown.total(TRANSFER) + breakdown.total(SCHEDULE) == pytest.approx(breakdown.total())


def test_the_figure_stacks_every_cause_per_rank():
    schedule = build("1f1b", 2, 4)
    fig = decompose(_measured(schedule, forward=[MS, 2 * MS], backward=[2 * MS, 4 * MS]), schedule).figure()
    assert [trace.name for trace in fig.data] == [SCHEDULE, IMBALANCE, TRANSFER, LATE_PEER, HOST, STEPPING]
    assert fig.layout.barmode == "stack" and list(fig.data[0].y) == ["rank 0", "rank 1"]


# -- on real engines -------------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """Forward sleeps `seconds`, backward twice as long: a stage whose time the test sets."""

    @staticmethod
    def forward(ctx, x, seconds):
        import time

        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(2 * ctx.seconds)
        return grad, None


class Sleepy(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self.seconds)


def _two_stages(first: float, second: float):
    def build_model():
        torch.manual_seed(0)
        return nn.Sequential(Sleepy(first), Sleepy(second))

    return build_model


def _step(cluster, first: float, second: float):
    pipe = nbdist.pipeline(_two_stages(first, second), 2, "1f1b", microbatches=8, cluster=cluster)
    batch = torch.randn(32, 8), torch.randn(32, 8)
    for _ in range(2):  # the second step is warm
        pipe.step(*batch, nn.functional.mse_loss)
    return pipe


def test_on_engines_equal_stages_are_warm_up_and_a_slow_stage_is_imbalance(cluster):
    balanced = _step(cluster, 4 * MS, 4 * MS)
    even = balanced.bubbles()
    # the simulator's figure: the schedule played with the step's measured per-action times (messages free)
    times = dict(measured_durations(balanced.timeline, 2, 1), comm=0.0)
    simulated = _idle(balanced.schedule.simulate(**times))
    assert abs(even.total(SCHEDULE) - simulated) <= 0.10 * simulated, (even, simulated)
    assert even.total(SCHEDULE) >= 0.6 * even.total(), even  # and it is most of the idle time
    slow = _step(cluster, 4 * MS, 8 * MS)
    uneven = slow.bubbles()
    added = _idle(slow.timeline) - _idle(balanced.timeline)
    assert added > 0
    assert uneven.total(IMBALANCE) > 0.5 * added, (uneven, added)
    assert uneven.slowest_stage[0] == 1 and uneven.slowest_stage[1] == pytest.approx(4 / 3, rel=0.1)
    assert uneven.changes[0].what.startswith("balance the stages (stage 1")


# -- stepping's own cost, and the trace ----------------------------------------------------------------------------


def test_a_stepped_steps_gaps_at_its_calls_are_stepping_and_the_trace_names_every_idle_stretch(cluster, tmp_path):
    import json

    from nbdist.debugging.bubbles import stepping_cost

    pipe = _step(cluster, 2 * MS, 2 * MS)
    full = pipe.timeline
    assert stepping_cost(full) == 0 and pipe.bubbles().total(STEPPING) == 0  # one call: nothing to cut
    stepper = pipe.stepper(torch.randn(32, 8), torch.randn(32, 8), nn.functional.mse_loss)
    while not stepper.done:
        stepper.next()
    stepped = pipe.timeline
    assert stepped.cuts and stepping_cost(stepped) > 0
    breakdown = pipe.bubbles()
    assert breakdown.total(STEPPING) == pytest.approx(stepping_cost(stepped))
    assert "stepping itself causes" in breakdown.sentence()

    path = pipe.export_trace(tmp_path / "steps.json", steps=2, ranks=[1])
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {"rank 1", "steps: idle by cause"}
    slices = [e for e in events if e["ph"] == "X"]
    steps = [e for e in slices if e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == [0, 1] and "idle_ms: warm-up / cool-down" in steps[0]["args"]
    actions = [e for e in slices if e["cat"] == "compute" and e["args"]["step"] == 1]
    assert sorted(e["name"] for e in actions) == sorted(str(s.action) for s in stepped.spans[1] if s.action.is_compute)
    causes = {e["args"]["cause"] for e in slices if e["cat"] == "idle"}
    assert "stepping (tick by tick)" in causes and causes <= {
        "stepping (tick by tick)", "host overhead", "waiting for a message", "end of step"}
    assert all(e["dur"] >= 0 for e in slices)
    starts = [e["ts"] for e in actions]
    assert min(starts) >= steps[1]["ts"]  # the second step follows the first on the one axis


def test_export_trace_refuses_what_it_cannot_choose(cluster):
    from nbdist.errors import DistUsageError

    pipe = nbdist.pipeline(_two_stages(MS, MS), 2, "1f1b", microbatches=4, cluster=cluster)
    with pytest.raises(DistUsageError, match="no measured step to export"):
        pipe.export_trace("x.json")
    pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.functional.mse_loss)
    with pytest.raises(DistUsageError, match=r"ranks \[5\] are not ranks of this pipeline"):
        pipe.export_trace("x.json", ranks=[5])
    with pytest.raises(DistUsageError, match="chooses none of the 1 kept steps"):
        pipe.export_trace("x.json", steps=slice(3, 4))


# -- a Trainer's pipeline steps ------------------------------------------------------------------------------------


def _sleepy_data():
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g))


def _mse(out, y):
    import torch

    return torch.nn.functional.mse_loss(out, y)


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.01)


def test_a_trainers_pipeline_steps_are_explained_in_its_dashboard_and_after(cluster):
    """Stage 1 twice as slow as stage 0: the Trainer's newest step names it, live in the dashboard and from
    Trainer.bubbles() after the fit, and every idle second of the step has a cause."""
    tr = nbdist.Trainer(_two_stages(4 * MS, 8 * MS), _sleepy_data, _mse, _sgd, batch_size=32,
                        plan={"pp": 2, "microbatches": 8}, live="always", cluster=cluster)
    try:
        run = tr.fit(steps=3, wait=False)
        run.wait(120)
        assert tr.pipeline_steps.newest() == 2
        breakdown = tr.bubbles()
        assert breakdown.total() == pytest.approx(_idle(tr.pipeline_steps.timeline()), rel=1e-9)
        assert breakdown.slowest_stage[0] == 1 and breakdown.slowest_stage[1] == pytest.approx(4 / 3, rel=0.1)
        assert breakdown.total(IMBALANCE) > breakdown.total(HOST), breakdown
        with pytest.raises(nbdist.DistUsageError, match=r"^step 99 is not kept by every rank \(steps kept: \[.*2\]\)$"):
            tr.bubbles(step=99)
        view = run.view
        assert view.bubbles_shown == 2  # the dashboard drew the same step
        bars = view.bubble_plot.figure["data"]
        assert [t["name"] for t in bars][:2] == [SCHEDULE, IMBALANCE] and bars[0]["y"] == ["rank 0", "rank 1"]
        assert "training step 2" in view.bubble_plot.figure["layout"]["title"]["text"]
        assert view.static_html().count("Plotly.newPlot") == 2  # the export keeps both figures
        # and a live JupyterLab hides that copy (the widget carries the rule): no blank block under the dashboard
        assert view.static_html().startswith('<div class="nbdist-static-copy">')
        assert view.label.value.startswith("<style>.jp-LabShell .nbdist-static-copy")
    finally:
        tr.close()


def test_bubbles_of_a_trainer_without_a_pipeline_is_one_line(cluster):
    tr = nbdist.Trainer(_two_stages(0.0, 0.0), _sleepy_data, _mse, _sgd, batch_size=32, live=False, cluster=cluster)
    try:
        with pytest.raises(nbdist.DistUsageError, match=r"^bubbles\(\) explains pipeline steps: .* \(pp = 1\)$"):
            tr.bubbles()
    finally:
        tr.close()

"""Pipeline schedules as data: generators, checks, the simulator's closed forms, torch's orders, the figure.

Pure Python: no cluster, no torch (except the comparison with torch's own schedule orders).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nbdist import schedules
from nbdist.errors import DistUsageError
from nbdist.schedules import NAMES, Action, Schedule, Timeline, build, simulate
from nbdist.schedules.simulate import check, measured_durations, ready

SINGLE_CHUNK_CASES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (p, p + 1, 2 * p, 3 * p + 1)]
INTERLEAVED_CASES = [(p, m, v) for p in (1, 2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


def all_cases() -> list[tuple[str, int, int, int]]:
    single = [(name, p, m, 1) for name in NAMES if name != "interleaved-1f1b" for p, m in SINGLE_CHUNK_CASES]
    return single + [("interleaved-1f1b", p, m, v) for p, m, v in INTERLEAVED_CASES]


def idle_per_rank(timeline: Timeline) -> float:
    return timeline.makespan - sum(timeline.busy_time.values()) / timeline.ranks


# ---------------------------------------------------------------------------------------------------------------
# Generators produce complete, deadlock-free schedules that survive their text form
# ---------------------------------------------------------------------------------------------------------------


def test_package_exports_build_and_names():
    assert set(NAMES) == {"naive", "gpipe", "1f1b", "pipedream", "interleaved-1f1b", "zb-h1"}
    assert isinstance(schedules.build("1f1b", 2, 4), Schedule)
    assert schedules.simulate is simulate


@pytest.mark.parametrize("name,p,m,v", all_cases())
def test_every_generator_passes_check(name, p, m, v):
    schedule = build(name, p, m, v)
    check(schedule)
    computes = [a for r in range(p) for a in schedule.compute_actions(r)]
    per_pair = 3 if schedule.splits_backward else 2  # F + B, or F + I + W
    assert len(computes) == per_pair * m * p * v
    assert all(schedule.rank_of(a.stage) == r for r in range(p) for a in schedule.program[r])


@pytest.mark.parametrize("name,p,m,v", all_cases())
def test_text_form_round_trips(name, p, m, v):
    schedule = build(name, p, m, v)
    again = Schedule.from_actions(schedule.actions, name=name, chunks=v)
    assert again.program == schedule.program
    assert (again.ranks, again.microbatches, again.chunks) == (p, m, v)


def test_compute_only_lists_get_their_communication_added():
    bare = {r: [str(a) for a in build("1f1b", 3, 4).compute_actions(r)] for r in range(3)}
    assert Schedule.from_actions(bare).program == build("1f1b", 3, 4).program


def test_pipedream_runs_1f1b_order():
    assert build("pipedream", 4, 8).program == build("1f1b", 4, 8).program


# ---------------------------------------------------------------------------------------------------------------
# Impossible parameters and broken schedules are refused, naming why
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,words",
    [
        (("interleaved-1f1b", 4, 6, 2), "microbatches divisible by stages"),
        (("interleaved-1f1b", 4, 8, 1), "chunks >= 2"),
        (("interleaved-1f1b", 4, 2, 2), "microbatches >= stages"),
        (("1f1b", 4, 8, 2), "chunks must be 1"),
        (("zb-h1", 2, 4, 2), "chunks must be 1"),
        (("gpipe", 2, 4, 3), "chunks must be 1"),
        (("1f1b", 4, 3, 1), "microbatches >= stages"),
        (("pipedream", 4, 3, 1), "microbatches >= stages"),
        (("zb-h1", 4, 3, 1), "microbatches >= stages"),
        (("zero-bubble-v", 4, 8, 1), "unknown schedule"),
        (("gpipe", 0, 8, 1), "stages must be at least 1, got 0"),
        (("gpipe", 2, 2.5, 1), "microbatches must be a whole number, got 2.5"),
    ],
)
def test_impossible_parameters_are_refused(args, words):
    with pytest.raises(DistUsageError, match=words):
        build(*args)


@pytest.mark.parametrize("name", ["naive", "gpipe"])
def test_fewer_microbatches_than_stages_is_fine_without_interleaving(name):
    timeline = build(name, 4, 2).simulate()
    assert timeline.makespan > 0


def test_deadlock_names_rank_tick_and_action():
    # rank 1 runs its backward before the forward it needs, so rank 0 waits forever for the gradient
    with pytest.raises(DistUsageError, match=r"deadlocks: rank 0 .* at tick 2 on 0RECV_B0"):
        Schedule.from_actions({0: ["0F0", "0B0"], 1: ["1B0", "1F0"]})


def test_incomplete_schedule_is_refused():
    with pytest.raises(DistUsageError, match="needs one backward"):
        Schedule.from_actions({0: ["0F0", "0F1", "0B0"], 1: ["1F0", "1B0", "1F1", "1B1"]})


def test_ready_reads_a_set_or_a_dict_of_finish_times():
    needs_gradient = Action(0, "B", 0)
    done = {Action(0, "F", 0): 1.0}
    assert not ready(needs_gradient, done, last_stage=1)
    done[Action(0, "RECV_B", 0)] = 3.0
    assert ready(needs_gradient, done, last_stage=1) and ready(needs_gradient, set(done), last_stage=1)


# ---------------------------------------------------------------------------------------------------------------
# Closed forms (balanced stages, zero communication)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (4, 13), (6, 24), (8, 8)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream"])
def test_gpipe_and_1f1b_bubble(name, p, m):
    timeline = build(name, p, m).simulate(forward=1.0, backward=2.0)
    assert timeline.makespan == pytest.approx((m + p - 1) * 3.0)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (4, 4), (4, 9), (5, 3)])
def test_naive_bubble(p, m):
    timeline = build("naive", p, m).simulate()
    assert timeline.bubble_fraction == pytest.approx((p - 1) / p)


@pytest.mark.parametrize("p,m,v", [(p, m, v) for p in (2, 3, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)])
def test_interleaved_bubble_shrinks_by_chunks(p, m, v):
    timeline = build("interleaved-1f1b", p, m, v).simulate(forward=1.0, backward=2.0)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("forward,backward", [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0)])
@pytest.mark.parametrize("p,m,v", [(2, 4, 3), (4, 8, 2), (4, 4, 4), (8, 16, 2)])
def test_interleaved_idle_is_1f1b_idle_over_chunks(forward, backward, p, m, v):
    timeline = build("interleaved-1f1b", p, m, v).simulate(forward=forward, backward=backward)
    assert timeline.makespan == pytest.approx(m * (forward + backward) + (p - 1) * (forward + backward) / v)


@pytest.mark.parametrize("p,m", [(2, 2), (3, 7), (4, 4), (4, 8), (6, 13)])
@pytest.mark.parametrize("forward,inputs,weight", [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (3.0, 2.0, 1.0), (1.0, 2.0, 0.5)])
def test_zb_h1_idle(p, m, forward, inputs, weight):
    """Exact while W <= min(F, I): each rank idles (p-1)(F+I-W), where 1F1B idles (p-1)(F+I+W)."""
    timeline = build("zb-h1", p, m).simulate(forward=forward, backward=inputs, weight=weight)
    assert timeline.makespan == pytest.approx(m * (forward + inputs + weight) + (p - 1) * (forward + inputs - weight))
    assert idle_per_rank(timeline) == pytest.approx((p - 1) * (forward + inputs - weight))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b_when_f_i_w_are_equal(p, m):
    zero_bubble = build("zb-h1", p, m).simulate(forward=1.0, backward=1.0, weight=1.0)
    one_f_one_b = build("1f1b", p, m).simulate(forward=1.0, backward=1.0, weight=1.0)
    assert idle_per_rank(zero_bubble) == pytest.approx(idle_per_rank(one_f_one_b) / 3)
    assert zero_bubble.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))


# ---------------------------------------------------------------------------------------------------------------
# Activation memory
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 9), (6, 12)])
def test_peak_activations(p, m):
    assert build("1f1b", p, m).simulate().peak_activations == {r: p - r for r in range(p)}
    assert build("gpipe", p, m).simulate().peak_activations == {r: m for r in range(p)}
    assert build("naive", p, m).simulate().peak_activations == {r: 1 for r in range(p)}
    # zb-h1 defers r weight gradients on rank r: every rank peaks at p, 1F1B's worst rank
    assert build("zb-h1", p, m).simulate().peak_activations == {r: p for r in range(p)}


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3)])
def test_interleaved_peak_activations_in_chunks(p, m, v):
    expected = {r: min((v - 1) * p + 2 * (p - 1 - r) + 1, m * v) for r in range(p)}
    assert build("interleaved-1f1b", p, m, v).simulate().peak_activations == expected


# ---------------------------------------------------------------------------------------------------------------
# Duration convention and communication
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                    ("interleaved-1f1b", 4)])
def test_every_schedule_does_the_same_work(name, v):
    timeline = build(name, 4, 8, v).simulate(forward=1.0, backward=2.0, weight=0.5)
    assert timeline.busy_time == pytest.approx({r: 8 * 3.5 for r in range(4)})


def test_weight_splits_only_schedules_that_split():
    spans = {str(s.action): s.duration for s in build("zb-h1", 2, 2).simulate(backward=2.0, weight=0.5).spans[0]}
    assert (spans["0I0"], spans["0W0"]) == (2.0, 0.5)
    spans = {str(s.action): s.duration for s in build("zb-h1", 2, 2).simulate(backward=2.0).spans[0]}
    assert (spans["0I0"], spans["0W0"]) == (1.0, 1.0)
    spans = {str(s.action): s.duration for s in build("1f1b", 2, 2).simulate(backward=2.0, weight=0.5).spans[0]}
    assert spans["0B0"] == 2.5


def test_receive_shows_how_long_it_waited():
    timeline = build("gpipe", 2, 2).simulate(forward=1.0, backward=2.0, comm=0.5)
    first = timeline.spans[1][0]
    assert str(first.action) == "1RECV_F0"
    assert (first.start, first.end, first.wait) == (0.0, 1.5, 1.5)
    assert timeline.wait_time[1] > 0
    assert timeline.makespan == pytest.approx(build("gpipe", 2, 2).simulate().makespan + 2 * 0.5)


def test_busy_fraction_per_rank():
    timeline = build("naive", 2, 3).simulate()
    assert timeline.busy_fraction == pytest.approx({0: 0.5, 1: 0.5})


# ---------------------------------------------------------------------------------------------------------------
# Measured timelines
# ---------------------------------------------------------------------------------------------------------------


def test_timeline_from_measured_spans():
    measured = {
        0: [("0F0", 10.0, 10.5, 0.0), ("0SEND_F0", 10.5, 10.5, 0.0), ("0RECV_B0", 10.5, 11.5, 1.0),
            ("0B0", 11.5, 12.5, 0.0)],
        1: [SimpleNamespace(action="1RECV_F0", start=10.0, end=10.5, wait=0.5), ("1F0", 10.5, 11.0),
            ("1B0", 11.0, 11.5), ("1SEND_B0", 11.5, 11.5)],
    }
    timeline = Timeline.from_spans(measured, unit="s", name="measured")
    assert timeline.spans[0][0].start == 0.0 and timeline.makespan == pytest.approx(2.5)
    assert timeline.busy_time == pytest.approx({0: 1.5, 1: 1.0})
    assert timeline.bubble_fraction == pytest.approx(1 - 2.5 / 5.0)
    assert timeline.peak_activations == {0: 1, 1: 1}
    assert timeline.wait_time == pytest.approx({0: 1.0, 1: 0.5})
    figure = timeline.figure()
    assert [trace.name for trace in figure.data] == ["forward F", "backward B", "waiting for a message", "idle"]
    assert "makespan 2500.0 ms" in figure.layout.title.text and figure.layout.xaxis.title.text == "time (ms)"
    idle = next(trace for trace in figure.data if trace.name == "idle")
    assert list(idle.hovertext) == ["rank 1 · idle 1000.0 ms: waiting for the other ranks to finish<br>"
                                    "starts at 1500.0 ms"]


# ---------------------------------------------------------------------------------------------------------------
# Same orders as torch.distributed.pipelining
# ---------------------------------------------------------------------------------------------------------------


def torch_order(schedule_class, p: int, m: int, v: int = 1) -> dict[int, list[str]]:
    """torch's own `pipeline_order` (compute actions), built from stand-in stages: no process group needed."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    stages = [
        SimpleNamespace(num_stages=p * v, stage_index=c * p, group_size=p, group_rank=0, submod=None)
        for c in range(v)
    ]
    cls = getattr(torch_schedules, schedule_class)
    instance = cls(stages[0], m) if v == 1 and schedule_class in ("ScheduleGPipe", "Schedule1F1B") else cls(stages, m)
    compute = ("F", "B", "I", "W")
    return {
        rank: [str(a) for a in acts if a is not None and a.computation_type.value in compute]
        for rank, acts in instance.pipeline_order.items()
    }


def our_order(name: str, p: int, m: int, v: int = 1) -> dict[int, list[str]]:
    schedule = build(name, p, m, v)
    return {rank: [str(a) for a in schedule.compute_actions(rank)] for rank in range(p)}


@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 4), (4, 8), (5, 11)])
def test_gpipe_matches_torch(p, m):
    assert our_order("gpipe", p, m) == torch_order("ScheduleGPipe", p, m)


@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 4), (4, 8), (5, 11)])
def test_1f1b_matches_torch(p, m):
    """Equal on every rank but the last, where torch's pipeline_order (its drawing IR, not its runtime) numbers
    forwards from 1: it shows F1..Fm instead of F0..Fm-1. The runtime runs F0 first, like ours."""
    ours, theirs = our_order("1f1b", p, m), torch_order("Schedule1F1B", p, m)
    assert {r: ours[r] for r in range(p - 1)} == {r: theirs[r] for r in range(p - 1)}
    shifted = [str(Action(a.stage, a.kind, a.microbatch + (a.kind == "F"))) for a in map(Action.parse, ours[p - 1])]
    assert theirs[p - 1] in (ours[p - 1], shifted)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3)])
def test_interleaved_matches_torch(p, m, v):
    assert our_order("interleaved-1f1b", p, m, v) == torch_order("ScheduleInterleaved1F1B", p, m, v)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 3), (3, 6), (4, 4), (4, 8), (5, 10)])
def test_zb_h1_matches_torch_zero_bubble_with_one_chunk(p, m):
    """torch's class also wants m divisible by m // p (its rounds, for the interleaved case): m chosen to fit."""
    assert our_order("zb-h1", p, m) == torch_order("ScheduleInterleavedZeroBubble", p, m)


# ---------------------------------------------------------------------------------------------------------------
# Figure
# ---------------------------------------------------------------------------------------------------------------


def test_figure_has_one_bar_per_compute_and_per_wait():
    timeline = build("zb-h1", 4, 8).simulate(comm=0.25)
    figure = timeline.figure(highlight_time=3.0)
    bars = {trace.name: len(trace.x) for trace in figure.data}
    assert {"forward F", "input grad I", "weight grad W", "waiting for a message"} <= set(bars)
    assert bars["forward F"] == bars["input grad I"] == bars["weight grad W"] == 4 * 8
    waits = sum(1 for row in timeline.spans.values() for s in row if s.wait > 0)
    assert bars["waiting for a message"] == waits
    finished_early = sum(1 for row in timeline.spans.values() if row[-1].end < timeline.end)
    assert bars.get("idle", 0) == finished_early  # in a simulation a rank idles only in receives and at the end
    assert all(trace.orientation == "h" for trace in figure.data)
    assert figure.layout.yaxis.range == (3.5, -0.5) and figure.layout.yaxis.categoryarray[0] == "rank 0"
    assert len(figure.layout.shapes) == 1  # the highlight line


def test_figure_shows_microbatch_numbers_and_starts():
    figure = build("gpipe", 2, 3).figure()
    forward = next(trace for trace in figure.data if trace.name == "forward F")
    assert list(forward.text) == ["0", "1", "2", "0", "1", "2"]
    assert list(forward.base) == [0.0, 1.0, 2.0, 1.0, 2.0, 3.0]
    assert "bubble" in figure.layout.title.text


def test_titles_give_units():
    """(m + p - 1)(F + B) = 5 x 3 = 15 for 1F1B on 2 ranks with 4 micro-batches."""
    figure = build("1f1b", 2, 4).simulate(forward=1, backward=2).figure()
    assert "makespan 15 units" in figure.layout.title.text
    assert figure.layout.xaxis.title.text == "time (simulated units)"


def test_hover_says_what_each_bar_is_and_what_an_idle_rank_waits_for():
    """By hand: rank 1 gets micro-batch 0 at 1 + 0.5, runs F0, F1 and B0 by 5.5; rank 0, idle since 2, has that
    gradient at 6."""
    timeline = build("gpipe", 2, 2).simulate(forward=1.0, backward=2.0, comm=0.5)
    hovers = {trace.name: list(trace.hovertext) for trace in timeline.figure().data}
    assert hovers["forward F"][0] == "rank 0 · forward of micro-batch 0 on stage 0<br>1 unit, starts at 0 units (0F0)"
    assert hovers["waiting for a message"][0] == (
        "rank 0 · idle 4 units: waiting for the gradient of micro-batch 0 from rank 1 (1SEND_B0)<br>starts at 2 units")
    rank1 = [h for h in hovers["waiting for a message"] if h.startswith("rank 1")]
    assert rank1[0].startswith("rank 1 · idle 1.5 units: waiting for the activation of micro-batch 0 from rank 0 "
                               "(0SEND_F0)")


def test_cuts_are_marked_and_said():
    spans = {0: [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0)], 1: [("1F0", 0.5, 0.8), ("1F1", 1.2, 1.5)]}
    timeline = Timeline.from_spans(spans, cuts=[(1.0, 6.9)])
    figure = timeline.figure()
    assert timeline.paused == pytest.approx(6.9)
    assert figure.layout.title.subtitle.text == "pauses between clicks removed: 6.9 s (dotted lines)"
    assert [shape.x0 for shape in figure.layout.shapes] == [1000.0]  # in ms, as the axis
    idle = next(trace for trace in figure.data if trace.name == "idle")
    reasons = {base: hover.split(": ", 1)[1].split("<br>")[0] for base, hover in zip(idle.base, idle.hovertext)}
    assert reasons == {0.0: "before its next action, 1F0 (forward of micro-batch 0 on stage 1)",
                       800.0: "waiting for the other ranks to end the call (stepping stops every rank at a tick)",
                       1500.0: "waiting for the other ranks to finish"}


def test_empty_timeline_draws_no_bars_but_names_every_rank():
    timeline = Timeline.from_spans({0: [], 1: []}, name="measured")
    assert (timeline.makespan, timeline.bubble_fraction) == (0.0, 0.0)
    figure = timeline.figure()
    assert len(figure.data) == 0
    yaxis = figure.layout.yaxis
    assert yaxis.type == "category" and list(yaxis.categoryarray) == ["rank 0", "rank 1"]
    assert yaxis.range == (1.5, -0.5) and yaxis.autorange is False


# ---------------------------------------------------------------------------------------------------------------
# Measured durations for the ideal: medians, so one cold action does not stretch it
# ---------------------------------------------------------------------------------------------------------------


def _with_one_action_slower(timeline: Timeline, action: str, factor: float) -> Timeline:
    spans = {
        rank: [(s.action, s.start, s.start + (s.end - s.start) * (factor if str(s.action) == action else 1), s.wait)
               for s in row]
        for rank, row in timeline.spans.items()
    }
    return Timeline.from_spans(spans)


def test_one_cold_action_does_not_change_the_ideal():
    schedule = build("1f1b", 2, 4)
    measured = schedule.simulate(forward=[1.0, 1.3], backward=[2.0, 2.4], comm=0.1)
    cold = _with_one_action_slower(measured, "0B0", 100)
    assert max(s.busy for s in cold.spans[0]) == pytest.approx(200.0)
    warm, with_cold = measured_durations(measured, 2), measured_durations(cold, 2)
    assert with_cold["forward"] == pytest.approx(warm["forward"]) == [1.0, 1.3]
    assert with_cold["backward"] == pytest.approx(warm["backward"]) == [2.0, 2.4]
    assert schedule.simulate(**with_cold).makespan == pytest.approx(schedule.simulate(**warm).makespan, rel=1e-6)


def test_durations_are_medians_over_several_steps():
    """With 2 micro-batches one step's median is halfway to its outlier; three steps outvote it."""
    schedule = build("gpipe", 2, 2)
    warm = schedule.simulate(forward=1.0, backward=2.0)
    cold = _with_one_action_slower(warm, "1F0", 100)
    assert measured_durations(cold, 2)["forward"][1] == pytest.approx((100 + 1) / 2)
    assert measured_durations([cold, warm, warm], 2)["forward"] == pytest.approx([1.0, 1.0])


def test_per_stage_durations_make_the_slowest_stage_the_pace():
    """With one stage twice as slow, 1F1B's steady state runs at that stage's pace."""
    s = build("1f1b", 4, 8)
    even = s.simulate(forward=1, backward=2)
    uneven = s.simulate(forward=[1, 2, 1, 1], backward=[2, 4, 2, 2])
    assert uneven.makespan > even.makespan
    assert uneven.makespan >= 8 * (2 + 4)  # stage 1 alone needs m (F + B)
    with pytest.raises(DistUsageError, match="got 3 per-stage durations for 4 stages"):
        s.simulate(forward=[1, 1, 1])


def test_ranks_on_another_host_are_lined_up_by_the_call_barriers():
    """perf_counter is per host: a rank on another host whose clock reads 1000 s more is moved onto the first
    rank's clock by when each left the call's barrier; ranks on the first host stay as measured."""
    from nbdist.pipeline_parallel.stepping import work_timeline

    here = {"host": "a", "calls": [10.0], "spans": [("0F0", 10.0, 10.5, 0.0, 0), ("0SEND_F0", 10.5, 10.6, 0.0, 0)]}
    same = {"host": "a", "calls": [10.001], "spans": [("1RECV_F0", 10.001, 10.6, 0.59, 0), ("1F0", 10.6, 11.0, 0.0, 0)]}
    away = {"host": "b", "calls": [1010.002], "spans": [("2RECV_F0", 1010.002, 1011.0, 0.9, 0),
                                                       ("2F0", 1011.0, 1011.2, 0.0, 0)]}
    timeline = work_timeline({0: here, 1: same, 2: away})
    origin = 10.0  # the timeline starts at its first span
    away_forward = timeline.spans[2][1]
    assert (away_forward.start, away_forward.end) == pytest.approx((11.0 - 0.002 - origin, 11.2 - 0.002 - origin))
    assert timeline.spans[1][1].start == pytest.approx(10.6 - origin)


def test_a_stage_on_another_rank_needs_its_message():
    """Rank 1 computes 1F0 before receiving its input: the previous stage's forward was done, but on rank 0, so
    1F0 waits for 1RECV_F0, which comes after it, and rank 0 for a gradient never sent: a deadlock, refused."""
    actions = {0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0"], 1: ["1F0", "1RECV_F0", "1B0", "1SEND_B0"]}
    with pytest.raises(DistUsageError, match="deadlocks: rank 0 would wait forever at tick 2 on 0RECV_B0"):
        Schedule.from_actions(actions)

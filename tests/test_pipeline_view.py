"""What the stepper view shows: the work without the pauses, the tick axis, the numbers' DOM contract, figures that
draw offline with plotly.js embedded once, and a static copy that is an output of its own.

The timelines and the stats are pure data (checked against hand-made spans); plotly.js-once and the static copy are
checked in a real IPython kernel (with a real cluster for the view); the offline drawing in headless Chromium.
"""
from __future__ import annotations

import shutil
import textwrap
import time

import plotly.graph_objects as go
import pytest

from nbdist.pipeline_parallel.stepping import action_ticks, state_at, tick_timeline, work_timeline
from nbdist.schedules import build
from nbdist.schedules.simulate import Timeline
from nbdist.viz.display import figure_html
from nbdist.pipeline_parallel.view import stats_html

CHROMIUM = "/usr/bin/chromium"
PLOTLY_BUNDLE = "plotly.js v"  # the bundle's licence header: once per copy of plotly.js


# ---------------------------------------------------------------------------------------------------------------
# The work timeline: pauses between calls taken out, nothing else moved
# ---------------------------------------------------------------------------------------------------------------


def test_work_timeline_takes_out_the_pauses_between_calls():
    """Three calls 5 s apart on a clock that starts at 100 s. By hand: call 0's work ends at 100.003; call 1 starts
    (leaves its barrier) at 105.000, so 4.997 s are cut there; call 1's work ends 0.002 s after its start, at 100.005
    on the cut axis; call 2 starts at 110.000, cut 4.998 s."""
    reports = {
        0: {"calls": [100.0, 105.0, 110.0],
            "spans": [("0F0", 100.001, 100.003, 0.0, 0), ("0SEND_F0", 105.0, 105.0001, 0.0, 1),
                      ("0F1", 110.0005, 110.0015, 0.0, 2)]},
        1: {"calls": [100.0002, 105.0001, 110.0001],
            "spans": [("1RECV_F0", 105.0005, 105.002, 0.001, 1), ("1F0", 110.0, 110.004, 0.0, 2)]},
    }
    work = work_timeline(reports, name="stepped")
    assert [x for cut in work.cuts for x in cut] == pytest.approx([0.002, 4.997, 0.004, 4.998])
    assert work.paused == pytest.approx(9.995)
    assert [str(s.action) for s in work.spans[0]] == ["0F0", "0SEND_F0", "0F1"]
    assert [t for s in work.spans[0] for t in (s.start, s.end)] == pytest.approx([0, 0.002, 0.002, 0.0021, 0.0045,
                                                                                0.0055])
    assert [str(s.action) for s in work.spans[1]] == ["1RECV_F0", "1F0"]
    assert [t for s in work.spans[1] for t in (s.start, s.end)] == pytest.approx([0.0025, 0.004, 0.004, 0.008])
    assert work.makespan == pytest.approx(0.008)
    assert work.spans[1][0].wait == 0.001  # a wait inside a call stays


def test_one_call_is_not_cut():
    reports = {0: {"calls": [3.0], "spans": [("0F0", 3.1, 3.2, 0.0, 0)]}, 1: {"calls": [3.0], "spans": []}}
    work = work_timeline(reports)
    assert work.cuts == [] and work.makespan == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------------------------
# The tick axis
# ---------------------------------------------------------------------------------------------------------------


def test_tick_timeline_is_the_lockstep_ticks():
    schedule = build("1f1b", 2, 4)
    ticks = action_ticks(schedule)
    whole = tick_timeline(schedule, ticks)
    assert whole.unit == "tick" and whole.makespan == 1 + max(max(t) for t in ticks.values())
    for rank in (0, 1):
        assert [(str(s.action), s.start, s.end) for s in whole.spans[rank]] == [
            (a, t, t + 1) for a, t in zip(schedule.actions[rank], ticks[rank])]
    computes = sum(1 for row in whole.spans.values() for s in row if s.action.is_compute)
    assert whole.bubble_fraction == pytest.approx(1 - computes / (2 * whole.makespan))
    partial = tick_timeline(schedule, ticks, upto=3)
    assert all(s.start < 3 for row in partial.spans.values() for s in row) and partial.end == 3
    figure = partial.figure()
    assert figure.layout.xaxis.title.text == "tick" and "makespan 3 ticks" in figure.layout.title.text


# ---------------------------------------------------------------------------------------------------------------
# The stats line: a small DOM contract for browser tests
# ---------------------------------------------------------------------------------------------------------------


def test_stats_say_nothing_ran_before_anything_ran():
    schedule = build("1f1b", 2, 4)
    ideal = schedule.simulate()
    html = stats_html(Timeline({0: [], 1: []}), ideal, state_at(schedule, action_ticks(schedule), 0))
    assert '<span class="nbdist-bubble" data-bubble="">nothing has run yet</span>' in html
    assert '<span class="nbdist-ideal-bubble" data-bubble="0.2000">20.0 %</span>' in html  # (p-1)/(m+p-1) = 1/5
    assert '<span class="nbdist-tick" data-tick="0" data-total="20">0 of 20</span>' in html


def test_stats_state_the_measured_bubble_as_the_chart_does():
    schedule = build("1f1b", 2, 4)
    measured = Timeline.from_spans({0: [("0F0", 0.0, 1.0)], 1: [("1RECV_F0", 0.0, 1.0, 1.0), ("1F0", 1.0, 2.0)]})
    html = stats_html(measured, schedule.simulate(), state_at(schedule, action_ticks(schedule), 3))
    assert measured.bubble_fraction == pytest.approx(0.5)  # 2 of 4 rank-seconds computing
    assert '<span class="nbdist-bubble" data-bubble="0.5000">50.0 %</span>' in html
    assert 'data-tick="3" data-total="20"' in html


# ---------------------------------------------------------------------------------------------------------------
# plotly.js once per kernel, figures that draw offline
# ---------------------------------------------------------------------------------------------------------------


def run_cell(driver, code: str, timeout: float = 180) -> list[dict]:
    """Execute `code`; every iopub message of it (display_data, update_display_data, ...), in order."""
    msg_id = driver.client.execute(code)
    messages, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = driver.client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        messages.append(msg)
    raise TimeoutError(code)


def html_outputs(messages: list[dict], kind: str = "display_data") -> list[str]:
    return [m["content"]["data"]["text/html"] for m in messages
            if m["msg_type"] == kind and "text/html" in m["content"]["data"]]


@pytest.mark.slow
def test_plotly_js_is_embedded_once_per_kernel():
    from kernel_driver import KernelDriver

    driver = KernelDriver()
    try:
        run_cell(driver, "import plotly.graph_objects as go\nfrom nbdist.viz import show")
        pages = []
        for n in range(3):
            pages += html_outputs(run_cell(driver, f"show(go.Figure(go.Bar(y=[1, {n}])))\nshow(go.Figure())"))
    finally:
        driver.shutdown()
    assert len(pages) == 6 and all('class="nbdist-figure"' in page for page in pages)
    assert [page.count(PLOTLY_BUNDLE) for page in pages] == [1, 0, 0, 0, 0, 0]


def _offline_page(tmp_path, body: str) -> dict:
    """Open `body` in headless Chromium with every network request refused; what was drawn and what went wrong."""
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"needs Chromium at {CHROMIUM} (installed by .ci/run)")
    from playwright.sync_api import sync_playwright

    page_file = tmp_path / "page.html"
    page_file.write_text(f"<html><head><meta charset='utf-8'></head><body>{body}</body></html>")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context()
        refused = []
        context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                      else (refused.append(route.request.url), route.abort()))
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.goto(page_file.as_uri())
        page.wait_for_timeout(500)
        result = {"plots": page.locator(".nbdist-figure.js-plotly-plot").count(),
                  "bars": page.locator(".nbdist-figure .bars .point").count(),
                  "amd_used": page.evaluate("!!window.amdUsed"), "errors": errors, "refused": refused}
        browser.close()
    return result


def test_figures_draw_offline_with_one_embedded_plotly_even_under_require_js(tmp_path):
    """nbconvert's page loads require.js: a UMD bundle would register with its `define` and leave no window.Plotly."""
    amd = "<script>window.define = function () { window.amdUsed = true; }; window.define.amd = {};</script>"
    timeline = build("gpipe", 2, 2).simulate()
    figures = [timeline.figure(), go.Figure(go.Bar(y=[3, 1, 2])), Timeline({0: [], 1: []}).figure()]
    body = amd + "".join(figure_html(fig, loader=(n == 0)) for n, fig in enumerate(figures))
    assert body.count(PLOTLY_BUNDLE) == 1
    drawn = _offline_page(tmp_path, body)
    bars = sum(len(trace.x if trace.x is not None else trace.y) for fig in figures for trace in fig.data)
    assert drawn == {"plots": 3, "bars": bars, "amd_used": False, "errors": [], "refused": []}


# ---------------------------------------------------------------------------------------------------------------
# The view in a real kernel: the widget, then its static copy as an output of its own, updated by display_id
# ---------------------------------------------------------------------------------------------------------------

WIDGET = "application/vnd.jupyter.widget-view+json"
SETUP = textwrap.dedent("""
    import nbdist, torch
    from torch import nn
    cluster = nbdist.start(2)
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    pipe = nbdist.pipeline(build, 2, "1f1b", microbatches=4)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
""")


def test_view_static_copy_is_its_own_output_refreshed_when_a_step_completes():
    from kernel_driver import KernelDriver

    driver = KernelDriver()
    try:
        run_cell(driver, SETUP)
        shown = run_cell(driver, "st = pipe.stepper(x, y, nn.functional.mse_loss)\nst.widget()")
        stepped = run_cell(driver, "st.next()")
        finished = run_cell(driver, "st.run()")
        run_cell(driver, "cluster.stop()")
    finally:
        driver.shutdown()
    displays = [m["content"] for m in shown if m["msg_type"] == "display_data"]
    widget, *rest = displays
    assert WIDGET in widget["data"] and "text/html" not in widget["data"]
    static = rest[-1]
    assert 'class="nbdist-static-copy"' in static["data"]["text/html"]
    assert 'data-bubble=""' in static["data"]["text/html"] and 'data-tick="0"' in static["data"]["text/html"]
    assert rest[0]["data"]["text/html"].count(PLOTLY_BUNDLE) == 1  # this kernel's first figure HTML
    display_id = static["transient"]["display_id"]
    updates = [m["content"] for m in stepped + finished if m["msg_type"] == "update_display_data"]
    assert updates and all(u["transient"]["display_id"] == display_id for u in updates)
    first, last = updates[0]["data"]["text/html"], updates[-1]["data"]["text/html"]
    assert 'data-tick="1" data-total="20"' in first and 'data-tick="20" data-total="20"' in last
    assert 'class="nbdist-bubble" data-bubble="0.' in last and PLOTLY_BUNDLE not in last
    assert last.count('class="nbdist-figure"') == 2  # the measured chart and the ideal

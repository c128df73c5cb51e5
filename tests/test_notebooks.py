"""Every notebook is product: each runs headless (no frontend) from top to bottom without an error, no verdict it
prints contradicts its numbers, and its HTML export shows every figure offline.

Each notebook is executed once (nbclient): the labs whose verdicts read timings most (verdict_lines.UNDER_LOAD)
beside two busy processes, as on a shared classroom machine, the others as the machine is. The executed notebook is
then exported with nbconvert's HTMLExporter to out/exports/<name>.html (for a person to look at) and opened in
headless Chromium with every request that is not file:// aborted: a reader on a compute node, a train or a
locked-down lab has no CDN.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from browser import Browser, is_drawn, measure_plots, require_browser, wait_for
from verdict_lines import busy_cores, check_verdicts

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
EXPORTS = REPO / "out" / "exports"
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


NEEDS_HOSTS = {"41_many_hosts.ipynb"}  # run on two hosts the test makes (tests/hosts.py), named in the environment


@pytest.fixture(scope="module", params=NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def executed(request):
    """The notebook executed top to bottom, as nbclient (and `jupyter nbconvert --execute`) runs it."""
    import nbformat  # Jupyter's libraries where they are used: the fast tests collect this module without them
    from nbclient import NotebookClient

    path = request.param
    nb = nbformat.read(path, as_version=4)
    with _hosts_for(path), busy_cores(path.name) as spinners:
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        assert all(spinner.poll() is None for spinner in spinners), "a busy process ended before the lab did"
    return path, nb


@contextlib.contextmanager
def _hosts_for(path: Path):
    """For a notebook about several hosts: two namespace hosts with sshd, named to its kernel through
    NBDIST_LAB_HOSTS and NBDIST_LAB_MPI_ARGS (what a user sets to their own hosts)."""
    if path.name not in NEEDS_HOSTS:
        yield
        return
    from hosts import SshHosts, made_or_skip

    hosts = made_or_skip(lambda: SshHosts(2))
    os.environ["NBDIST_LAB_HOSTS"] = ",".join(h.address for h in hosts.hosts)
    os.environ["NBDIST_LAB_MPI_ARGS"] = " ".join(hosts.mpi_args)
    try:
        yield
    finally:
        os.environ.pop("NBDIST_LAB_HOSTS", None)
        os.environ.pop("NBDIST_LAB_MPI_ARGS", None)
        hosts.close()


@pytest.fixture(scope="module")
def offline_browser():
    require_browser()
    chromium = Browser()
    yield chromium
    chromium.close()


def test_notebook_runs_headless(executed, tmp_path):
    import nbformat

    path, nb = executed
    errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    nbformat.write(nb, tmp_path / path.name)


def test_no_printed_verdict_contradicts_its_numbers(executed):
    path, nb = executed
    check_verdicts(path.name, nb)


def test_there_is_a_quickstart():
    assert any(p.name == "00_quickstart.ipynb" for p in NOTEBOOKS)


# -- exports --------------------------------------------------------------------------------------------------------


def expected_figures(nb) -> int:
    """How many figures a reader of the notebook should see: one per plotly output, and every plotly figure a
    displayed widget holds (a pipeline view's charts: its static copy stands in for them where widgets do not
    render, as in an export read offline)."""
    widgets = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    count = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY in data:
                count += 1
            elif WIDGET_VIEW in data:
                count += _figures_in_widget(widgets, data[WIDGET_VIEW]["model_id"], set())
    return count


def _figures_in_widget(widgets: dict, model_id: str, seen: set) -> int:
    """Plotly figures in a widget and its children: a figure trait ({data, layout}), or an Output widget's
    plotly outputs."""
    if model_id in seen or model_id not in widgets:
        return 0
    seen.add(model_id)
    state = widgets[model_id].get("state", {})
    figure = state.get("figure")
    count = int(isinstance(figure, dict) and "data" in figure)
    count += sum(PLOTLY in o.get("data", {}) for o in state.get("outputs", []))
    for child in state.get("children", []):
        count += _figures_in_widget(widgets, str(child).removeprefix("IPY_MODEL_"), seen)
    return count


def export_html(path: Path, nb) -> Path:
    from nbconvert import HTMLExporter

    body, _resources = HTMLExporter(template_name="lab").from_notebook_node(nb)
    EXPORTS.mkdir(parents=True, exist_ok=True)
    target = EXPORTS / f"{path.stem}.html"
    target.write_text(body, encoding="utf-8")
    return target


def test_export_shows_every_figure_offline(executed, offline_browser):
    path, nb = executed
    html = export_html(path, nb)
    expected = expected_figures(nb)
    page = offline_browser.new_page(offline=True)
    try:
        page.goto(html.as_uri(), wait_until="load")
        plots = wait_for(lambda: _all_drawn(page, expected), 20) or measure_plots(page)
        drawn = [p for p in plots if is_drawn(p)]
        blocked = sorted({url.split("?")[0] for url in page.blocked})
        assert len(drawn) == len(plots) == expected, (
            f"{html}: {expected} figures in the notebook, {len(plots)} plotly graphs in the page, {len(drawn)} drawn; "
            f"requests blocked offline: {blocked}; page errors: {page.console_errors[:5]}")
    finally:
        page.context.close()


def _all_drawn(page, expected: int):
    plots = measure_plots(page)
    return plots if len(plots) >= expected and all(is_drawn(p) for p in plots) else None

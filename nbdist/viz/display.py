"""Showing a plotly figure so that it appears wherever the notebook is read, with or without a network.

JupyterLab renders plotly's own mimetype (interactive, with its own plotly.js); a notebook executed headless and
exported to HTML (nbconvert) knows only text/html. `show` sends both in one output, and each reader picks what it
can render. The HTML (`figure_html`) draws with plotly.js embedded in the notebook itself, ONCE: the first figure
HTML a kernel emits carries the whole bundle inline (`plotly_loader_html`), later ones use the global `Plotly` it
defines. A CDN would leave every figure a blank box offline (a compute node, a train, a locked-down lab); once per
figure would add ~5 MB per figure.

Two guards keep the HTML harmless where it is not needed. In a live JupyterLab / Notebook 7 page (which renders
the plotly mimetype, or a widget, instead), the loader and the figures do nothing. Where require.js is on the page
(nbconvert's templates load it), a UMD bundle would register as an AMD module and never set `window.Plotly`: the
loader runs the bundle with `define`, `exports` and `module` hidden.
"""
from __future__ import annotations

import json
import uuid

from IPython.display import display

LIVE_JUPYTER = ".jp-LabShell, .jp-NotebookShell"  # the page of a running JupyterLab / Notebook 7


class _Loader:
    """Whether this kernel has emitted plotly.js yet: from which notebook cell (when the front end says which)
    and in which execution of it."""

    emitted = False
    cell: str | None = None
    execution: str | None = None


def _current_execution() -> tuple[str | None, str | None]:
    """(cell id, request id) of the cell being executed. JupyterLab sends the cell id; nbclient does not."""
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        parent = (kernel.get_parent() if kernel is not None else None) or {}
        return parent.get("metadata", {}).get("cellId"), parent.get("header", {}).get("msg_id")
    except (AttributeError, TypeError):
        return None, None


def claim_loader() -> bool:
    """True when the caller must emit plotly.js now: nothing emitted it yet in this kernel, or the cell that did is
    running again (its old outputs, plotly.js with them, are being replaced). Records the claim."""
    cell, execution = _current_execution()
    rerun = cell is not None and cell == _Loader.cell and execution != _Loader.execution
    if _Loader.emitted and not rerun:
        return False
    _Loader.emitted, _Loader.cell, _Loader.execution = True, cell, execution
    return True


def plotly_loader_html() -> str:
    """A script that defines `window.Plotly` from the plotly.js bundle inline (no network), unless it exists."""
    from plotly.offline import get_plotlyjs

    return (
        '<script type="text/javascript">\n(function () {\n'
        f"  if (window.Plotly || document.querySelector({json.dumps(LIVE_JUPYTER)})) return;\n"
        "  (function (define, exports, module) {\n"
        + get_plotlyjs()
        + "\n  }).call(window);\n})();\n</script>\n"
    )


def figure_html(fig, loader: bool | None = None) -> str:
    """The figure as an HTML fragment that draws with the page's `Plotly`.

    loader: put plotly.js in front of it; None: only if this kernel has not emitted it yet (`claim_loader`).
    The figure waits for the page's load event when plotly.js is not there yet (a loader further down the page),
    and does nothing inside a live JupyterLab, which shows the figure its own way.
    """
    if loader is None:
        loader = claim_loader()
    if isinstance(fig, dict):  # a figure's JSON already (a live view's): no plotly objects built again
        figure, height = json.dumps(fig), fig.get("layout", {}).get("height")
    else:
        figure, height = fig.to_json(), fig.layout.height
    figure = figure.replace("</", "<\\/")  # no "</script>" inside the script
    div = f"nbdist-figure-{uuid.uuid4().hex}"
    style = f"width:100%;height:{int(height)}px" if height else "width:100%"
    script = (
        '<script type="text/javascript">\n(function () {\n'
        f"  var figure = {figure};\n"
        "  function draw() {\n"
        f'    var el = document.getElementById("{div}");\n'
        f"    if (!el || !window.Plotly || document.querySelector({json.dumps(LIVE_JUPYTER)})) return;\n"
        "    window.Plotly.newPlot(el, figure.data, figure.layout, {responsive: true, displaylogo: false});\n"
        "  }\n"
        '  if (window.Plotly) draw(); else window.addEventListener("load", draw);\n'
        "})();\n</script>\n"
    )
    body = f'<div id="{div}" class="nbdist-figure" style="{style}"></div>\n{script}'
    return (plotly_loader_html() if loader else "") + body


NARROW_PLOT_PX = 400  # the plot area of a figure in JupyterLab at 1000 px with the file browser open (~560 px
# for the output, less the margins): the width subplot titles are wrapped for
TITLE_CHAR_PX = 8.0  # an average character of a 16 px title
TITLE_LINE_PX = 20  # a line of a 16 px title
TITLE_CHARS = 60  # a figure's title in one line of a 560 px output (17 px characters, the margins' width)


def fitted(figure: dict) -> dict:
    """A figure's JSON that takes the width it is given: no fixed width (a 700 or 900 px figure in a 560 px output
    was cut, its last steps or ranks gone) and subplot titles wrapped to their subplot's width at the narrowest
    (titles of side-by-side subplots ran into each other)."""
    layout = {k: v for k, v in figure.get("layout", {}).items() if k != "width"}
    domains = [v["domain"] for k, v in layout.items() if k.startswith("xaxis") and "domain" in v]
    notes, added_lines = [], 0
    for note in layout.get("annotations", []):
        if _is_subplot_title(note) and "<br>" not in note["text"]:
            share = min((d[1] - d[0] for d in domains if d[0] - 1e-9 <= note["x"] <= d[1] + 1e-9), default=1.0)
            note = {**note, "text": wrap_title(note["text"], int(share * NARROW_PLOT_PX / TITLE_CHAR_PX))}
            added_lines = max(added_lines, note["text"].count("<br>"))
        notes.append(note)
    if notes:
        layout["annotations"] = notes
    title = layout.get("title")
    text = title.get("text") if isinstance(title, dict) else title
    if isinstance(text, str) and "<br>" not in text and len(text) > TITLE_CHARS:  # ran off a narrow figure's edge
        layout["title"] = {**(title if isinstance(title, dict) else {}), "text": wrap_title(text, TITLE_CHARS)}
    if added_lines:  # the wrapped titles grow upwards: room for them under the figure's title
        margin = layout.get("margin", {})
        layout["margin"] = {**margin, "t": margin.get("t", 100) + TITLE_LINE_PX * added_lines}
    return {**figure, "layout": {**layout, "autosize": True}}


def _is_subplot_title(note: dict) -> bool:
    return (note.get("xref") == "paper" and note.get("yref") == "paper" and note.get("yanchor") == "bottom"
            and note.get("showarrow") is False and isinstance(note.get("text"), str) and "x" in note)


def wrap_title(text: str, chars: int) -> str:
    """`text` in lines of at most `chars` characters, broken at spaces (a longer word keeps its own line)."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= max(chars, 1):
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def show(fig) -> None:
    """Display `fig` as plotly JSON (for JupyterLab) and as HTML (for exported notebooks, offline included), each
    fitted to the width it is shown in (`fitted`)."""
    figure = fitted(json.loads(fig.to_json()))
    bundle = {
        "application/vnd.plotly.v1+json": figure,
        "text/html": figure_html(figure),
        "text/plain": f"<plotly figure: {fig.layout.title.text or 'untitled'}>",
    }
    display(bundle, raw=True)

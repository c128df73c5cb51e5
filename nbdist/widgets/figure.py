"""A plotly figure as a light widget that redraws in place (Plotly.react), for views that update while you click.

Why not the alternatives. A plotly FigureWidget saves ~5 MB of plotly.js in every executed notebook's widget
state. Plotly's mimetype in an ipywidgets Output, replaced at each update, makes JupyterLab's plotly renderer
resize a plot div it has just detached ("Resize must be passed a displayed plot div element." in the console
after every click). Here the widget state holds only the figure's JSON; plotly.js comes from the page when it
has one (JupyterLab's plotly renderer, or an exported notebook's embedded copy) and otherwise from the kernel, once
per page, in a message that is not saved with the notebook. Every draw fits the plot to its container's width
(see the script's `fitted`): nothing is clipped, on the first draw or any later one.
"""
from __future__ import annotations

import json

import anywidget
import traitlets

_ESM = r"""
const KEY = "__nbdistPlotly";

// plotly.js as the kernel sends it: asked for by a view (below), or pushed unasked by a view first drawn while its
// cell runs (a fit's dashboard), which the busy kernel could answer only when the cell ended.
function install(message, buffers) {
  if (!message || message.type !== "plotly.js" || !buffers || !buffers.length) return;
  if (!window.Plotly) {
    const source = new TextDecoder().decode(buffers[0]);
    const script = document.createElement("script");
    // hide a page's AMD loader (require.js) so the bundle sets window.Plotly
    script.textContent = "(function (define, exports, module) {\n" + source + "\n}).call(window);";
    document.head.appendChild(script);
    script.remove();
  }
  if (window[KEY + "Loaded"]) window[KEY + "Loaded"](window.Plotly);
}

function loadPlotly(model) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!window[KEY]) {
    window[KEY] = new Promise((resolve, reject) => {
      const timer = setTimeout(() => { delete window[KEY]; reject(new Error("nbdist: no plotly.js from the kernel")); },
                               600000);
      window[KEY + "Loaded"] = Plotly => {
        clearTimeout(timer);
        delete window[KEY + "Loaded"];
        Plotly ? resolve(Plotly) : reject(new Error("nbdist: plotly.js did not load"));
      };
      model.send({ type: "plotly.js?" });
    });
  }
  return window[KEY];
}

// The plot fits its container at every draw: plotly sizes a plot from its div's width when it draws, and a div
// not yet laid out (a widget rendered before it is attached, or shown after display: none) measures 0, which made
// plotly fall back to 700 px and clip the figure until the window was resized. So a draw waits for a width, a
// figure asking for more width than there is gets the container's, and a ResizeObserver redraws when it changes.
function fitted(layout, width) {
  const wanted = layout.width;
  return { ...layout, autosize: true, width: wanted && wanted < width ? wanted : width };
}

export default {
  initialize({ model }) {
    model.on("msg:custom", install);  // before any view: a pushed bundle is not lost while the view loads
  },
  async render({ model, el }) {
    const plot = document.createElement("div");
    plot.className = "nbdist-plot";
    plot.style.width = "100%";
    el.appendChild(plot);
    const Plotly = await loadPlotly(model);
    let alive = true;
    let drawnWidth = 0;
    const draw = () => {
      if (!alive) return;
      const width = Math.floor(plot.getBoundingClientRect().width);
      if (width <= 0) return;  // not laid out yet: the observer draws when it is
      drawnWidth = width;
      const figure = model.get("figure") || {};
      Plotly.react(plot, figure.data || [], fitted(figure.layout || {}, width), { displaylogo: false });
    };
    const observer = new ResizeObserver(() => {
      if (Math.floor(plot.getBoundingClientRect().width) !== drawnWidth) draw();
    });
    observer.observe(plot);
    draw();
    model.on("change:figure", draw);
    return () => {
      alive = false;
      observer.disconnect();
      model.off("change:figure", draw);
      Plotly.purge(plot);
    };
  },
};
"""


class PlotlyFigure(anywidget.AnyWidget):
    """Shows `figure` (a plotly Figure, set with `.show(fig)`); every change redraws the same plot in place."""

    _esm = _ESM
    figure = traitlets.Dict().tag(sync=True)
    _pushed = False  # whether this kernel has pushed plotly.js to the page (push_plotly)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.on_msg(self._answer)

    def show(self, fig) -> None:
        """Draw `fig` (plotly's JSON encoder: numpy arrays and dates become plain JSON)."""
        self.figure = json.loads(fig.to_json())

    def push_plotly(self) -> None:
        """Send plotly.js to the page unasked, once per kernel. A view first shown while its cell runs (the first
        fit's dashboard in a fresh kernel) asks for it in a message the busy kernel reads only when the cell ends:
        until then the page had no plotly.js, and the dashboard drew only its progress bar."""
        if not PlotlyFigure._pushed:
            PlotlyFigure._pushed = True
            self._send_plotly()

    def _answer(self, _widget, content, _buffers) -> None:
        """The page has no plotly.js: send the bundle that plotly (the Python package) ships, once per page."""
        if isinstance(content, dict) and content.get("type") == "plotly.js?":
            self._send_plotly()

    def _send_plotly(self) -> None:
        from plotly.offline import get_plotlyjs

        self.send({"type": "plotly.js"}, buffers=[get_plotlyjs().encode()])

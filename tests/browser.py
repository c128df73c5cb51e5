"""A real browser for the tests: JupyterLab started from this venv, Debian's Chromium driven by playwright.

Notebooks run the way a person runs them: a click on a cell, Shift+Enter, wait for its execution count. Every page
records its console errors and uncaught exceptions, and screenshots go to out/browser/ for a person to look at.

The server runs in a temporary home for everything Jupyter and IPython write (settings, workspaces, runtime files,
IPYTHONDIR): other clusters running on the machine do not blur what a test finds there, and nothing is left in
the user's own directories. Playwright's own browser download does not work everywhere, so the system Chromium is
used (NBDIST_CHROMIUM to point elsewhere); a missing browser fails the tests unless NBDIST_SKIP_BROWSER=1 says to
skip them.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SCREENSHOTS = REPO / "out" / "browser"
CHROMIUM = os.environ.get("NBDIST_CHROMIUM", "/usr/bin/chromium")
BROWSER_NICENESS = 10  # see _lower_priority
SKIP_ENV = "NBDIST_SKIP_BROWSER"
PROMPT_NUMBER = re.compile(r"\[\s*(\d+)\s*\]")

# JupyterLab settings for a test: every cell in the DOM (no windowing), no news or update pop-ups over the cells.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}

# Measures every plotly graph under `root`: is it shown, its title, its traces, its bars with their pixel sizes,
# its drawn lines and markers, and its y-axis labels. Plotly binds each trace's data to its <g class="trace">.
MEASURE_PLOTS_JS = """
root => Array.from(root.querySelectorAll('.js-plotly-plot, .plotly-graph-div')).map(gd => {
  const nameOf = el => { const d = el.__data__; return (d && d[0] && d[0].trace && d[0].trace.name) || ''; };
  const box = el => { try { const b = el.getBBox(); return [b.width, b.height]; } catch (e) { return [0, 0]; } };
  const bars = [];
  gd.querySelectorAll('.barlayer g.trace').forEach(t => t.querySelectorAll('.point path').forEach(p => {
    const [w, h] = box(p); bars.push({trace: nameOf(t), w: w, h: h});
  }));
  const title = gd.layout && gd.layout.title;
  const rect = gd.getBoundingClientRect();
  return {
    shown: gd.offsetParent !== null && rect.width > 0 && rect.height > 0,
    in_widget: gd.closest('.jupyter-widgets') !== null,
    svg: gd.querySelectorAll('.main-svg').length,
    title: (title && (title.text !== undefined ? title.text : title)) ||
           ((gd.querySelector('.gtitle') || {}).textContent || ''),
    traces: gd.querySelectorAll('g.trace').length,
    heatmaps: gd.querySelectorAll('.heatmaplayer image').length,
    texts: gd.querySelectorAll('.scatterlayer .textpoint').length,
    bars: bars,
    lines: Array.from(gd.querySelectorAll('path.js-line')).filter(p => (p.getAttribute('d') || '').length > 2).length,
    markers: gd.querySelectorAll('.scatterlayer .point').length,
    yticks: Array.from(gd.querySelectorAll('.ytick text')).map(t => t.textContent),
    // the drawn figure inside the output it is shown in: a fixed-width figure was cut at 1000 px
    fits: (() => { const svg = gd.querySelector('.main-svg'), out = gd.closest('.jp-OutputArea-output') || gd;
                   return !svg || svg.getBoundingClientRect().right <= out.getBoundingClientRect().right + 1; })(),
  };
})
"""


def require_browser() -> None:
    """Fail with a clear message when Chromium or playwright is missing; skip (saying why) only when asked to."""
    missing = []
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"Chromium not found at {CHROMIUM} (apt-get install chromium, or set NBDIST_CHROMIUM)")
    try:
        import playwright.sync_api
    except ImportError:
        missing.append("Python playwright is not installed (pip install -e '.[test]')")
    try:
        import jupyterlab
    except ImportError:
        missing.append("JupyterLab is not installed (pip install -e '.[test]')")
    if not missing:
        return
    reason = "; ".join(missing)
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"browser tests skipped ({SKIP_ENV}=1): {reason}")
    pytest.fail(f"browser tests need a browser: {reason}. Set {SKIP_ENV}=1 to skip them explicitly.", pytrace=False)


def wait_for(check: Callable[[], object], timeout: float, interval: float = 0.25):
    """Poll `check` until it returns something truthy or `timeout` passes; return its last value either way."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the server -----------------------------------------------------------------------------------------------------


@dataclass
class LabServer:
    """`python -m jupyterlab` on a free port, serving `root`, with its log in `log_path`."""

    root: Path
    home: Path
    log_path: Path
    port: int = field(default_factory=_free_port)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    process: subprocess.Popen | None = None

    @property
    def ipython_dir(self) -> Path:
        return self.home / "ipython"

    @property
    def tmp_dir(self) -> Path:
        return self.home / "tmp"

    def start(self, timeout: float = 90) -> LabServer:
        self._write_settings()
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
            f"--LabApp.user_settings_dir={self.home / 'lab-settings'}",
            f"--LabApp.workspaces_dir={self.home / 'lab-workspaces'}",
        ]
        if os.geteuid() == 0:  # CI containers run as root
            command.append("--allow-root")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=self._environment(),
                                        cwd=self.root)
        if not wait_for(self._answers, timeout, interval=0.5):
            self.stop()
            raise RuntimeError(f"JupyterLab did not answer in {timeout} s; its log:\n{self.log_text()}")
        return self

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "IPYTHONDIR": str(self.ipython_dir),
            "JUPYTER_CONFIG_DIR": str(self.home / "jupyter-config"),
            "JUPYTER_DATA_DIR": str(self.home / "jupyter-data"),
            "JUPYTER_RUNTIME_DIR": str(self.home / "jupyter-runtime"),
            "TMPDIR": str(self.tmp_dir),  # where nbdist keeps its clusters' own profile directories
            "PYTHONUNBUFFERED": "1",
        })
        # The venv's own kernel first, as scripts/setup.sh does.
        venv_share = Path(sys.prefix) / "share" / "jupyter"
        env["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(venv_share), os.environ.get("JUPYTER_PATH")) if p)
        return env

    def _write_settings(self) -> None:
        for name, values in LAB_SETTINGS.items():
            path = self.home / "lab-settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {self.process.returncode}; its log:\n{self.log_text()}")
        try:
            self.api("GET", "/api/status")
            return True
        except OSError:
            return False

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def api(self, method: str, path: str):
        request = urllib.request.Request(self.url(path), method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def kernels(self) -> list[dict]:
        """The running kernels. Asked while a kernel starts, jupyter_server may answer 500 (a kernel without its
        last_activity yet): ask again."""
        for _attempt in range(20):
            try:
                return self.api("GET", "/api/kernels")
            except urllib.error.HTTPError as e:
                if e.code != 500:
                    raise
                time.sleep(0.25)
        return self.api("GET", "/api/kernels")

    def log_text(self, since: int = 0) -> str:
        if hasattr(self, "log"):
            self.log.flush()
        return self.log_path.read_text(errors="replace")[since:]

    def log_size(self) -> int:
        return len(self.log_text())

    def descendants(self) -> list[psutil.Process]:
        """The server's kernels and everything they started (engines, controller, mpiexec)."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def shutdown_kernels(self) -> None:
        for kernel in self.kernels():
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def stop(self) -> None:
        """Shut every kernel down, then the server; kill what is still there after a grace period."""
        if self.process is None:
            return
        left = self.descendants()
        try:
            self.shutdown_kernels()
        except OSError:
            pass
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        _gone, alive = psutil.wait_procs(left, timeout=20)
        for proc in alive:
            proc.kill()
        self.process = None
        self.log.close()

    # -- what a cluster leaves behind --------------------------------------------------------------------------

    def profile_files(self) -> set[str]:
        """The files clusters may leave: in the log/ and security/ folders of every IPython profile of the
        server's IPYTHONDIR, and in nbdist's own profile directories under the server's TMPDIR."""
        patterns = [(self.ipython_dir, f"profile_*/{folder}/**/*") for folder in ("log", "security")]
        patterns.append((self.tmp_dir, "nbdist-*/**/*"))
        return {str(path.relative_to(self.home)) for base, pattern in patterns for path in base.glob(pattern)
                if path.is_file()}

    def ask_for_clusters(self) -> None:
        """What JupyterLab's IPython clusters panel asks: the server then loads every cluster file it finds
        (and logs 'Controller for ... not running' for one whose processes are gone)."""
        try:
            self.api("GET", "/ipyparallel/clusters")
        except OSError:
            pass


# -- the browser ----------------------------------------------------------------------------------------------------


class Browser:
    """Headless Chromium; each page keeps its console errors and uncaught exceptions."""

    def __init__(self):
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        # --no-sandbox: CI runs as root; --disable-dev-shm-usage: containers often have a tiny /dev/shm.
        self.browser = self._playwright.chromium.launch(executable_path=CHROMIUM,
                                                        args=["--no-sandbox", "--disable-dev-shm-usage"])
        _lower_priority(BROWSER_NICENESS)

    def new_page(self, offline: bool = False, viewport=(1280, 1000)):
        """A page in a fresh context; offline: every request that is not file:// is aborted (and listed)."""
        context = self.browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        page = context.new_page()
        page.console_errors = []
        page.blocked = []
        page.on("console", lambda m: m.type == "error" and page.console_errors.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: page.console_errors.append(f"uncaught: {e}"))
        if offline:
            context.route("**/*", lambda route: _file_only(route, page.blocked))
        return page

    def close(self) -> None:
        self.browser.close()
        self._playwright.stop()


def _lower_priority(niceness: int) -> None:
    """Give the browser (and playwright's driver) a lower CPU priority than the kernel and its ranks.

    A person's machine has cores for the browser beside the ranks; CI has 2 cores for 2 busy ranks, the JupyterLab
    server, the kernel and Chromium. Chromium answers every click (the kernel's busy state, the plots) at the moment
    the ranks start the click's work, and on 2 cores that took a rank's core: the first action of a stepping call
    often ran several times slower (measured: forwards of 2 ms took 5-20 ms), which the stepped timeline rightly
    shows as bubble, but which is this machine's, not the schedule's. Processes forked later (a new page's renderer)
    inherit the niceness from the browser's zygote."""
    for process in psutil.Process().children(recursive=True):
        try:
            if re.search(r"chrom|node|playwright", process.name(), re.IGNORECASE):
                process.nice(niceness)
        except psutil.Error:
            pass  # gone already


def _file_only(route, blocked: list) -> None:
    if route.request.url.startswith("file:"):
        route.continue_()
    else:
        blocked.append(route.request.url)
        route.abort()


def measure_plots(locator) -> list[dict]:
    """MEASURE_PLOTS_JS on the element a playwright locator points at, or on a whole page's body."""
    element = locator.locator("body") if hasattr(locator, "goto") else locator
    return element.evaluate(MEASURE_PLOTS_JS)


def is_drawn(plot: dict) -> bool:
    """A plotly graph with its SVG and at least one trace drawn with data: not an empty box."""
    visible_bar = any(bar["w"] > 0 and bar["h"] > 0 for bar in plot["bars"])
    marks = plot["lines"] or plot["markers"] or plot["heatmaps"] or plot["texts"] or visible_bar
    return plot["svg"] > 0 and bool(marks)


def screenshot(target, name: str) -> Path:
    """A PNG of a page or of one element (a cell) in out/browser/<name>.png."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    target.screenshot(path=str(path))
    return path


# -- a notebook in JupyterLab ---------------------------------------------------------------------------------------


class LabNotebook:
    """A notebook open in JupyterLab: run cells as a person does and read what the page shows."""

    def __init__(self, server: LabServer, page, name: str):
        self.server, self.page, self.name = server, page, name
        page.goto(server.url(f"/lab/tree/{name}?token={server.token}&reset"))
        self.cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
        self.cells.first.wait_for(timeout=60_000)
        if not wait_for(self.idle, 120):
            raise TimeoutError(f"{name}: no idle kernel for it after 120 s")

    def kernel(self) -> dict | None:
        """This notebook's kernel, as the server sees it (its session's)."""
        sessions = [s for s in self.server.api("GET", "/api/sessions") if s.get("path") == self.name]
        if not sessions or not sessions[0].get("kernel"):
            return None
        kernel_id = sessions[0]["kernel"]["id"]
        return next((k for k in self.server.kernels() if k["id"] == kernel_id), None)

    def idle(self) -> bool:
        kernel = self.kernel()
        return kernel is not None and kernel["execution_state"] == "idle"

    def code_cells(self) -> list[int]:
        classes = self.cells.evaluate_all("cells => cells.map(c => c.className)")
        return [i for i, c in enumerate(classes) if "jp-CodeCell" in c]

    def prompt(self, index: int) -> str:
        return self.cells.nth(index).locator(".jp-InputPrompt").inner_text()

    def run_cell(self, index: int, timeout: float = 180) -> None:
        """Select the cell, press Shift+Enter, wait until it shows its execution count and the kernel is idle."""
        cell = self.cells.nth(index)
        cell.scroll_into_view_if_needed()
        before = self.prompt(index)
        cell.locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Shift+Enter")

        def done() -> bool:
            prompt = self.prompt(index)
            return prompt != before and bool(PROMPT_NUMBER.search(prompt)) and self.idle()

        if not wait_for(done, timeout):
            screenshot(self.page, f"timeout-{Path(self.name).stem}-cell{index}")
            raise TimeoutError(f"{self.name}: cell {index} did not finish in {timeout} s "
                               f"(prompt {self.prompt(index)!r})")

    def output(self, index: int):
        return self.cells.nth(index).locator(".jp-Cell-outputArea")

    def output_text(self, index: int) -> str:
        return self.output(index).inner_text()

    def save(self, timeout: float = 30) -> dict:
        """Save with Ctrl+S as a person does and return the notebook as JupyterLab wrote it (outputs included).

        Read from disk, not through the server: a contents request that arrives while the server writes the file
        makes it restore its backup over the file being saved."""
        path = self.server.root / self.name
        before = path.stat().st_mtime_ns
        self.cells.first.locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("Control+s")
        saved = wait_for(lambda: path.stat().st_mtime_ns != before and _read_json(path), timeout)
        if not saved:
            raise TimeoutError(f"{self.name} was not saved within {timeout} s")
        return saved


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError):
        return None


def error_outputs(notebook: dict) -> list[str]:
    """'cell N: Ename: evalue' for every error output of a notebook (nbformat JSON), except in cells tagged
    raises-exception (an error a lesson shows on purpose; nbclient's convention)."""
    return [f"cell {i}: {o['ename']}: {o['evalue']}" for i, cell in enumerate(notebook["cells"])
            if "raises-exception" not in cell.get("metadata", {}).get("tags", [])
            for o in cell.get("outputs", []) if o["output_type"] == "error"]

"""Shared fixtures, and the markers each test gets from what it needs.

Shared clusters: `cluster` (2 engines, started with nbdist.start(2), so it is also the current cluster) and
`cluster4` (4 engines) serve every test of the session that asks for them. Each is started on first use and
stopped at the end of the session. A test that needs other options (another backend, another engine count, a
cluster it kills or restarts) starts its own.
On 2 cores, at most one 4-engine cluster lives at a time: before a notebook or a browser test (notebooks start
clusters of up to 8 engines; browser timings want quiet cores), and where a test starts its own cluster of 4 or
more engines (it calls `shared_clusters.release(4)`), the shared 4-engine cluster is stopped. The next test that
uses `cluster4` starts it again: the same Cluster object, with fresh engines.

A test leaves a shared cluster as it found it: what it left in the ranks' registry (meshes, groups, communicators,
pipelines, plans...) is dropped after it (the terminal summary says which modules left what), and a shared cluster
left reserved by a background run, stopped, or with a dead engine fails the test.

Markers (registered in pyproject.toml), set by pytest_collection_modifyitems from what a test needs:
  cluster    starts real MPI engines: it uses `cluster` or `cluster4`, or its code, its fixtures' code or a function
             or string of the tests folder that they name calls nbdist.start(n) / nbdist.Cluster(...) or runs
             %dist_start (in a kernel); read from the source, see _CLUSTER
  browser    drives Chromium: tests/test_browser.py, and any test whose code opens a browser (_BROWSER)
  notebook   executes notebooks: tests/test_notebooks.py, and any test whose code runs one (nbclient, nbgrader's
             autograde, nbconvert --execute in a subprocess, or cell by cell in JupyterLab: _NOTEBOOK); the
             clusters a notebook starts are the notebook's, not `cluster`'s
  gpu        needs a GPU: marked `gpu` explicitly (tests/test_gpu*.py mark their CUDA cases; their CPU cases run
             everywhere, so the file name alone does not say gpu)
  multihost  the path of a kernel on another host: tests/test_lifeline_hosts.py (processes told that their kernel
             is elsewhere, all on this machine; no test needs a second real host)
  slow       starts none of the above but needs more than a second on 2 cores (a search over thousands of plans, a
             model trained to a bar, a subprocess that imports torch): marked explicitly; it runs with the whole suite,
             so that the inner loop stays under a minute
  fast       none of the above: `bash scripts/test.sh fast`. A test marked fast that starts MPI engines anyway
             fails, with its name, so the markers cannot silently go wrong (_EngineWatch).
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import io
import re
import sys
import textwrap
import threading
import tokenize
from collections import Counter, defaultdict
from pathlib import Path

import psutil
import pytest
from gpu_engines import KINDS, start_engine

import nbdist
from nbdist.cluster.options import ClusterOptions

TESTS = Path(__file__).resolve().parent
NEEDS = ("cluster", "browser", "notebook", "gpu", "multihost", "slow")  # what `fast` is the absence of
MODULE_NEEDS = {"test_browser.py": "browser", "test_notebooks.py": "notebook", "test_lifeline_hosts.py": "multihost",
                "test_hosts_ssh.py": "multihost", "test_hosts_slurm.py": "multihost"}
SHARED_FIXTURES = {"cluster": 2, "cluster4": 4}

# What the code a test runs says about it (matched on the source without decorators, strings included: code sent to
# a kernel counts). nbdist.start(timeout="5") is no start (refused before anything runs); nbdist.start(2) is.
_CLUSTER = re.compile(r"\bnbdist\.start\(\s*(?:\d|[nN]\b|\))|\bnbdist\.Cluster\(|\bCluster\(ClusterOptions\("
                      r"|%dist_start\b")
_BROWSER = re.compile(r"\bBrowser\(|\brequire_browser\(|\bsync_playwright\(")
_NOTEBOOK = re.compile(r"\bNotebookClient\(|\bExecutePreprocessor\(|\bLabNotebook\("
                       r"|\.autograde\(|['\"]--execute['\"]")  # nbgrader's autograde; nbconvert --execute, run apart


# -- shared clusters ---------------------------------------------------------------------------------------------------


class SharedClusters:
    """One cluster per engine count, shared by the tests that ask for it: started on first use, and again after a
    release; stopped at the end of the session."""

    def __init__(self) -> None:
        self.by_size: dict[int, nbdist.Cluster] = {}
        self.released: set[int] = set()

    def get(self, n: int) -> nbdist.Cluster:
        found = self.by_size.get(n)
        if found is None:
            found = self.by_size[n] = nbdist.start(2) if n == 2 else nbdist.Cluster(ClusterOptions(n=n)).start()
        elif not found.running:
            found.start()
        self.released.discard(n)
        return found

    def running(self) -> dict[int, nbdist.Cluster]:
        return {n: c for n, c in self.by_size.items() if c.running}

    def release(self, n: int) -> None:
        """Stop the shared n-engine cluster, if it runs, to make room; the next test that uses it starts it again."""
        found = self.by_size.get(n)
        if found is not None and found.running:
            found.stop()
            self.released.add(n)

    def stop(self, n: int) -> None:
        found = self.by_size.pop(n, None)
        if found is not None:
            found.stop()


SHARED = SharedClusters()


@pytest.fixture(scope="session")
def cluster():
    """The shared 2-engine cluster (controller + 2 MPI engines, torch.distributed over mpi4py, the CPU default),
    started with nbdist.start(2): also the current cluster."""
    yield SHARED.get(2)
    SHARED.stop(2)


@pytest.fixture(scope="session")
def cluster4():
    """The shared 4-engine cluster (nbdist.Cluster, not the current one)."""
    yield SHARED.get(4)
    SHARED.stop(4)


@pytest.fixture(scope="session")
def shared_clusters() -> SharedClusters:
    """For a test or fixture that starts its own big cluster: `shared_clusters.release(4)` first."""
    return SHARED


@pytest.fixture(scope="module")
def kernel():
    """A real IPython kernel (jupyter_client), shut down at the end of the module."""
    from kernel_driver import KernelDriver

    driver = KernelDriver()
    yield driver
    driver.shutdown()


# -- markers from what a test needs ------------------------------------------------------------------------------------

_scanning: set[int] = set()


def _source_file(obj) -> str | None:
    code = getattr(inspect.unwrap(obj), "__code__", None)
    if code is not None:
        return code.co_filename
    try:
        return inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None


@functools.cache
def _in_tests_folder(filename: str | None) -> bool:
    return filename is not None and Path(filename).resolve().parent == TESTS


def _of_tests_folder(obj) -> bool:
    return _in_tests_folder(_source_file(obj))


def _value_text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return "\n".join(_value_text(v) for v in value)
    if isinstance(value, dict):
        return "\n".join(_value_text(v) for v in value.values())
    if (inspect.isfunction(value) or inspect.isclass(value)) and _of_tests_folder(value):
        return _code_text(value)
    return ""


def _lines_without_comments(source: str) -> list[str]:
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    return lines


@functools.cache
def _file_code(filename: str) -> tuple[list[str], dict[int, ast.AST]]:
    """A test file's lines without their comments (what a test says of itself in a comment does not mark it), and
    its functions and classes by the line they start on (their first decorator's, as a function's code says)."""
    source = Path(filename).read_text()
    lines = _lines_without_comments(source)
    starts = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            starts[min([node.lineno] + [d.lineno for d in node.decorator_list])] = node
    return lines, starts


def _definition(obj) -> tuple[ast.AST, str] | None:
    """The syntax tree of `obj` and its text from the `def` or `class` line on (no decorators, no comments)."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        lines, starts = _file_code(code.co_filename)
        node = starts.get(code.co_firstlineno)
        if node is not None:
            return node, "\n".join(lines[node.lineno - 1:node.end_lineno])
    try:
        source = textwrap.dedent(inspect.getsource(obj))
        node = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node, "\n".join(_lines_without_comments(source)[node.lineno - 1:])


@functools.cache
def _code_text(obj) -> str:
    """The source of `obj` (a function or class of the tests folder) without its decorators, followed by the text
    of every function, class and string of the tests folder that it names (its module's globals, or what it imports
    from the tests folder itself), recursively."""
    obj = inspect.unwrap(obj)
    if id(obj) in _scanning:
        return ""
    _scanning.add(id(obj))
    try:
        found = _definition(obj)
        if found is None:
            return ""
        node, text = found
        names = vars(sys.modules[obj.__module__]) if obj.__module__ in sys.modules else {}
        parts = [text]
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in names:
                parts.append(_value_text(names[sub.id]))
            elif isinstance(sub, ast.ImportFrom) and sub.module and (TESTS / f"{sub.module}.py").exists():
                module = importlib.import_module(sub.module)
                parts += [_value_text(getattr(module, alias.name, None)) for alias in sub.names]
        return "\n".join(p for p in parts if p)
    finally:
        _scanning.discard(id(obj))


def _asked_by_name(text: str) -> set[str]:
    """Fixtures that code asks for at run time: request.getfixturevalue("name")."""
    asked = set()
    for call in re.finditer(r"getfixturevalue\(([^\n]*)", text):
        asked |= set(re.findall(r"""['"](\w+)['"]""", call.group(1)))
    return asked


@functools.cache
def _marked_by(text: str) -> frozenset[str]:
    return frozenset(name for name, pattern in (("cluster", _CLUSTER), ("browser", _BROWSER), ("notebook", _NOTEBOOK))
                     if pattern.search(text))


def _needs(item) -> tuple[set[str], set[int]]:
    """(markers from the code of the test and of its fixtures, sizes of the shared clusters it uses)."""
    manager = item.session._fixturemanager
    texts = [_code_text(item.function)]
    todo, seen = list(item.fixturenames) + sorted(_asked_by_name(texts[0])), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        definitions = item._fixtureinfo.name2fixturedefs.get(name) or manager.getfixturedefs(name, item) or ()
        for definition in definitions[-1:]:
            if _of_tests_folder(definition.func):
                text = _code_text(definition.func)
                texts.append(text)
                todo += [asked for asked in _asked_by_name(text) | set(definition.argnames) if asked not in seen]
    sizes = {SHARED_FIXTURES[name] for name in seen if name in SHARED_FIXTURES}
    needs = set().union(*(_marked_by(part) for part in texts))
    return needs | ({"cluster"} if sizes else set()), sizes


SHARED_USED = pytest.StashKey[set]()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not hasattr(item, "function"):
            continue
        needs, sizes = _needs(item)
        item.stash[SHARED_USED] = sizes
        if item.path.name in MODULE_NEEDS:
            needs.add(MODULE_NEEDS[item.path.name])
        for name in sorted(needs):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)
        if not any(item.get_closest_marker(name) for name in NEEDS):
            item.add_marker("fast")


# -- a fast test starts no engine; a test leaves the shared clusters as it found them ----------------------------------

_MPI_LAUNCHERS = {"mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy"}


class _EngineWatch:
    """Watches, while a fast test runs, for an MPI launcher started under this process (in it, in a kernel, in a
    notebook's kernel...): a fast test must start none."""

    def __init__(self) -> None:
        self.before = self._launchers()
        self.started: set[tuple[int, str]] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fast-test engine watch", daemon=True)
        self._thread.start()

    @staticmethod
    def _launchers() -> set[tuple[int, str]]:
        found = set()
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.name() in _MPI_LAUNCHERS:
                    found.add((proc.pid, " ".join(proc.cmdline()[:6])))
            except psutil.Error:
                pass
        return found

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            self.started |= self._launchers() - self.before

    def stop(self) -> set[tuple[int, str]]:
        self._done.set()
        self._thread.join()
        return self.started | (self._launchers() - self.before)


_WATCH = pytest.StashKey[_EngineWatch]()
_BEFORE = pytest.StashKey[dict]()
_LEFT: dict[str, Counter] = defaultdict(Counter)  # test module -> what its tests left on the shared clusters


def _registry_keys() -> list[tuple[str, str]]:
    """On a rank: what its registry holds, as (kind, name), its own start-up facts left out (the keys only: an
    entry's describe() is Cluster.holdings' to test, not the clean-up's)."""
    from nbdist.runtime.ranks import registry

    return sorted(key for key in registry._ENTRIES if key[0] != registry.RANK)


def _shared_state(found: nbdist.Cluster) -> dict:
    held = {(rank, kind, name) for rank, keys in enumerate(found.run(_registry_keys)) for kind, name in keys}
    return {"holdings": held, "meshes": set(found.meshes)}


def _state_before(found: nbdist.Cluster) -> dict | None:
    if found._reserved is not None or found._ended:
        return None  # an earlier test's fault, reported after it
    try:
        return _shared_state(found)
    except Exception:
        return None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("fast"):
        item.stash[_WATCH] = _EngineWatch()
    else:
        if item.get_closest_marker("notebook") or item.get_closest_marker("browser"):
            SHARED.release(4)
        for n in item.stash.get(SHARED_USED, set()) & SHARED.released:
            SHARED.get(n)  # released by an earlier test: the same Cluster object, fresh engines
        if item.get_closest_marker("cluster"):
            item.stash[_BEFORE] = {n: _state_before(c) for n, c in SHARED.running().items()}
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    watch = item.stash.get(_WATCH, None)
    try:
        result = yield
    finally:
        started = watch.stop() if watch is not None else set()
    if started:
        raise pytest.fail.Exception(
            f"{item.nodeid} is marked fast but started MPI engines ({min(started)[1]}): "
            "make what starts them visible to tests/conftest.py (_CLUSTER) or mark the test `cluster`", pytrace=False)
    _leave_shared_clusters_as_found(item, item.stash.get(_BEFORE, {}))
    return result


def _leave_shared_clusters_as_found(item, before: dict[int, dict | None]) -> None:
    """`before`: each shared cluster's state before the test (None: it could not be read, an earlier test's fault)."""
    problems = []
    if item.get_closest_marker("cluster"):  # a shared cluster started during the test was found empty
        before = {**{n: {"holdings": set(), "meshes": set()} for n in SHARED.running()}, **before}
    for n, state in before.items():
        found = SHARED.by_size.get(n)
        if found is None or state is None:
            continue
        if n in SHARED.released:
            continue  # stopped to make room for a bigger cluster (shared_clusters.release): nothing is left on it
        if found._reserved is not None:
            problems.append(f"the shared {n}-engine cluster is still reserved: {found._reserved[1]}")
            continue
        if not found.running or found._ended:
            problems.append(f"the test left the shared {n}-engine cluster {'stopped' if not found.running else 'ended'}"
                            "; restarted it")
            if found.running:
                found.restart()
            else:
                found.start()
            continue
        try:
            now = _shared_state(found)
        except Exception as e:
            problems.append(f"the shared {n}-engine cluster's registry could not be read ({e}); restarted it")
            found.restart()
            continue
        left = now["holdings"] - state["holdings"]
        for name in now["meshes"] - state["meshes"]:
            found.meshes.pop(name)
        if left:
            from nbdist.runtime.ranks import registry

            for kind, name in sorted({(kind, name) for _, kind, name in left}):
                found.run(registry.drop, kind, name)
            _LEFT[item.path.name].update(kind for _, kind, _ in left)
            now = _shared_state(found)
        if now["holdings"] != state["holdings"]:
            problems.append(f"the shared {n}-engine cluster's registry differs after the test and its clean-up: "
                            f"{sorted(now['holdings'] ^ state['holdings'])[:5]}")
    if problems:
        raise pytest.fail.Exception(f"{item.nodeid}: " + "; ".join(problems), pytrace=False)


def pytest_terminal_summary(terminalreporter):
    if _LEFT:
        terminalreporter.section("left on the shared clusters, dropped after each test")
        for module, kinds in sorted(_LEFT.items()):
            terminalreporter.write_line(f"{module}: " + ", ".join(f"{count} {kind}" for kind, count in
                                                                   sorted(kinds.items())) + " (entries × ranks)")


@pytest.fixture(scope="module", params=KINDS)
def engine(request):
    """One engine of each kind (a CUDA one, skipped where there is no GPU, and a CPU one) for each module of the GPU
    checks (tests/test_gpu*.py), stopped when the module ends."""
    started = start_engine(request.param)
    yield started
    started.cluster.stop()

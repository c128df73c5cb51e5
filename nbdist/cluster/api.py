"""The notebook-side face of the engines: start, run, execute, status, restart, stop.

Everything is addressed by MPI rank, never by ipyparallel engine id (ids change after restarts and need not match
ranks). `nbdist.current()` is the cluster the magics use: one per kernel, the one `nbdist.start()` started and
`nbdist.stop()` stops (starts from several threads at once are taken one at a time, and the later ones find it
running). A second cluster is made explicitly, `nbdist.Cluster(n=2).start()`, and is yours to stop.

Every argument is checked in the kernel before anything is sent: a bad one is one DistUsageError line.
"""
from __future__ import annotations

import atexit
import itertools
import os
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from nbdist.cluster.arguments import (
    chosen_ranks,
    needs_function,
    parse_rank_spec,  # noqa: F401 - nbdist.cluster.parse_rank_spec, its old home
    sendable_to_each,
    sent,
)
from nbdist.cluster.launching import launch, warm
from nbdist.cluster.launching.ranks import boot
from nbdist.cluster.meshes.mesh import Mesh, make_mesh
from nbdist.cluster.meshes.ranks import rank_mesh
from nbdist.cluster.options import ClusterOptions, run_timeout
from nbdist.cluster.status import Status
from nbdist.cluster.waiting.recovery import Recovery
from nbdist.cluster.waiting.remote import SHOW_MODES, OutputRelay, Waiter
from nbdist.errors import DistInterrupt, DistUsageError, show_errors_in_ipython
from nbdist.runtime.ranks import cells, registry

_current: "Cluster | None" = None
_starting = threading.RLock()  # nbdist.start() and nbdist.stop() one at a time: one current cluster per kernel
_running: "set[Cluster]" = set()  # every started cluster, so that exit stops them all
_generations = itertools.count(1)  # every start of any cluster gets its own number (see Cluster.generation)
WHY_SECONDS = 1.5  # how long Cluster.why waits for the ranks' reports


class Cluster:
    """An MPI world of ipyparallel engines with torch.distributed initialised on each.

    Use `nbdist.start()` for the notebook's cluster; `Cluster(n=4, backend="gloo").start()` (or
    `Cluster(ClusterOptions(...))`) makes another one, which is not `nbdist.current()`: stop it yourself, or use it
    as a context manager, which stops it on exit.
    """

    def __init__(self, options: ClusterOptions | None = None, **keywords: Any):
        if options is not None and not isinstance(options, ClusterOptions):
            raise DistUsageError(f"Cluster takes a ClusterOptions or keywords (Cluster(n=2, cpu=True)), got "
                                 f"{options!r}")
        if options is not None and keywords:
            raise DistUsageError("give Cluster a ClusterOptions or keywords, not both")
        self.options = (options or ClusterOptions.of(**keywords)).resolved()
        self._launched: launch.Launched | None = None
        self._engine_of_rank: list[int] = []
        self._info: list[dict] = []
        self.startup_seconds: float | None = None
        self.generation: int | None = None  # which start this is: objects made on older engines are stale
        self.meshes: dict[str, Mesh] = {}  # the meshes built on these engines, by name (Cluster.mesh)
        self._ended = False  # an engine died, which ended the MPI job: restart before use
        self._reserved: tuple | None = None  # (thread, what): a background run owns the engines until it ends
        self.last_why = None  # the last hang view (Cluster.why: asked, or made when a cell timed out)

    # -- life cycle -----------------------------------------------------------------------------------------------

    def start(self) -> "Cluster":
        show_errors_in_ipython()  # `import nbdist; nbdist.start()` in IPython shows errors as %load_ext does
        started = time.perf_counter()
        try:
            self._launched = launch.start(self.options, while_waiting=warm.loader(warm.LOADED_WHILE_STARTING))
            engines = self._launched.client[self._launched.engine_ids]
            infos = engines.apply_sync(boot.info)
            engines.apply_sync(cells.install)  # a cell that breaks sys.stdout must not break the next ones
        except BaseException as e:
            self.stop()
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, DistInterrupt):
                raise DistInterrupt("interrupted during start-up; nbdist stopped what it had started") from e
            raise
        infos = sorted(zip(infos, self._launched.engine_ids), key=lambda pair: pair[0]["rank"])
        self._info = [info for info, _ in infos]
        self._engine_of_rank = [engine_id for _, engine_id in infos]
        self.startup_seconds = time.perf_counter() - started
        self.generation = next(_generations)
        self.meshes = {}
        self._ended = False
        _running.add(self)
        return self

    @property
    def running(self) -> bool:
        return self._launched is not None

    @property
    def world_size(self) -> int:
        return len(self._engine_of_rank)

    @property
    def devices(self) -> list[str]:
        """Each rank's device ("cpu", "cuda:0", ...), as the engines reported it at start."""
        return [row["device"] for row in self._info]

    @property
    def hosts(self) -> list[str]:
        """Each rank's host name, as the engines reported it at start."""
        return [row["host"] for row in self._info]

    def stop(self) -> None:
        """Stop every engine, the controller and mpiexec; nothing is left running."""
        launched, self._launched = self._launched, None
        _running.discard(self)
        if launched is not None:
            launched.stop()

    def processes(self) -> list:
        """The cluster's processes (psutil.Process): controller, mpiexec, proxies, engines."""
        return self._launched.processes() if self._launched else []

    def restart(self) -> "Cluster":
        """Fresh engines and process group with the same options (e.g. after a hang)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "Cluster":
        return self if self.running else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- work -----------------------------------------------------------------------------------------------------

    def _require_running(self) -> launch.Launched:
        if self._launched is None:
            raise DistUsageError("the cluster is stopped: start it with %dist_start or nbdist.start()")
        if self._ended:
            raise DistUsageError("an engine died, which ended the MPI job: %dist_restart (or cluster.restart()) "
                                 "starts fresh engines")
        if self._reserved is not None and threading.current_thread() is not self._reserved[0]:
            raise DistUsageError(f"the cluster is busy: {self._reserved[1]} (wait() for it or stop() it first)")
        return self._launched

    def reserve(self, thread, what: str) -> None:
        """Only `thread` may use the engines until release(thread): a background run owns them."""
        if self._reserved is not None:
            raise DistUsageError(f"the cluster is busy: {self._reserved[1]}")
        self._reserved = (thread, what)

    def release(self, thread) -> None:
        if self._reserved is not None and self._reserved[0] is thread:
            self._reserved = None

    def _parse_ranks(self, ranks: Sequence[int] | int | str | None) -> list[int]:
        self._require_running()
        return chosen_ranks(ranks, self.world_size)

    def _waiter(self, ar, ranks: list[int], timeout: float | None, show: set[int] | None, progress=None) -> Waiter:
        return Waiter(ar=ar, ranks=ranks, on=self._recovery(), timeout=timeout, progress=progress,
                      relay=OutputRelay(ranks, show, keep=self._keep_output) if show is not None else None)

    def _recovery(self) -> Recovery:
        """What this cluster answers its waiters (who died, how to interrupt, how to get back in step)."""
        launched = self._require_running()
        return Recovery(self, launched.cluster, launched.lifeline, self._info, self._view, self._mark_ended)

    def _mark_ended(self) -> None:
        self._ended = True  # an engine died, which ended the MPI job: the next use says so until a restart

    def _keep_output(self, rank: int, stream: str, text: str) -> str | None:
        """Write a rank's output too long for the cell to a file in the cluster's folder (removed at stop); its path,
        or None if it could not be written."""
        launched = self._launched
        if launched is None:
            return None
        folder = os.path.join(launched.cluster.profile_dir, "output")
        try:
            os.makedirs(folder, exist_ok=True)
            handle, path = tempfile.mkstemp(prefix=f"rank{rank}-{stream}-", suffix=".txt", dir=folder)
            with open(handle, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
        except OSError:
            return None
        return f"{path} until the cluster stops"

    def signal_rank(self, rank: int, number: int) -> bool:
        """Send signal `number` to rank `rank`'s engine, on this host (kill) or on another (down its lifeline to the
        kernel, which raises it there): the kernel's interrupts and stop requests reach every host. False when the
        engine is gone."""
        row = self._info[rank]
        if row["host"] == socket.gethostname():
            try:
                os.kill(row["pid"], number)
            except ProcessLookupError:
                return False
            return True
        server = self._launched.lifeline if self._launched is not None else None
        return server is not None and server.signal(row["host"], row["pid"], int(number))

    def _engine_pids(self) -> dict[int, tuple[str, int]]:
        """rank -> (host, pid) of its engine, as the ranks last said (at start, or in status())."""
        return {row["rank"]: (row["host"], row["pid"]) for row in self._info}

    def _view(self, ranks: list[int]):
        client = self._require_running().client
        return client[[self._engine_of_rank[r] for r in ranks]]

    def run(self, fn: Callable, *args: Any, ranks=None, timeout: float | None = None, **kwargs: Any) -> list:
        """Call fn(*args, **kwargs) on each rank; return the results in rank order.

        fn may be defined in a notebook cell. As with ipyparallel's %px, the global names it uses are looked up on
        the engine (where a %%dist cell's variables live), so import inside fn what it needs. Output printed by fn
        is shown from rank 0; an exception on any rank raises DistError naming the rank, after freeing the others.
        """
        needs_function(fn, "run")
        timeout = run_timeout(timeout)
        chosen = self._parse_ranks(ranks)
        ar = sent(fn, lambda: self._view(chosen).apply_async(fn, *args, **kwargs))
        return self._waiter(ar, chosen, timeout, show={chosen[0]}).wait()

    def run_each(self, fn: Callable, args_by_rank: dict, timeout: float | None = None, progress=None) -> list:
        """Call fn(*args_by_rank[r]) on each rank r given (different arguments per rank: each rank receives only
        its own share, e.g. its stages of a model). Results in rank order. `progress(async_result)` is called
        about twice a second while waiting (live views read what the ranks publish)."""
        from ipyparallel.client.asyncresult import AsyncResult

        needs_function(fn, "run_each")
        timeout = run_timeout(timeout)
        if not isinstance(args_by_rank, dict):
            raise DistUsageError(f"run_each takes {{rank: (arguments, ...)}}, got {type(args_by_rank).__name__}")
        chosen = self._parse_ranks(sorted(args_by_rank))
        for rank in chosen:
            if not isinstance(args_by_rank[rank], (tuple, list)):
                raise DistUsageError(f"run_each: the arguments of rank {rank} must be a tuple, got "
                                     f"{args_by_rank[rank]!r}")
        client = self._require_running().client
        sendable_to_each(fn, {r: args_by_rank[r] for r in chosen})
        parts = sent(fn, lambda: [client[self._engine_of_rank[r]].apply_async(fn, *args_by_rank[r]) for r in chosen])
        return self._waiter(AsyncResult.join(*parts), chosen, timeout, show={chosen[0]}, progress=progress).wait()

    def execute(self, code: str, ranks=None, timeout: float | None = None, output: str = "rank0") -> list:
        """Run code (a cell's source) on the chosen ranks, like `%%dist`; outputs are labelled by rank."""
        if not isinstance(code, str):
            raise DistUsageError(f"execute takes code as a string, got {type(code).__name__}")
        if output not in SHOW_MODES:
            raise DistUsageError(f"--output must be one of {', '.join(SHOW_MODES)}, got {output!r}")
        timeout = run_timeout(timeout)
        chosen = self._parse_ranks(ranks)
        show = {"rank0": {chosen[0]}, "all": set(chosen), "none": set()}[output]
        ar = self._view(chosen).execute(code, silent=False, block=False)
        replies = self._waiter(ar, chosen, timeout, show=show).wait()
        self._show_results(chosen, replies, show)
        return replies

    @staticmethod
    def _show_results(ranks: list[int], replies: list, show: set[int]) -> None:
        from IPython.display import publish_display_data

        for rank, reply in zip(ranks, replies):
            data = getattr(reply, "data", None)
            if rank in show and data:
                if set(data) == {"text/plain"}:
                    print(f"[rank {rank}] Out: {data['text/plain']}")
                else:
                    publish_display_data(data)

    def status(self) -> Status:
        """Rank, host, pid, device, backend and memory of every engine (freshly measured), how long these engines
        took to start, and what each rank holds (`holdings`)."""
        rows = self.run(boot.info)
        self._info = rows
        return Status(rows, self.startup_seconds, self.holdings(), list(self._launched.left_open))

    def why(self, timeout: float = WHY_SECONDS):
        """What every rank is doing now and why the ranks wait (debugging/hang.py): each rank's flight recorder and
        main stack, read by a thread of its own, so a rank stuck in a collective or a loop still answers. Works while
        a cell runs (from another thread, or as the kernel's timeout or interrupt does) and between cells; a rank
        that does not answer within `timeout` seconds is said to be silent."""
        from nbdist.debugging.hang import explain

        launched = self._launched  # not _require_running: a background run holding the engines is why one asks
        if launched is None or self._ended:
            self._require_running()  # says why not, in one line
        server = launched.lifeline
        processes = self._engine_pids()
        reports = server.inspect(list(processes.values()), timeout) if server is not None else {}
        view = explain({rank: reports.get(process) for rank, process in processes.items()})
        self.last_why = view
        return view

    def holdings(self) -> list[dict]:
        """What every rank keeps between calls (pipelines, meshes, groups...: the engine registry), with the bytes
        of tensors each holds: one row per (rank, object)."""
        per_rank = self.run(registry.holdings)
        return [{"rank": rank, **row} for rank, rows in enumerate(per_rank) for row in rows]

    def mesh(self, **dims: int) -> Mesh:
        """Lay `dims` (e.g. dp=2, pp=2) over the ranks and build, on every rank, one torch DeviceMesh and one MPI
        sub-communicator per dimension (nbdist/cluster/meshes/ranks/rank_mesh.py). Built once per shape and start: asking again
        returns the same mesh."""
        planned = make_mesh(self.world_size, **dims)
        name = "mesh:" + ",".join(f"{n}={s}" for n, s in planned.dims)
        if name not in self.meshes:  # building is collective over every rank
            built = Mesh(planned.dims, planned.world_size, name, self.generation, tuple(self.hosts))
            self.run(rank_mesh.build, built)
            self.meshes[name] = built
        return self.meshes[name]

    def check_fresh(self, generation: int | None, what: str) -> None:
        """Refuse, in one line, an object made on engines that have since been restarted (they no longer hold it)."""
        self._require_running()
        if generation != self.generation:
            raise DistUsageError(f"{what} was made before the engines were restarted, which cleared it from the "
                                 f"ranks: make it again")

    def __repr__(self) -> str:
        state = f"{self.world_size} ranks" if self.running else "stopped"
        return f"<nbdist.Cluster {state}, backend={self._info[0]['backend'] if self._info else self.options.backend}>"


def start(n: int | None = None, *, restart: bool = False, **options: Any) -> Cluster:
    """Start (or return the running) cluster: `n` engines, default one per GPU, else 2 CPU engines.

    Options: cpu, backend ("mpi" | "gloo" | "nccl"; CPU engines default to "mpi"), timeout (start-up, seconds),
    hosts ("a,b" or ["a:2", "b:2"]: engines on those hosts through ssh) or hostfile, iface (the network interface
    between the hosts, where there are several), mpi_args (a list, or one string split as a shell would),
    collective_timeout, fork (default True: on one host the ranks are forked from this kernel, as accelerate's
    notebook_launcher does, so they start without importing torch again; False: fresh processes, cluster/launching/warm.py
    says when forking is not possible). A running cluster is kept (a note says so) unless `restart=True`. One
    cluster per kernel: starts from several threads are taken one at a time. For a second cluster:
    `nbdist.Cluster(n=...).start()`.
    """
    global _current
    if not isinstance(restart, bool):
        raise DistUsageError(f"restart must be True or False, got {restart!r}")
    cluster = Cluster(ClusterOptions.of(n, **options))  # validates every value before anything else happens
    with _starting:
        if _current is not None and _current.running:
            if not restart:
                print(f"a cluster is already running ({_current.world_size} ranks); keeping it (restart=True "
                      "replaces it)")
                return _current
            _current.stop()
        _current = cluster.start()
    return cluster


def current() -> Cluster:
    """The cluster started by `%dist_start` / `nbdist.start()`."""
    if _current is None or not _current.running:
        raise DistUsageError("no cluster is running: start one with %dist_start or nbdist.start()")
    return _current


def stop() -> None:
    """Stop the cluster `nbdist.start()` started, if any (after a start under way in another thread ends)."""
    with _starting:
        if _current is not None:
            _current.stop()


def _stop_all() -> None:
    for cluster in list(_running):
        cluster.stop()


atexit.register(_stop_all)


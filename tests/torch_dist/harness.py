"""Run PyTorch's own distributed test bodies (torch.testing._internal.distributed.distributed_test,
class DistributedTest._DistTestBase, from the installed torch wheel) on the ranks of an MPI job, against gloo or
against nbdist's "mpi4py" backend (nbdist/backend/ranks/mpi_backend.py).

    mpiexec -n 3 python tests/torch_dist/harness.py --backend mpi4py --out results.json [--only NAME ...]
                                                    [--timeout S] [--pg-timeout S] [--temp-root DIR] [--list]

torch's own runner (test/distributed/test_distributed_spawn.py) spawns one process per rank and test; here the MPI
job's ranks are the processes (torch rank = MPI rank, as the mpi4py backend needs) and they run the tests one
after another, in the same order everywhere, the way torch's TestDistBackend._run runs one:
- the environment torch's tests read: BACKEND, WORLD_SIZE, RANK, TEMP_DIR (made by rank 0 and broadcast over
  MPI, with torch's barrier/, test_dir/ and init_dir/ in it), INIT_METHOD=file://TEMP_DIR/init_dir/...;
- per test, a default process group of every rank made by init_process_group over a FileStore in TEMP_DIR (a fresh
  file per test, as torch's runner does), destroyed after the test;
- skips as torch's runner sees them: the method's __unittest_skip__ (what unittest would check in the parent),
  unittest.SkipTest, and sys.exit with one of TEST_SKIPS' exit codes (skip_if_no_gpu and the like);
- between tests an MPI barrier, then torch's file barrier (Barrier in TEMP_DIR/barrier) reset.
Which tests: every test_* method of _DistTestBase but those listed, with a reason, in tests/torch_dist/
not_applicable.py (CUDA, NCCL only, more ranks, gloo-only API...; they run only when named exactly with --only).
For mpi4py, torch's selection is made to treat "mpi4py" as it treats "gloo": "mpi4py" joins the DistTestCases sets
that hold "gloo" (widen_feature_sets), and the tests torch gates on the literal name "gloo" are run too
(gloo_name_gates); so both backends run the same tests and the pass sets can be compared.

Each rank records, per test, passed / failed (exception type and first line, where it was raised) / skipped
(reason) / timeout, into TEMP_DIR/results/rank<r>.jsonl as it goes; at the end rank 0 gathers every rank's records
over MPI and writes --out. A test that runs past --timeout seconds (its step: the test and the barrier after it) is
recorded as "timeout" (with the frame each hung rank is in) and ends the job: rank 0 merges what every rank wrote
so far, writes --out, and calls MPI.COMM_WORLD.Abort, which makes mpiexec end every rank.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(REPO), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

from not_applicable import NOT_APPLICABLE

GRACE_SECONDS = 3.0  # after a timeout, how long rank 0 waits for the other ranks to record theirs
ABORT_FALLBACK_SECONDS = 20.0  # a rank other than 0 aborts by itself this long after its own timeout


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "mpi4py"), required=True)
    parser.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="run only these tests (exact names or fnmatch patterns such as 'test_all_reduce_*'); "
                             "a not-applicable test runs only when named exactly")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per test before the job is aborted")
    parser.add_argument("--pg-timeout", type=float, default=20.0,
                        help="the process group's timeout (torch's runner: 60 s; lower here so that a rank left "
                             "waiting by a peer's failure gets its error quickly); torch's shorter per-test "
                             "timeouts (CUSTOM_PG_TIMEOUT) are kept")
    parser.add_argument("--temp-root", default=None,
                        help="where rank 0 makes TEMP_DIR (default: the system's temporary folder); a killed run "
                             "leaves it behind")
    parser.add_argument("--list", action="store_true", help="write the applicable tests' names to --out, run none")
    return parser.parse_args(argv)


def setup_environment(args, comm) -> str:
    """What torch's tests read from the environment (some at import: BACKEND, INIT_METHOD, WORLD_SIZE)."""
    temp = None
    if comm.rank == 0:
        temp = tempfile.mkdtemp(prefix="nbdist-torch-dist-", dir=args.temp_root)
        for sub in ("barrier", "test_dir", "init_dir", "stores", "results"):
            os.mkdir(os.path.join(temp, sub))
    temp = comm.bcast(temp, root=0)
    os.environ.update({
        "BACKEND": args.backend, "WORLD_SIZE": str(comm.size), "RANK": str(comm.rank), "TEMP_DIR": temp,
        "INIT_METHOD": "file://" + os.path.join(temp, "init_dir", "shared_init_file"),
        "MASTER_ADDR": "127.0.0.1",  # TestDistBackend.setUpClass sets it; only printed by one test here
        "TORCH_SHOW_CPP_STACKTRACES": "1",  # as torch's run_test sets
    })
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo's pairs on loopback
    return temp


def widen_feature_sets(backend: str) -> None:
    """Make torch's test selection treat "mpi4py" as it treats "gloo".

    distributed_test.py decides which tests apply to a backend from the sets in DistTestCases (common_distributed):
    backend_feature["ddp"], ["subgroup"], ["gpu"], ["cuda"] list the backends a test needs, skip_collective[...]
    those that lack a collective, and these decorators are evaluated when distributed_test is imported. nbdist's
    backend is a stand-in for gloo on CPU, so it is added to exactly the sets that contain "gloo" (today: gpu, cuda,
    ddp, subgroup; no skip_collective set contains gloo, so none gets mpi4py): the same tests then apply to both
    backends and a difference in the pass sets is a difference of the backends, not of the selection. ("gpu" and
    "cuda" change nothing on a CPU-only machine: those tests skip for want of CUDA on both.)
    It is also added to backend_feature["plugin"], torch's set for third-party backends: that is how
    require_backend_is_available counts a backend it cannot ask about (is_gloo_available() and the like) as
    available; without it every test decorated with require_backend_is_available would skip on mpi4py only.
    Must run before distributed_test is imported."""
    from torch.testing._internal.common_distributed import DistTestCases

    if backend == "gloo":
        return
    for sets in (DistTestCases.backend_feature, DistTestCases.skip_collective):
        for members in sets.values():
            if "gloo" in members:
                members.add(backend)
    DistTestCases.backend_feature["plugin"].add(backend)


def gloo_name_gates(dt, backend: str) -> dict[str, str]:
    """Tests that distributed_test.py runs on gloo but skips on `backend` only because their decorators name gloo
    ({test: the skip's reason}). Besides the DistTestCases sets (widen_feature_sets), distributed_test gates tests on
    literal names, evaluated at import: require_backend_is_available({"gloo"}), skip_..._if(BACKEND != "gloo", "Only
    gloo backend supports timeouts"), "GLOO Batch Send Recv CPU", "get_future is only supported on mpi, nccl and
    gloo"... Most of those bodies use only the generic torch.distributed API (all_reduce_coalesced, per-group
    timeouts, batch_isend_irecv, sparse all_reduce, get_future), which is what the comparison is for; the bodies that
    really need gloo itself (ProcessGroupGloo, monitored_barrier...) are in not_applicable.py with their reason.
    Found by importing a second copy of distributed_test with BACKEND=gloo and comparing the skips its decorators
    set (the unittest skip attributes) with this import's: a test skipped here and not there is lifted, i.e. run."""
    import importlib.util

    if backend == "gloo":
        return {}
    spec = importlib.util.spec_from_file_location("_distributed_test_as_gloo", dt.__file__)
    as_gloo = importlib.util.module_from_spec(spec)
    os.environ["BACKEND"] = "gloo"
    try:
        spec.loader.exec_module(as_gloo)
    finally:
        os.environ["BACKEND"] = backend
    mine, theirs = dt.DistributedTest._DistTestBase, as_gloo.DistributedTest._DistTestBase
    lifted = {}
    for name in test_names(mine):
        here, there = getattr(mine, name), getattr(theirs, name, None)
        if getattr(here, "__unittest_skip__", False) and there is not None \
                and not getattr(there, "__unittest_skip__", False):
            lifted[name] = getattr(here, "__unittest_skip_why__", "")
    return lifted


def test_names(base) -> list[str]:
    return sorted(name for name in dir(base) if name.startswith("test_") and callable(getattr(base, name)))


def select(all_names: list[str], only: list[str] | None) -> list[str]:
    if not only:
        return [n for n in all_names if n not in NOT_APPLICABLE]
    exact = set(only)
    return [n for n in all_names
            if n in exact or (n not in NOT_APPLICABLE and any(fnmatch.fnmatchcase(n, p) for p in only))]


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0].strip() if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def where(tb) -> str:
    """Where an exception was raised: the innermost frame in torch's test file, and the innermost in nbdist (if
    any), as file:line function."""
    frames = traceback.extract_tb(tb)
    found = []
    for marker in ("distributed_test.py", "/nbdist/"):
        for frame in reversed(frames):
            if marker in frame.filename:
                found.append(f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}")
                break
    if not found and frames:
        frame = frames[-1]
        found.append(f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}")
    return "; ".join(found)


def stack_of(thread_id: int | None) -> str:
    """Where a (hung) thread is: its innermost frame in torch's test file and its innermost frame overall."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)
    found = []
    for frame_summary in reversed(stack):
        if "distributed_test.py" in frame_summary.filename:
            found.append(f"distributed_test.py:{frame_summary.lineno} {frame_summary.name}")
            break
    last = stack[-1]
    found.append(f"{os.path.basename(last.filename)}:{last.lineno} {last.name}")
    return "; ".join(found)


class Recorder:
    """This rank's records, kept in memory and appended to TEMP_DIR/results/rank<r>.jsonl as they come. Closed by
    the watchdog when it declares a timeout: a test that ends during the abort's grace period stays a timeout."""

    def __init__(self, temp: str, rank: int):
        self.path = os.path.join(temp, "results", f"rank{rank}.jsonl")
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.closed = False

    def add(self, record: dict, final: bool = False) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = final
            self.records.append(record)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> None:
        with self.lock:
            self.closed = True


def read_partial(temp: str, size: int) -> list[list[dict]]:
    out = []
    for r in range(size):
        path = os.path.join(temp, "results", f"rank{r}.jsonl")
        records = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut by the abort
        out.append(records)
    return out


OUTCOME_ORDER = ("timeout", "failed", "skipped", "passed")  # the test's outcome: the worst of its ranks'


def merge(args, size: int, names: list[str], per_rank: list[list[dict]], started: float, aborted: str | None,
          torch_version: str, lifted: dict) -> dict:
    tests = {}
    for name in names:
        ranks = []
        for records in per_rank:
            found = [r for r in records if r["test"] == name]
            ranks.append(found[-1] if found else None)
        if all(r is None for r in ranks):
            continue  # not reached (the job was aborted before it)
        outcomes = [r["outcome"] if r is not None else "timeout" for r in ranks]
        outcome = next(o for o in OUTCOME_ORDER if o in outcomes)
        entry = {"outcome": outcome, "ranks": [
            {k: v for k, v in (r or {"outcome": "timeout", "detail": "no record (rank hung or died)"}).items()
             if k != "test"} for r in ranks]}
        details = [r["detail"] for r in ranks if r is not None and r["outcome"] == outcome and r.get("detail")]
        if details:
            entry["detail"] = details[0]
        tests[name] = entry
    counts = {o: sum(1 for t in tests.values() if t["outcome"] == o) for o in reversed(OUTCOME_ORDER)}
    return {
        "backend": args.backend, "world_size": size, "torch": torch_version,
        "nbdist_backend_sources": backend_fingerprint(),
        "selected": len(names), "ran": len(tests), "counts": counts,
        "not_applicable": sorted(n for n in NOT_APPLICABLE if n not in names),
        "lifted": {n: reason for n, reason in lifted.items() if n in names},
        "aborted": aborted, "seconds": round(time.monotonic() - started, 1), "tests": tests,
    }


def backend_fingerprint() -> str:
    """A hash of nbdist's backend sources (nbdist/backend/ranks/*.py) as this run read them: results belong to a
    version of the backend, and the backend changes."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO / "nbdist" / "backend" / "ranks").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
    os.replace(tmp, path)


class Watchdog:
    """Per rank: ends the job when a test's step outlasts --timeout (see the module docstring)."""

    def __init__(self, args, comm, temp: str, recorder: Recorder, finish_partial):
        self.args, self.comm, self.temp, self.recorder = args, comm, temp, recorder
        self.finish_partial = finish_partial
        self.current: tuple[str, float, float] | None = None  # (test, started, deadline)
        self.main_thread = threading.main_thread().ident
        self.lock = threading.Lock()
        self.fired = threading.Event()  # the job is being ended: the main thread starts nothing more
        threading.Thread(target=self._run, name="harness-watchdog", daemon=True).start()

    def hold_if_fired(self) -> None:
        """Called by the main thread between steps: once a timeout was declared, wait for the abort."""
        while self.fired.is_set():
            time.sleep(1.0)

    def arm(self, name: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.current = (name, now, now + self.args.timeout)

    def disarm(self) -> None:
        with self.lock:
            self.current = None

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            with self.lock:
                current = self.current
            if current is None or time.monotonic() < current[2]:
                continue
            name, started, _ = current
            self.fired.set()
            recorded = any(r["test"] == name for r in self.recorder.records)
            if recorded:  # this rank finished the test and waits in the barrier after it for a hung peer
                self.recorder.close()
            else:  # this rank hung in the test itself
                self.recorder.add({"test": name, "outcome": "timeout", "seconds": round(time.monotonic() - started, 1),
                                   "detail": f"still running after {self.args.timeout:g} s, in "
                                             f"{stack_of(self.main_thread)}"}, final=True)
            print(f"[harness rank {self.comm.rank}] {name}: timeout after {self.args.timeout:g} s; ending the job",
                  file=sys.stderr, flush=True)
            if self.comm.rank == 0:
                time.sleep(GRACE_SECONDS)
                try:
                    self.finish_partial(f"{name} timed out after {self.args.timeout:g} s")
                except Exception:  # noqa: BLE001 - the abort below must happen anyway
                    traceback.print_exc()
            else:
                time.sleep(ABORT_FALLBACK_SECONDS)  # rank 0 normally aborts the job before this
            self.comm.Abort(3)
            os._exit(3)


def run_test(case_class, name: str, index: int, comm, temp: str, args, skip_codes: dict, recorder,
             lifted: dict) -> dict:
    """One test on this rank, as torch's TestDistBackend._run + MultiProcessTestCase.run_test run it: init the
    default group, barrier, the test, barrier, destroy (torch's barriers are its file barrier; MPI's here)."""
    import torch.distributed as dist
    from torch.testing._internal import common_utils
    from torch.testing._internal.distributed import distributed_test as dt

    started = time.monotonic()
    record = {"test": name}
    method = getattr(case_class, name)
    if name not in lifted and getattr(method, "__unittest_skip__", False):
        # what unittest checks in torch's parent process, before it spawns anything
        reason = getattr(method, "__unittest_skip_why__", "")
        record.update(outcome="skipped", detail=reason, seconds=0.0)
        recorder.add(record)
        return record
    case = case_class(name)  # MultiProcessTestCase wraps the method: with a rank set it just runs it
    case.rank = comm.rank
    case.file_name = os.path.join(temp, "stores", f"{index:04d}")
    try:
        seconds = min(dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout), args.pg_timeout)
        dist.init_process_group(init_method="file://" + case.file_name, backend=os.environ["BACKEND"],
                                world_size=comm.size, rank=comm.rank, timeout=datetime.timedelta(seconds=seconds))
    except Exception as error:  # noqa: BLE001
        record.update(outcome="failed", detail="init_process_group: " + first_line(error),
                      where=where(error.__traceback__))
    # every rank has initialised before any test can skip and tear its group down (torch's _run: self._barrier())
    comm.Barrier()
    if "outcome" not in record:
        try:
            common_utils.set_rng_seed()
            getattr(case, name)()
            record.update(outcome="passed")
        except unittest.SkipTest as error:
            record.update(outcome="skipped", detail=str(error))
        except SystemExit as error:
            code = error.code
            if code in skip_codes:
                record.update(outcome="skipped", detail=skip_codes[code])
            elif code in (0, None):
                record.update(outcome="passed")
            else:
                record.update(outcome="failed", detail=f"SystemExit: {code}", where=where(error.__traceback__))
        except Exception as error:  # noqa: BLE001 - a test's failure, whatever it is, is its record
            record.update(outcome="failed", detail=first_line(error), where=where(error.__traceback__))
    record["seconds"] = round(time.monotonic() - started, 2)
    recorder.add(record)  # before the barrier: a rank that waits there for a hung peer has its outcome recorded
    comm.Barrier()  # every rank is done with the test before any destroys its groups (torch's _run, too)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001
        record["cleanup"] = first_line(error)
        recorder.add(record)
    reset_torch_groups()
    return record


def reset_torch_groups() -> None:
    """torch.distributed's bookkeeping as destroy_process_group() leaves it, also where a test (or a failed init)
    left no default group to destroy: group names come from a per-process counter (_world.group_count), and a
    rank whose counter ran ahead would wait forever for keys its peers never write."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                  "pg_coalesce_state"):
        getattr(world, table).clear()
    world.group_count = 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    started = time.monotonic()
    temp = setup_environment(args, comm)

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # as torch's test_distributed_spawn.py sets
    if args.backend == "mpi4py":
        from nbdist.backend.ranks import mpi_backend

        mpi_backend.register()  # before distributed_test's import: its decorators call dist.Backend(BACKEND)
    widen_feature_sets(args.backend)
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.distributed import distributed_test as dt

    class TorchDistributedTest(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        """torch's TestDistBackendWithSpawn, without the spawning."""

    names = select(test_names(dt.DistributedTest._DistTestBase), args.only)
    lifted = gloo_name_gates(dt, args.backend)
    if args.list:
        if rank == 0:
            write_json(args.out, {"tests": names})
            shutil.rmtree(temp, ignore_errors=True)
        return 0
    skip_codes = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
    recorder = Recorder(temp, rank)

    def finish_partial(aborted: str) -> None:
        data = merge(args, size, names, read_partial(temp, size), started, aborted, torch.__version__, lifted)
        write_json(args.out, data)
        shutil.rmtree(temp, ignore_errors=True)

    watchdog = Watchdog(args, comm, temp, recorder, finish_partial)
    for index, name in enumerate(names):
        watchdog.hold_if_fired()
        comm.Barrier()
        if rank == 0:  # torch's file barrier starts afresh for each test (TestDistBackend.setUp: Barrier.init)
            dt.Barrier.init()
        comm.Barrier()
        dt.Barrier.barrier_id = 0
        watchdog.arm(name)
        record = run_test(TorchDistributedTest, name, index, comm, temp, args, skip_codes, recorder, lifted)
        if rank == 0 and not watchdog.fired.is_set():
            print(f"[harness] {index + 1}/{len(names)} {name}: {record['outcome']} ({record['seconds']} s)"
                  + (f" {record.get('detail', '')}" if record["outcome"] == "failed" else ""), flush=True)
        watchdog.hold_if_fired()
        watchdog.disarm()

    gathered = comm.gather(recorder.records, root=0)
    if rank == 0:
        data = merge(args, size, names, gathered, started, None, torch.__version__, lifted)
        write_json(args.out, data)
        c = data["counts"]
        print(f"[harness] {args.backend} on {size} ranks: {data['ran']} run, {c['passed']} passed, {c['failed']} "
              f"failed, {c['skipped']} skipped, {c['timeout']} timeout in {data['seconds']} s -> {args.out}",
              flush=True)
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
    # MPI_Finalize (mpi4py's, at exit) may wait on requests a failed test abandoned: do not let it hang the job
    timer = threading.Timer(30.0, os._exit, (0,))
    timer.daemon = True
    timer.start()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The Trainer's checkpoints, ON the ranks: torch.distributed.checkpoint (DCP) for model and optimizer under any
plan, plus what makes a resume exact: the step (which fixes the data position and the learning rate schedule) and
every rank's random number generators.

Layout: <dir>/step_00000012/ holds DCP's files (.metadata and one file per writing rank), trainer.json (step,
seed, world size, plan, each file's size) and rank<r>.rng (and rank<r>.replica in the replica modes, rank<r>.zero1
under ZeRO-1). Every file is data, read as data (nbdist/training/checkpoint_data.py: weights_only, DCP's metadata
through an allowlist). It is written under <dir>/step_00000012.partial and renamed when every rank has finished: a
crash mid-write leaves a .partial folder, never a half-written step_* one, so the previous checkpoint stays whole and
`latest()` never picks a broken one.

`get_state_dict` / `set_state_dict` give the model's and optimizer's state under the unsplit model's keys whatever
wraps it (DDP, FSDP2, tensor-parallel DTensors), and DCP reshards on load: a checkpoint saved under one plan or
engine count loads into another (elastic resume). Except ZeRO-1's optimizer state (ZeroRedundancyOptimizer,
TensorParallelZero): each rank holds the state of its own share of the parameters, which DCP's helpers do not map
back (consolidated and saved through them, a resumed run's weights came out 1.3e-3 off), so DCP keeps the model
and each rank writes its share's state itself (rank<r>.zero1): such a checkpoint resumes on the same plan.

Every rank checks that it can write the folder and all agree before any writes its part (on another host the
folder may be missing or read-only: one line naming the ranks and the OS's reason, the same on every rank, none left
waiting). torch's DCP logs its fallbacks through the root logger; they are kept out of the cell.
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import random
import shutil
import time

import torch

from nbdist.errors import DistUsageError
from nbdist.training import checkpoint_data

PREFIX = "step_"
PARTIAL = ".partial"


def folder(directory: str, step: int) -> str:
    return os.path.join(directory, f"{PREFIX}{step:08d}")


def _barrier(trainer, directory: str | None = None, failure: int = 0) -> None:
    """Every rank of the trainer, together; each says whether it could write `directory` (0, or the OS's errno),
    and if one could not, every rank raises the same line naming them."""
    import numpy as np

    from nbdist.backend.ranks import waiting

    everyone = trainer.me.everyone
    mine = np.array([trainer.rank, failure], dtype=np.int64)
    said = np.zeros(2 * everyone.Get_size(), dtype=np.int64)
    waiting.complete_or_abandon([everyone.Iallgather(mine, said)], (mine, said), 600.0,
                                 f"rank {trainer.rank}: the other ranks did not reach the checkpoint within 600 s")
    failed: dict[int, list[int]] = {}
    for rank, code in said.reshape(-1, 2).tolist():
        if code:
            failed.setdefault(code, []).append(rank)
    if failed:
        reasons = "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {os.strerror(code)}"
                            for code, r in sorted(failed.items()))
        raise DistUsageError(checkpoint_data.unwritable(directory, reasons))


def _failure(action, *args) -> int:
    """Run `action(*args)` (a write); 0 if it worked, else the OS's errno (said to the other ranks)."""
    try:
        action(*args)
    except OSError as e:
        return e.errno or errno.EIO
    return 0


def _state(trainer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model, optimizer = trainer.runner.model, trainer.runner.optimizer
    if _zero1(optimizer):
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _zero1(optimizer) -> bool:
    """Whether `optimizer` keeps only this rank's share of the state (ZeRO-1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from nbdist.data_parallel.ranks.zero_optimizer import TensorParallelZero

    return isinstance(optimizer, (ZeroRedundancyOptimizer, TensorParallelZero))


def _share(optimizer):
    """ZeRO-1: the optimizer stepping this rank's share (None when it owns no parameter)."""
    return optimizer.optim if hasattr(optimizer, "optim") else optimizer.inner


def save(trainer, directory: str, asynchronous: bool = False) -> str:
    """Write this step's checkpoint (collective: every rank of the trainer calls it). Returns its folder.

    asynchronous: DCP's async_save copies the state to memory and writes it from a background thread (over a
    gloo group of its own, so the writing never shares a communicator with training); training goes on at once
    and the checkpoint gets its final name when the writing is done (`settle`)."""
    import torch.distributed.checkpoint as dcp

    settle(trainer, wait=True)  # one save in flight at a time
    started = time.perf_counter()
    final = folder(directory, trainer.step)
    partial = final + PARTIAL
    _barrier(trainer, directory, _failure(_make, partial) if trainer.rank == 0 else 0)
    own = {f"rank{trainer.rank}.rng": _rng_state()}
    replica = _replica_state(trainer)
    if replica is not None:
        own[f"rank{trainer.rank}.replica"] = replica
    if _zero1(trainer.runner.optimizer):
        share = _share(trainer.runner.optimizer)
        own[f"rank{trainer.rank}.zero1"] = {"share": None if share is None else share.state_dict()}
    _barrier(trainer, directory, _failure(_write, partial, own))
    meta = {"step": trainer.step, "seed": trainer.spec.data.seed, "world_size": trainer.me.mesh.size,
            "mesh": dict(trainer.me.mesh.dims), "batch_size": trainer.spec.data.batch_size,
            "sync": trainer.spec.optimization.sync}
    with _dcp_quiet(partial, "written"):
        if asynchronous:
            future = dcp.async_save(_state(trainer), checkpoint_id=partial, process_group=_writer_group(trainer))
            trainer.pending_save = (future, partial, final, meta, started)
            trainer.last_save_stall_s = time.perf_counter() - started
            return final
        dcp.save(_state(trainer), checkpoint_id=partial)
    _barrier(trainer)
    _barrier(trainer, directory, _failure(_finalise, partial, final, meta, started) if trainer.rank == 0 else 0)
    trainer.last_save_stall_s = time.perf_counter() - started
    return final


def settle(trainer, wait: bool) -> None:
    """Finish an asynchronous save whose writing is done (or, `wait`, wait for it): rank 0 names it final once its
    own future completes, which DCP completes only after every rank's data and the metadata are written."""
    pending = getattr(trainer, "pending_save", None)
    if pending is None:
        return
    future, partial, final, meta, started = pending
    if not wait and not future.done():
        return
    trainer.pending_save = None
    with _dcp_quiet(partial, "written"):
        future.result()  # raises what the writer raised
    if trainer.rank == 0:
        _finalise(partial, final, meta, started)


def _make(partial: str) -> None:
    shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
    os.makedirs(partial)


def _write(partial: str, own: dict) -> None:
    """This rank's own files: torch.save of plain data (tensors, numbers, lists, dicts), each file opened here so
    that a failure is the OS's own error."""
    for name, state in own.items():
        with open(os.path.join(partial, name), "wb") as f:
            torch.save(state, f)


def _finalise(partial: str, final: str, meta: dict, started: float) -> None:
    files = {e.name: e.stat().st_size for e in os.scandir(partial) if e.is_file()}  # what the kernel checks
    with open(os.path.join(partial, checkpoint_data.TRAINER), "w") as f:
        json.dump({**meta, "files": files, "seconds": time.perf_counter() - started}, f)
    if os.path.exists(final):  # saving the same step again: the new one replaces it
        shutil.rmtree(final)
    os.rename(partial, final)
    _sync_folder(os.path.dirname(final))


def _writer_group(trainer):
    """A gloo group of the trainer's ranks for DCP's background writer (made once, collectively)."""
    import torch.distributed as dist

    if getattr(trainer, "writer_group", None) is None:
        trainer.writer_group = dist.new_group(backend="gloo")
    return trainer.writer_group


def load(trainer, path: str) -> int:
    """Load a checkpoint into this rank's model and optimizer (collective), restore the step and, on the same
    number of ranks, the random generators. Returns the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    settle(trainer, wait=True)
    try:
        meta = checkpoint_data.read_trainer(path)
        metadata = checkpoint_data.read_metadata(path)
        for relative in sorted({str(info.relative_path) for info in metadata.storage_data.values()}):
            checkpoint_data.regular(os.path.join(path, relative), relative)  # DCP opens them: a FIFO would hang it
        reader = _data_only_reader()(path, metadata)
    except checkpoint_data.CheckpointFileError as e:
        raise UnreadableCheckpoint(str(e)) from None
    state = _state(trainer)
    with _dcp_quiet(path, "loaded", UnreadableCheckpoint):
        dcp.load(state, storage_reader=reader, planner=_data_only_planner()())
    same_world = meta["world_size"] == trainer.me.mesh.size
    if "optimizer" in state:
        set_state_dict(trainer.runner.model, trainer.runner.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    else:
        _load_zero1(trainer, path, state["model"], same_world and meta.get("mesh") == dict(trainer.me.mesh.dims))
    rng = f"rank{trainer.rank}.rng"
    if same_world and os.path.exists(os.path.join(path, rng)):
        _set_rng_state(_load(path, rng))
    if same_world:
        _load_replica(trainer, path)
    trainer.step = int(meta["step"])
    trainer.records = [r for r in trainer.records if r["step"] < trainer.step]
    return trainer.step


def _replica_state(trainer) -> dict | None:
    """The replica modes (local SGD, EASGD, SSP): replicas differ between exchanges, and DCP keeps one copy of what
    every rank names alike, so each rank also writes its own model, optimizer and synchroniser state. SSP first
    applies every update in flight (a checkpoint is a synchronisation point for it)."""
    sync = getattr(trainer.runner, "sync", None)
    if sync is None:
        return None
    if sync.kind == "ssp":
        sync.finish()
    runner = trainer.runner
    return {"model": runner.model.state_dict(), "optimizer": runner.optimizer.state_dict(), "sync": sync.state()}


def _load_replica(trainer, path: str) -> None:
    """Each rank's own replica, where the checkpoint has one for it (same engine count); else the replicas start
    from DCP's one copy, and the synchroniser from scratch."""
    sync = getattr(trainer.runner, "sync", None)
    mine = f"rank{trainer.rank}.replica"
    if sync is None or not os.path.exists(os.path.join(path, mine)):
        return
    from nbdist.runtime.ranks import placement

    saved = _load(path, mine, placement.here())  # saved by any engine's GPU
    trainer.runner.model.load_state_dict(saved["model"])
    trainer.runner.optimizer.load_state_dict(saved["optimizer"])
    sync.load_state(saved["sync"])


def _load_zero1(trainer, path: str, model_state: dict, same_plan: bool) -> None:
    """ZeRO-1: the model from DCP's copy, this rank's share of the optimizer state from its own file (saved under
    this very plan: the shares are the same parameters only then)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from nbdist.runtime.ranks import placement

    mine = f"rank{trainer.rank}.zero1"
    if not same_plan or not os.path.exists(os.path.join(path, mine)):
        raise UnreadableCheckpoint(f"{path}: a zero=1 plan resumes from a checkpoint of the same plan (each rank "
                                   f"keeps its own share of the optimizer state), and this one has no {mine} for "
                                   f"it or was saved on another mesh")
    set_model_state_dict(trainer.runner.model, model_state)
    saved, share = _load(path, mine, placement.here())["share"], _share(trainer.runner.optimizer)
    if (saved is None) != (share is None):
        raise UnreadableCheckpoint(f"{path}: {mine} holds another share of the parameters than this rank's")
    if share is not None:
        try:
            share.load_state_dict(saved)
        except (ValueError, KeyError) as e:
            raise UnreadableCheckpoint(f"{path}: {mine} does not fit this rank's share: {e}") from None


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint's files could not be read (truncated, corrupt, from another model, or not data only)."""


class CheckpointNotWritten(RuntimeError):
    """DCP could not write a checkpoint (a full disk, a folder gone)."""


def _load(path: str, name: str, map_location=None):
    """One of this rank's own files of the checkpoint at `path`, read as data only."""
    try:
        return checkpoint_data.load(os.path.join(path, name), name, map_location)
    except checkpoint_data.CheckpointFileError as e:
        raise UnreadableCheckpoint(str(e)) from None


def _not_dcp(record: logging.LogRecord) -> bool:
    return "torch/distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


class _dcp_quiet:
    """While DCP works: its logging kept out of the cell (it logs its metadata fallbacks through the root logger,
    with tracebacks), and its failure as one line: the first failing rank's own error, raised as `failure`. (A
    class, not a generator: a rank's traceback then shows no frame of it, nor of contextlib.)"""

    def __init__(self, path: str, done: str, failure: type = CheckpointNotWritten):
        self.path, self.done, self.failure = path, done, failure

    def __enter__(self) -> None:
        logging.getLogger().addFilter(_not_dcp)

    def __exit__(self, kind, error, traceback) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        logging.getLogger().removeFilter(_not_dcp)
        if isinstance(error, (Exception, CheckpointException)):  # CheckpointException is a BaseException with
            cause = _cause(error)  # every rank's traceback in its text: keep the cause
            raise self.failure(cause if self.failure is UnreadableCheckpoint else
                               f"checkpoint {self.path} could not be {self.done} ({cause})") from None


@functools.cache
def _data_only_reader():
    """DCP's file reader, given the metadata nbdist read as data (checkpoint_data.read_metadata) in place of its
    own pickle.load of it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataOnlyReader(FileSystemReader):
        def __init__(self, path: str, metadata):
            super().__init__(path)
            self.metadata = metadata

        def read_metadata(self, *args, **kwargs):
            if getattr(self.metadata, "storage_meta", None) is None:
                self.metadata.storage_meta = StorageMeta()
            self.metadata.storage_meta.load_id = self.load_id
            return self.metadata

    return DataOnlyReader


@functools.cache
def _data_only_planner():
    """DCP's load planner, with the values DCP keeps as bytes (the optimizer's hyperparameters) read as data: its
    DefaultLoadPlanner.load_bytes uses torch.load(weights_only=False)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class DataOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = checkpoint_data.load(value, f"{fqn} (kept as bytes by DCP)")
            except checkpoint_data.CheckpointFileError as e:
                raise UnreadableCheckpoint(str(e)) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return DataOnlyPlanner


def _cause(error: BaseException) -> str:
    """The first failing rank's own error, without DCP's wrapping and traceback text; a tensor item torch's
    weights-only unpickler refused is said in nbdist's words (checkpoint_data.refusal), not torch's, which recommend
    weights_only=False."""
    import pickle

    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback)
            error = error[0]
    if isinstance(error, pickle.UnpicklingError):
        return str(checkpoint_data.refusal(error, "a tensor item of DCP's .distcp files"))
    text = " ".join(str(error).split())
    return type(error).__name__ + (f": {text[:200]}" if text else " (a file of it ends early or is corrupt)")


def _rng_state() -> dict:
    """This rank's generators as plain data (tensors, numbers, tuples: what weights_only loads): numpy's state
    tuple holds an ndarray, kept as a tensor of its key."""
    import numpy as np

    from nbdist.runtime.ranks import placement

    kind, key, position, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    device = placement.here()
    if device.type == "cuda":  # the rank's own GPU's generator (not the current device of whichever thread saves)
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    saved = state["numpy"]
    np.random.set_state((saved["kind"], saved["key"].numpy().astype(np.uint32), saved["position"],
                         saved["has_gauss"], saved["gauss"]))
    from nbdist.runtime.ranks import placement

    device = placement.here()
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _sync_folder(directory: str) -> None:
    """Make the rename durable (a power cut after it must not bring back the .partial name)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

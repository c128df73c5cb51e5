"""The Trainer's checkpoints, ON the ranks: torch.distributed.checkpoint (DCP) for model and optimizer under any
plan, plus what makes a resume exact: the step (which fixes the data position and the learning rate schedule) and
every rank's random number generators.

Layout: <dir>/step_00000012/ holds DCP's files (.metadata and one file per writing rank), trainer.json (step,
seed, world size, plan) and rank<r>.rng. It is written under <dir>/step_00000012.partial and renamed when every rank
has finished: a crash mid-write leaves a .partial folder, never a half-written step_* one, so the previous
checkpoint stays whole and `latest()` never picks a broken one.

`get_state_dict` / `set_state_dict` give the model's and optimizer's state under the unsplit model's keys whatever
wraps it (DDP, FSDP2, tensor-parallel DTensors), and DCP reshards on load: a checkpoint saved under one plan or
engine count loads into another (elastic resume).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time

import torch

PREFIX = "step_"
PARTIAL = ".partial"


def folder(directory: str, step: int) -> str:
    return os.path.join(directory, f"{PREFIX}{step:08d}")


def _barrier(trainer) -> None:
    from nbdist.backend.ranks import waiting

    waiting.complete_or_abandon([trainer.me.everyone.Ibarrier()], (), 600.0,
                                 f"rank {trainer.rank}: the other ranks did not reach the checkpoint within 600 s")


def _state(trainer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = trainer.runner.model, trainer.runner.optimizer
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


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
    if trainer.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        os.makedirs(partial)
    _barrier(trainer)
    torch.save(_rng_state(), os.path.join(partial, f"rank{trainer.rank}.rng"))
    _save_replica(trainer, partial)
    meta = {"step": trainer.step, "seed": trainer.spec.data.seed, "world_size": trainer.me.mesh.size,
            "mesh": dict(trainer.me.mesh.dims), "batch_size": trainer.spec.data.batch_size,
            "sync": trainer.spec.optimization.sync}
    if asynchronous:
        future = dcp.async_save(_state(trainer), checkpoint_id=partial, process_group=_writer_group(trainer))
        trainer.pending_save = (future, partial, final, meta, started)
        trainer.last_save_stall_s = time.perf_counter() - started
        return final
    dcp.save(_state(trainer), checkpoint_id=partial)
    _barrier(trainer)
    if trainer.rank == 0:
        _finalise(partial, final, meta, started)
    _barrier(trainer)
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
    future.result()  # raises what the writer raised
    trainer.pending_save = None
    if trainer.rank == 0:
        _finalise(partial, final, meta, started)


def _finalise(partial: str, final: str, meta: dict, started: float) -> None:
    with open(os.path.join(partial, "trainer.json"), "w") as f:
        json.dump({**meta, "seconds": time.perf_counter() - started}, f)
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
    with open(os.path.join(path, "trainer.json")) as f:
        meta = json.load(f)
    state = _state(trainer)
    try:
        dcp.load(state, checkpoint_id=path)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException with every
        raise UnreadableCheckpoint(_cause(e)) from None  # rank's traceback in its text: keep the cause
    set_state_dict(trainer.runner.model, trainer.runner.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    same_world = meta["world_size"] == trainer.me.mesh.size
    rng = os.path.join(path, f"rank{trainer.rank}.rng")
    if same_world and os.path.exists(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    if same_world:
        _load_replica(trainer, path)
    trainer.step = int(meta["step"])
    trainer.records = [r for r in trainer.records if r["step"] < trainer.step]
    return trainer.step


def _save_replica(trainer, partial: str) -> None:
    """The replica modes (local SGD, EASGD, SSP): replicas differ between exchanges, and DCP keeps one copy of what
    every rank names alike, so each rank also writes its own model, optimizer and synchroniser state. SSP first
    applies every update in flight (a checkpoint is a synchronisation point for it)."""
    sync = getattr(trainer.runner, "sync", None)
    if sync is None:
        return
    if sync.kind == "ssp":
        sync.finish()
    runner = trainer.runner
    torch.save({"model": runner.model.state_dict(), "optimizer": runner.optimizer.state_dict(),
                "sync": sync.state()}, os.path.join(partial, f"rank{trainer.rank}.replica"))


def _load_replica(trainer, path: str) -> None:
    """Each rank's own replica, where the checkpoint has one for it (same engine count); else the replicas start
    from DCP's one copy, and the synchroniser from scratch."""
    sync = getattr(trainer.runner, "sync", None)
    mine = os.path.join(path, f"rank{trainer.rank}.replica")
    if sync is None or not os.path.exists(mine):
        return
    from nbdist.cluster.ranks import placement

    saved = torch.load(mine, weights_only=False, map_location=placement.here())  # saved by any engine's GPU
    trainer.runner.model.load_state_dict(saved["model"])
    trainer.runner.optimizer.load_state_dict(saved["optimizer"])
    sync.load_state(saved["sync"])


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint's files could not be read (truncated, corrupt, from another model)."""


def _cause(error: BaseException) -> str:
    """The first failing rank's own error, without DCP's wrapping and traceback text."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback)
            error = error[0]
    text = " ".join(str(error).split())
    return type(error).__name__ + (f": {text[:200]}" if text else " (a file of it ends early or is corrupt)")


def _rng_state() -> dict:
    import numpy as np

    from nbdist.cluster.ranks import placement

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    device = placement.here()
    if device.type == "cuda":  # the rank's own GPU's generator (not the current device of whichever thread saves)
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    from nbdist.cluster.ranks import placement

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

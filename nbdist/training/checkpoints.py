"""Finding and checking checkpoints from the notebook (kernel side): which folder to resume from, whether a folder
can take checkpoints, and one clear line when either cannot be. The writing happens on the ranks
(nbdist/training/ranks/checkpoint.py).

The kernel and the engines share the filesystem on one host, so a checkpoint is checked here before anything runs
on the ranks: that every file is data (checkpoint_data.check: nothing of a file that would run code is run) and
whole (the sizes the save recorded, where DCP's items lie, every archive's CRC-32). On several hosts the ranks check
what they write and read themselves, and name the rank.
"""
from __future__ import annotations

import os
import tempfile

from nbdist.errors import DistUsageError
from nbdist.training import checkpoint_data

PREFIX, PARTIAL = "step_", ".partial"


def complete(path: str) -> bool:
    """A finished checkpoint: renamed from .partial (so every rank wrote its part) with its two index files."""
    return (os.path.basename(path).startswith(PREFIX) and not path.endswith(PARTIAL)
            and os.path.isfile(os.path.join(path, checkpoint_data.METADATA))
            and os.path.isfile(os.path.join(path, checkpoint_data.TRAINER)))


def find(path: str | None) -> str:
    """`path` itself if it is a checkpoint, else the newest complete checkpoint inside it."""
    if path is None:
        raise DistUsageError("resume() needs a checkpoint: give resume(path) or Trainer(checkpoint_dir=...)")
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise DistUsageError(f"no checkpoint at {path}: the folder does not exist")
    if not os.path.isdir(path):
        raise DistUsageError(f"no checkpoint at {path}: a file, not a checkpoint folder")
    if not complete(path):
        if os.path.basename(path).startswith(PREFIX):
            raise DistUsageError(f"{path} is not a complete checkpoint (no .metadata or trainer.json: a save that "
                                 "did not finish?)")
        found = sorted(os.path.join(path, name) for name in os.listdir(path) if complete(os.path.join(path, name)))
        if not found:
            raise DistUsageError(f"no complete checkpoint in {path}")
        path = found[-1]
    check(path)
    return path


def check(path: str) -> None:
    """A checkpoint the ranks may load: every file data only and whole, or one line (nothing of it run)."""
    try:
        checkpoint_data.check(path)
    except checkpoint_data.NeedsCode as e:
        raise DistUsageError(f"checkpoint {path} is refused: {e}") from None
    except checkpoint_data.CheckpointFileError as e:
        raise DistUsageError(unreadable(path, e)) from None


def writable(directory: str) -> str:
    """The absolute folder, made if missing, once a file could be made in it; else one line naming it and the
    OS's reason. For Trainer(checkpoint_dir=...) and Trainer.save(directory), before anything runs on the ranks."""
    directory = os.path.abspath(directory)
    try:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(20, "a file, not a folder")
        os.makedirs(directory, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".nbdist-writable-", dir=directory))
    except OSError as e:
        raise DistUsageError(checkpoint_data.unwritable(directory, e.strerror or str(e))) from None
    return directory


def unreadable(path: str, error: BaseException) -> str:
    """One line for a checkpoint the ranks could not load, naming the previous complete one (left untouched)."""
    folder = os.path.dirname(path)
    earlier = sorted(os.path.join(folder, n) for n in os.listdir(folder)
                     if complete(os.path.join(folder, n)) and os.path.join(folder, n) < path)
    hint = f"; the previous checkpoint {earlier[-1]} is untouched" if earlier else ""
    cause = " ".join(str(error).split()).split("; rank ")[0][:300]  # the first rank's word is enough
    return f"checkpoint {path} cannot be loaded ({cause}){hint}"

"""Finding and checking checkpoints from the notebook (kernel side): which folder to resume from, and one clear
line when it cannot be read. The writing happens on the ranks (nbdist/training/ranks/checkpoint.py)."""
from __future__ import annotations

import os

from nbdist.errors import DistUsageError

PREFIX, PARTIAL = "step_", ".partial"


def complete(path: str) -> bool:
    """A finished checkpoint: renamed from .partial (so every rank wrote its part) with its two index files."""
    return (os.path.basename(path).startswith(PREFIX) and not path.endswith(PARTIAL)
            and os.path.isfile(os.path.join(path, ".metadata"))
            and os.path.isfile(os.path.join(path, "trainer.json")))


def find(path: str | None) -> str:
    """`path` itself if it is a checkpoint, else the newest complete checkpoint inside it."""
    if path is None:
        raise DistUsageError("resume() needs a checkpoint: give resume(path) or Trainer(checkpoint_dir=...)")
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise DistUsageError(f"no checkpoint at {path}: the folder does not exist")
    if complete(path):
        return path
    if os.path.basename(path).startswith(PREFIX):
        raise DistUsageError(f"{path} is not a complete checkpoint (no .metadata or trainer.json: a save that "
                             "did not finish?)")
    found = sorted(os.path.join(path, name) for name in os.listdir(path) if complete(os.path.join(path, name)))
    if not found:
        raise DistUsageError(f"no complete checkpoint in {path}")
    return found[-1]


def unreadable(path: str, error: BaseException) -> str:
    """One line for a checkpoint the ranks could not load, naming the previous complete one (left untouched)."""
    folder = os.path.dirname(path)
    earlier = sorted(os.path.join(folder, n) for n in os.listdir(folder)
                     if complete(os.path.join(folder, n)) and os.path.join(folder, n) < path)
    hint = f"; the previous checkpoint {earlier[-1]} is untouched" if earlier else ""
    cause = " ".join(str(error).split()).split("; rank ")[0][:300]  # the first rank's word is enough
    return f"checkpoint {path} cannot be loaded ({cause}){hint}"

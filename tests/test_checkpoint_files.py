"""Every file of a Trainer's checkpoint is checked as data by the kernel before the ranks load it (issue 42), on
real checkpoints written by a 2-rank cluster:

- a pickle payload inside one of DCP's tensor items (a .distcp file) is refused by the kernel's check in one line
  in nbdist's words, naming the file and the callable; it never runs, and nothing recommends weights_only=False
  (before: the check passed it and the ranks refused it with torch's cut-short text that recommends it);
- a FIFO in place of rank0.rng is refused from its stat, without being opened (before: the check hung for good);
- ZeRO-1's rank<r>.zero1 files are read by the check like .rng and .replica (before: only the ranks read them);
- a hand-edited trainer.json (step -5) is refused at resume in one line naming the file and the field (before:
  accepted, and the next fit failed on the ranks with a traceback).
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import threading

import pytest
import torch

import nbdist
from nbdist.errors import DistUsageError
from nbdist.training import checkpoint_data, checkpoints
from nbdist.training.ranks import training as on_ranks

BATCH = 8


def mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def regression():
    from nbdist import data

    return data.regression_dataset(samples=64, inputs=8)


def mse(output, target):
    import torch

    return torch.nn.functional.mse_loss(output, target)


def sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


class RunsCode:
    """Unpickling it creates `marker`: what a checkpoint from a shared folder could do to every engine."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def saved(cluster, folder, **options) -> tuple[nbdist.Trainer, str]:
    """A trainer fitted one step and its checkpoint (the trainer is the caller's to close)."""
    tr = nbdist.Trainer(mlp, regression, mse, sgd, cluster=cluster, batch_size=BATCH, live=False, **options)
    tr.fit(steps=1)
    return tr, tr.save(str(folder))


def copied(checkpoint: str, into) -> str:
    shutil.copytree(checkpoint, into)
    return str(into)


def recorded_sizes(path: str) -> None:
    """trainer.json's sizes made those of the files now there (a tampered file then differs in nothing else)."""
    meta_path = os.path.join(path, checkpoint_data.TRAINER)
    with open(meta_path) as f:
        meta = json.load(f)
    meta["files"] = {name: os.path.getsize(os.path.join(path, name)) for name in meta["files"]}
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def payload_in_a_tensor_item(path: str, marker: str) -> tuple[str, str]:
    """One tensor item of a .distcp file replaced by a torch.save archive whose pickle runs code; DCP's metadata
    (offsets and lengths) and trainer.json's sizes written anew to match. Returns (the file, the item's name)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with open(os.path.join(path, checkpoint_data.METADATA), "rb") as f:
        metadata = pickle.load(f)  # our own, trusted checkpoint
    storage = metadata.storage_data
    index = next(i for i, info in storage.items() if info.relative_path.endswith(".distcp")
                 and isinstance(metadata.state_dict_metadata.get(i.fqn), TensorStorageMetadata))
    relative = storage[index].relative_path
    with open(os.path.join(path, relative), "rb") as f:
        old = f.read()
    payload = io.BytesIO()
    torch.save(RunsCode(marker), payload)
    rewritten = bytearray()
    for i, info in sorted(((i, s) for i, s in storage.items() if s.relative_path == relative),
                          key=lambda entry: entry[1].offset):
        item = payload.getvalue() if i == index else old[info.offset: info.offset + info.length]
        storage[i] = dataclasses.replace(info, offset=len(rewritten), length=len(item))
        rewritten += item
    with open(os.path.join(path, relative), "wb") as f:
        f.write(bytes(rewritten))
    with open(os.path.join(path, checkpoint_data.METADATA), "wb") as f:
        pickle.dump(metadata, f)
    recorded_sizes(path)
    return relative, index.fqn


def test_a_payload_in_a_distcp_tensor_item_is_refused_by_the_kernels_check_in_nbdists_words(cluster, tmp_path,
                                                                                             capfd):
    tr, good = saved(cluster, tmp_path / "good")
    try:
        marker = tmp_path / "code ran"
        bad = copied(good, tmp_path / "bad" / os.path.basename(good))
        relative, fqn = payload_in_a_tensor_item(bad, str(marker))
        capfd.readouterr()
        with pytest.raises(DistUsageError) as refused:
            tr.resume(bad)
        said = str(refused.value)
        assert said == (f"checkpoint {bad} is refused: {relative} ({fqn}) would run code to load (it names "
                        f"builtins.exec); a checkpoint must hold data only"), said
        assert capfd.readouterr() == ("", "")
        loaded = cluster.run(on_ranks.load, tr.id, bad)  # the ranks, where the kernel cannot check (other hosts)
        problems = [r.problem for r in loaded if r.problem is not None]
        assert problems and all("would run code to load (it names builtins.exec)" in p for p in problems), loaded
        assert not any("weights_only" in p for p in problems + [said]), problems
        assert not marker.exists()
        tr.resume(good)  # the good one still loads
        assert tr.step == 1
    finally:
        tr.close()


def _check_within(path: str, seconds: float) -> BaseException | None:
    """checkpoints.check(path) in a thread, given `seconds`; what it raised. A check left blocked on a FIFO is freed
    (a writer opens the FIFO) before the test fails."""
    said: list[BaseException | None] = [None]

    def run():
        try:
            checkpoints.check(path)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            said[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for name in os.listdir(path):
            if not os.path.isfile(os.path.join(path, name)):
                os.close(os.open(os.path.join(path, name), os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"checkpoints.check({path}) still reading after {seconds} s (blocked on the FIFO)")
    return said[0]


def test_a_fifo_in_place_of_a_ranks_file_is_refused_without_opening_it(cluster, tmp_path, capfd):
    tr, good = saved(cluster, tmp_path / "good")
    try:
        bad = copied(good, tmp_path / "bad" / os.path.basename(good))
        os.remove(os.path.join(bad, "rank0.rng"))
        os.mkfifo(os.path.join(bad, "rank0.rng"))
        said = _check_within(bad, 20)
        assert isinstance(said, DistUsageError) and str(said) == (
            f"checkpoint {bad} cannot be loaded (rank0.rng is a FIFO (named pipe), not a regular file: not read (a "
            f"checkpoint holds files only))"), said
        capfd.readouterr()
        with pytest.raises(DistUsageError, match=re.escape("rank0.rng is a FIFO (named pipe), not a regular file")):
            tr.resume(bad)
        loaded = cluster.run(on_ranks.load, tr.id, bad, timeout=60)  # rank 0's own read refuses it too
        assert loaded[0].problem == ("UnreadableCheckpoint: rank0.rng is a FIFO (named pipe), not a regular file: "
                                     "not read (a checkpoint holds files only)"), loaded
        assert "Traceback" not in "".join(capfd.readouterr())
    finally:
        tr.close()


def test_zero1_files_are_read_as_data_by_the_kernels_check(cluster, tmp_path, capfd):
    tr, good = saved(cluster, tmp_path / "good", plan={"dp": 2, "zero": 1})
    try:
        assert {"rank0.zero1", "rank1.zero1"} <= set(os.listdir(good))
        marker = tmp_path / "code ran"
        code = copied(good, tmp_path / "code" / os.path.basename(good))
        torch.save({"share": RunsCode(str(marker))}, os.path.join(code, "rank1.zero1"))
        recorded_sizes(code)
        flipped = copied(good, tmp_path / "flipped" / os.path.basename(good))
        with open(os.path.join(flipped, "rank0.zero1"), "r+b") as f:  # bytes overwritten inside a tensor
            f.seek(os.path.getsize(os.path.join(flipped, "rank0.zero1")) // 2)
            f.write(bytes(32))
        capfd.readouterr()
        for path, says in ((code, rf"checkpoint {re.escape(code)} is refused: rank1.zero1 would run code to load "
                                  r"\(it names builtins.exec\); a checkpoint must hold data only"),
                           (flipped, rf"checkpoint {re.escape(flipped)} cannot be loaded \(rank0.zero1 is corrupt "
                                     r"or incomplete: its record .* does not match the checksum it was written with\)")):
            with pytest.raises(DistUsageError) as refused:
                checkpoints.check(path)  # the kernel alone: nothing sent to the ranks
            assert re.fullmatch(says, str(refused.value)), str(refused.value)
            with pytest.raises(DistUsageError, match=says):
                tr.resume(path)
        assert not marker.exists()
        assert capfd.readouterr() == ("", "")
        tr.resume(good)
        assert tr.step == 1
    finally:
        tr.close()


@pytest.mark.parametrize("field, value, wanted", [("step", -5, "a whole number >= 0"),
                                                  ("world_size", 0, "a whole number >= 1"),
                                                  ("batch_size", "8", "a whole number >= 1"),
                                                  ("files", {"rank0.rng": -1}, "names with whole numbers >= 0")])
def test_a_hand_edited_trainer_json_is_refused_at_resume_naming_the_field(cluster, tmp_path, capfd, field, value,
                                                                         wanted):
    tr, good = saved(cluster, tmp_path / "good")
    try:
        bad = copied(good, tmp_path / "bad" / os.path.basename(good))
        with open(os.path.join(bad, checkpoint_data.TRAINER)) as f:
            meta = json.load(f)
        meta[field] = value
        with open(os.path.join(bad, checkpoint_data.TRAINER), "w") as f:
            json.dump(meta, f)
        capfd.readouterr()
        line = f"trainer.json has {field} {value!r}, which no save writes: it must be {wanted}"
        with pytest.raises(DistUsageError) as refused:
            tr.resume(bad)
        assert str(refused.value) == f"checkpoint {bad} cannot be loaded ({line})"
        assert capfd.readouterr() == ("", "")
        assert tr.step == 1  # nothing of it was taken
        loaded = cluster.run(on_ranks.load, tr.id, bad)  # the ranks read it alike
        assert [r.problem for r in loaded] == [f"UnreadableCheckpoint: {line}"] * 2
    finally:
        tr.close()

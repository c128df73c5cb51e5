"""A checkpoint holds data, never code: how its files are read, the same way in the kernel (a checkpoint
is checked there before the ranks load it: checkpoints.py) and on the ranks (ranks/checkpoint.py).

- trainer.json: JSON (step, seed, world size, plan, and the size of every file the save wrote), each field checked
  for what a save writes (a hand-edited step of -5 is refused here, not at the next fit).
- rank<r>.rng, rank<r>.replica, rank<r>.zero1 (ZeRO-1's share of the optimizer state) and the values DCP keeps as
  bytes (the optimizer's hyperparameters): torch.save files read with torch.load(weights_only=True): tensors,
  numbers, strings, None, lists, tuples and dicts, nothing that names a callable. The random states are saved as
  such (numpy's key as a tensor, not as an ndarray).
- DCP's .metadata: torch writes it with pickle. It is read by an Unpickler that resolves only DCP's own metadata
  classes and torch's sizes, dtypes and layouts, so a pickle naming any other callable is refused before anything is
  called. Each tensor item of DCP's .distcp files is a torch.save archive: the kernel's check reads its pickle as
  data too (onto the meta device: no tensor's bytes are copied), and DCP reads it with weights_only=True.

A file that would need code to load is refused in one line naming it and what it asks for, and nothing of it runs;
one that does not parse is corrupt (one line too). Only regular files are opened: a FIFO in a checkpoint would block
its reader for good (and a device never end), so anything else is refused from its stat alone. torch.distributed is
imported inside functions only: the kernel uses this module too.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import stat
import warnings
import zipfile

METADATA, TRAINER = ".metadata", "trainer.json"
LOADED_BY_RANKS = (".rng", ".replica", ".zero1")  # each rank's own files (torch.save), next to DCP's


class CheckpointFileError(Exception):
    """One file of a checkpoint cannot be loaded: the message names it (relative to the checkpoint) and why."""


class NeedsCode(CheckpointFileError):
    """The file names a callable that loading it would call: refused, nothing of it run."""


def _needs_code(name: str, what: str) -> NeedsCode:
    return NeedsCode(f"{name} would run code to load (it names {what}); a checkpoint must hold data only")


def _corrupt(name: str, error: BaseException | str) -> CheckpointFileError:
    if isinstance(error, BaseException):
        text = " ".join(str(error).split())[:200]
        error = type(error).__name__ + (f": {text}" if text else "")
    return CheckpointFileError(f"{name} is corrupt or incomplete: {error}")


def _not_regular(name: str, mode: int) -> CheckpointFileError:
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    kind = next((said for test, said in kinds if test(mode)), "not a file")
    return CheckpointFileError(f"{name} is {kind}, not a regular file: not read (a checkpoint holds files only)")


def regular(path: str, name: str) -> None:
    """Refuse, from its stat alone, a file of a checkpoint that is not a regular file (after symbolic links): opening a
    FIFO to read it blocks until something writes into it, which may be never. A missing file is left to its reader
    to say."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(name, mode)


# -- torch.save files ---------------------------------------------------------------------------------------------

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive (its pickle inside names what the file holds)
NAMED = (r"GLOBAL (\S+) (?:was not an allowed global|whose module)", r"unrecognized function (\S+)",
         r"Can only (?:build|create new object for) .*? got (.+?)(?:$|\n)")


def load(source, name: str, map_location=None):
    """torch.load(weights_only=True) of one file of a checkpoint (a path, or the bytes DCP read for one value):
    data only. A failure is one line naming `name`: NeedsCode for a callable it names, else corrupt. What is no
    torch.save archive (a bare pickle) is not loaded at all: nbdist writes nothing else there."""
    import torch

    if isinstance(source, str):
        regular(source, name)
    head = _head(source)
    if head != ZIP_MAGIC:
        raise (_corrupt(name, "empty") if not head else CheckpointFileError(
            f"{name} is not a torch.save archive, the only kind nbdist writes there: not loaded"))
    mmap = isinstance(source, str) and map_location == "cpu" and zipfile.is_zipfile(source)  # the kernel's check
    try:
        with warnings.catch_warnings():  # torch's remarks on the pickle protocol it found: not for the notebook
            warnings.simplefilter("ignore")
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # torch's weights-only unpickler says what it would not do
        raise refusal(e, name) from None
    except Exception as e:  # noqa: BLE001 - a truncated zip, a bad record
        raise _corrupt(name, e) from None


def refusal(error: pickle.UnpicklingError, name: str) -> CheckpointFileError:
    """What torch's weights-only unpickler refused, in nbdist's words (NeedsCode naming the callable, or corrupt):
    its own text is long, cut short by any one-line view, and recommends loading the file with weights_only=False,
    which would run the code."""
    message = str(error)
    for pattern in NAMED:
        found = re.search(pattern, message)
        if found:
            what = found.group(1).rstrip(".")
            return _needs_code(name, what if "." in what else f"builtins.{what}")  # torch says 'exec'
    return _corrupt(name, _weights_only_reason(message))


def _head(source) -> bytes:
    if isinstance(source, str):
        try:
            with open(source, "rb") as f:
                return f.read(len(ZIP_MAGIC))
        except OSError:
            return b""
    head = source.read(len(ZIP_MAGIC))
    source.seek(0)
    return head


def _weights_only_reason(message: str) -> str:
    """torch's own reason inside its long weights-only message (which also suggests loading it unsafely)."""
    reason = message.split("WeightsUnpickler error:")[-1]
    return " ".join(reason.split("Check the documentation")[0].split())[:200] or "not plain data"


# -- DCP's metadata -----------------------------------------------------------------------------------------------

DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # the checkpoint_id it was saved as
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes and torch's dtypes, layouts and memory formats; refuses every other name,
    before anything is called ('Restricting globals', Python's pickle documentation)."""

    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        import torch

        if name in DCP_METADATA_CLASSES.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None),
                                                 (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        raise _needs_code(self.name, f"{module}.{name}")

    def _enum_member(self, cls, name):
        """Some CPython 3.11 builds (Debian 12's 3.11.2) pickle an Enum member as getattr(its class, its name):
        given here only a member of an Enum class resolved above, never another attribute."""
        import enum

        if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
            return cls[name]
        raise _needs_code(self.name, f"builtins.getattr of {getattr(cls, '__name__', type(cls).__name__)}.{name}")

    def persistent_load(self, pid):
        raise _corrupt(self.name, "a persistent id, which DCP's metadata never has")


def read_metadata(folder: str):
    """DCP's metadata of a checkpoint, read as data (a pickle naming anything else is refused)."""
    from torch.distributed.checkpoint.metadata import Metadata

    regular(os.path.join(folder, METADATA), METADATA)
    try:
        with open(os.path.join(folder, METADATA), "rb") as f:
            metadata = _MetadataUnpickler(f, METADATA).load()
    except CheckpointFileError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated, garbage, missing
        raise _corrupt(METADATA, e) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise _corrupt(METADATA, f"a {type(metadata).__name__}, not DCP's metadata")
    return metadata


def read_trainer(folder: str) -> dict:
    """trainer.json: the step, the world size it was saved on, the files written; each field as a save writes it
    (a hand-edited value is refused here, naming the field, before anything is loaded from it)."""
    regular(os.path.join(folder, TRAINER), TRAINER)
    try:
        with open(os.path.join(folder, TRAINER), encoding="utf-8") as f:
            meta = json.load(f)
    except Exception as e:  # noqa: BLE001 - not JSON, not UTF-8, missing
        raise _corrupt(TRAINER, e) from None
    if not isinstance(meta, dict) or not all(_whole_number(meta.get(k)) for k in ("step", "world_size")):
        raise _corrupt(TRAINER, "no whole-number step and world_size")
    for field, least in TRAINER_FIELDS.items():
        if field in meta and not (_whole_number(meta[field]) and meta[field] >= least):
            raise _bad_field(field, meta[field], f"a whole number >= {least}")
    for field, least in (("files", 0), ("mesh", 1)):
        given = meta.get(field, {})
        if not isinstance(given, dict) or not all(isinstance(k, str) and _whole_number(v) and v >= least
                                                  for k, v in given.items()):
            raise _bad_field(field, given, f"names with whole numbers >= {least}")
    return meta


TRAINER_FIELDS = {"step": 0, "world_size": 1, "seed": 0, "batch_size": 1}  # field -> the least a save writes


def _whole_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_field(field: str, value, wanted: str) -> CheckpointFileError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return CheckpointFileError(f"{TRAINER} has {field} {shown}, which no save writes: it must be {wanted}")


# -- a whole checkpoint, in the kernel ----------------------------------------------------------------------------

def check(folder: str) -> None:
    """A checkpoint as the ranks will read it: trainer.json, the sizes it recorded, DCP's metadata and where its
    items lie, the values DCP keeps as bytes and every rank's files loaded as data, and every torch.save archive
    among them (each of DCP's items is one) read whole against the CRC-32 it was written with, which torch's loader
    does not look at: bytes overwritten inside a tensor are found here. Reads the whole checkpoint once.

    Raises NeedsCode for a file that would run code, whatever else is wrong; else the first CheckpointFileError
    (sizes that differ from what was written first: the clearest word on a truncated file)."""
    look = _Findings()
    meta = look(read_trainer, folder)
    metadata = look(read_metadata, folder)
    for name in sorted(os.listdir(folder)):
        if name.endswith(LOADED_BY_RANKS) and look(load, os.path.join(folder, name), name, "cpu") is not None:
            look(_whole, os.path.join(folder, name), name)
    if metadata is not None:
        _check_items(folder, metadata, look)
    found = (_wrong_sizes(folder, meta) if meta else []) + look.corrupt
    if found:
        raise found[0]


class _Findings:
    """Runs one check; keeps what is corrupt for later, lets a refusal (NeedsCode) through at once."""

    def __init__(self):
        self.corrupt: list[CheckpointFileError] = []

    def __call__(self, step, *args):
        try:
            return step(*args)
        except NeedsCode:
            raise
        except CheckpointFileError as e:
            self.corrupt.append(e)
            return None


def _wrong_sizes(folder: str, meta: dict) -> list[CheckpointFileError]:
    wrong = []
    for name, size in (meta.get("files") or {}).items():
        try:
            found = os.stat(os.path.join(folder, os.path.basename(name)))
        except OSError:
            wrong.append(_corrupt(name, "missing: it was written with the checkpoint"))
            continue
        if not stat.S_ISREG(found.st_mode):
            wrong.append(_not_regular(name, found.st_mode))
        elif found.st_size != size:
            wrong.append(_corrupt(name, f"{found.st_size} bytes, {size} were written"))
    return wrong


def _whole(source, name: str) -> bool:
    """Every record of a torch.save archive (a path, or bytes) matches the CRC-32 it was written with."""
    try:
        with zipfile.ZipFile(source) as archive:
            bad = archive.testzip()
    except Exception as e:  # noqa: BLE001 - not an archive, truncated
        raise _corrupt(name, e) from None
    if bad is not None:
        raise _corrupt(name, f"its record {bad} does not match the checksum it was written with")
    return True


def _check_items(folder: str, metadata, look: _Findings) -> None:
    """Each item DCP recorded lies inside its file and is whole; each loads as data: a value kept as bytes as what it
    is, a tensor's archive onto the meta device (its pickle read, none of its bytes copied) and found a tensor."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sizes: dict[str, int | None] = {}
    for index, info in metadata.storage_data.items():
        relative = str(getattr(info, "relative_path", ""))
        if not relative or os.path.basename(relative) != relative or relative in (".", ".."):
            look.corrupt.append(_corrupt(METADATA, f"an item stored at {relative!r}, outside the checkpoint"))
            continue
        if relative not in sizes:
            sizes[relative] = _size(os.path.join(folder, relative), relative, look)
        if sizes[relative] is None:  # not a regular file: said once, never opened
            continue
        end = info.offset + info.length
        if end > sizes[relative]:
            look.corrupt.append(_corrupt(relative, "missing: DCP's metadata names it" if sizes[relative] < 0 else
                                         f"{sizes[relative]} bytes, DCP's items reach {end}"))
            continue
        if info.transform_descriptors:  # compressed (nbdist writes none): DCP's own reader undoes it
            continue
        with open(os.path.join(folder, relative), "rb") as f:
            f.seek(info.offset)
            item, name = io.BytesIO(f.read(info.length)), f"{relative} ({getattr(index, 'fqn', '?')})"
        if isinstance(metadata.state_dict_metadata.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            look(load, item, name)
        else:
            look(_tensor, item, name)
        look(_whole, item, name)


def _size(path: str, name: str, look: _Findings) -> int | None:
    """A data file's size (-1: missing), or None for what is not a regular file (kept among the findings)."""
    try:
        found = os.stat(path)
    except OSError:
        return -1
    if stat.S_ISREG(found.st_mode):
        return found.st_size
    look.corrupt.append(_not_regular(name, found.st_mode))
    return None


def _tensor(item: io.BytesIO, name: str) -> None:
    """One of DCP's tensor items read as data, onto the meta device; what DCP would copy into the model must be a
    tensor."""
    import torch

    loaded = load(item, name, "meta")
    item.seek(0)
    if not isinstance(loaded, torch.Tensor):
        raise _corrupt(name, f"a {type(loaded).__name__} where DCP's metadata records a tensor")


# -- folders that cannot be written -------------------------------------------------------------------------------

def unwritable(directory: str, reason: str) -> str:
    return f"checkpoint folder {directory} is not writable ({reason})"

"""DCP's metadata is read as data whichever CPython wrote it: Debian 12's Python 3.11.2 pickles an Enum member as
`getattr(its class, its name)`, and nbdist refused its own fresh checkpoints there ("would run code to load (it
names builtins.getattr)"). The reader takes that form for the members of the Enum classes it allows, and nothing
else getattr could reach."""
from __future__ import annotations

import collections
import enum
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbdist.training import checkpoint_data
from nbdist.training.checkpoint_data import NeedsCode, read_metadata


class _AsDebiansPython(pickle.Pickler):
    """Pickles Enum members as CPython 3.11.2 does (Enum.__reduce_ex__ there returns getattr, (class, name))."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _metadata_as_written_by(pickler, folder) -> None:
    with open(os.path.join(folder, checkpoint_data.METADATA), "rb") as f:
        metadata = pickle.load(f)
    buffer = io.BytesIO()
    pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)
    with open(os.path.join(folder, checkpoint_data.METADATA), "wb") as f:
        f.write(buffer.getvalue())


@pytest.fixture
def saved(tmp_path):
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, checkpoint_id=str(tmp_path))
    return tmp_path


def test_metadata_whose_enums_are_pickled_through_getattr_reads_the_same(saved):
    plain = read_metadata(str(saved))
    _metadata_as_written_by(_AsDebiansPython, saved)
    assert b"getattr" in (saved / checkpoint_data.METADATA).read_bytes()
    assert read_metadata(str(saved)) == plain
    assert {type(item.properties.memory_format) for item in plain.state_dict_metadata.values()} == {torch.memory_format}


class _Reaching(pickle.Pickler):
    """Pickles the metadata with one getattr that reaches past an Enum's members."""

    def __init__(self, *args, reach, **kwargs):
        super().__init__(*args, **kwargs)
        self.reach = reach

    def reducer_override(self, obj):
        from torch.distributed.checkpoint.metadata import Metadata

        if isinstance(obj, Metadata):
            return getattr, self.reach
        return NotImplemented


@pytest.mark.parametrize("reach", ["OrderedDict.fromkeys", "Metadata.__init__", "_MEM_FORMAT_ENCODING.__class__"])
def test_getattr_past_an_enums_members_is_refused(saved, reach):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    owner, name = reach.split(".")
    reach = ({"OrderedDict": collections.OrderedDict, "Metadata": Metadata, "_MEM_FORMAT_ENCODING": _MEM_FORMAT_ENCODING}[owner], name)
    _metadata_as_written_by(lambda f, protocol: _Reaching(f, protocol=protocol, reach=reach), saved)
    with pytest.raises(NeedsCode) as refused:
        read_metadata(str(saved))
    assert str(refused.value).startswith(".metadata would run code to load (it names ")
    assert "a checkpoint must hold data only" in str(refused.value)

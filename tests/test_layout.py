"""Layout: one frozen object for how a model is laid over the ranks, taken by nbdist.shard and the Trainer and
given by the cluster-scale planner. Its checks are one line each; its ranks are laid out as every mesh is."""
from __future__ import annotations

import pytest

from nbdist.cluster.meshes.mesh import make_mesh
from nbdist.errors import DistUsageError
from nbdist.layout import Layout
from nbdist.planner.model import gpt
from nbdist.planner.shapes import shape


def test_a_layout_from_keywords_a_dict_or_a_layout_is_the_same():
    assert Layout.of(dp=2, tp=2) == Layout.of({"dp": 2}, tp=2) == Layout.of(Layout(dp=2, tp=2)) == Layout(2, 1, 2)
    assert Layout(dp=2).with_(zero=3) == Layout(dp=2, zero=3)
    assert Layout(balance=[1, 2]).balance == (1, 2)  # frozen all the way down


@pytest.mark.parametrize("choices, line", [
    (dict(dq=2), "unknown layout choice 'dq'"),
    (dict(dp=0), "dp"),
    (dict(zero=4), "zero must be a ZeRO stage 0, 1, 2 or 3, got 4"),
    (dict(chunks=1.5), "chunks"),
])
def test_bad_choices_are_refused_in_one_line(choices, line):
    with pytest.raises(DistUsageError, match=line) as raised:
        Layout.of(**choices)
    assert "\n" not in str(raised.value)


def test_its_ranks_are_laid_out_as_a_mesh_of_the_same_dimensions():
    made = Layout(dp=2, pp=2, tp=2)
    mesh = make_mesh(8, pp=2, dp=2, tp=2)
    assert made.ranks == 8 and made.mesh() == mesh
    assert [made.coords(r) for r in range(8)] == [mesh.coords(r) for r in range(8)]


def test_the_planners_shape_gives_the_layout_that_shard_takes():
    s = shape(gpt(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200), gpus=64, tp=2, pp=4, global_batch=512,
              microbatch=1, chunks=2)
    assert s.layout == Layout(dp=s.dp, pp=4, tp=2, schedule="interleaved-1f1b", microbatches=s.microbatches,
                              chunks=2)
    assert s.layout.ranks == 64


def test_shards_layout_keywords_are_the_layouts_fields_with_its_defaults():
    import inspect
    from dataclasses import fields

    from nbdist.sharding.plan import LAYOUT_FIELDS, shard

    keywords = inspect.signature(shard).parameters
    assert LAYOUT_FIELDS == tuple(f.name for f in fields(Layout))
    assert {f.name: f.default for f in fields(Layout)} == {name: keywords[name].default for name in LAYOUT_FIELDS}


def test_shard_takes_a_layout_or_keywords_alike(cluster):
    import nbdist

    def model_fn():
        from nbdist import models

        return models.mlp(width=16, layers=2, inputs=8, outputs=8, seed=0)

    by_layout = nbdist.shard(model_fn, Layout(dp=2))
    by_keywords = nbdist.shard(model_fn, dp=2)
    assert by_layout.layout == by_keywords.layout == Layout(dp=2)
    assert by_layout.ranks() == by_keywords.ranks()
    with pytest.raises(DistUsageError, match="in one place"):
        nbdist.shard(model_fn, Layout(dp=2), tp=2)

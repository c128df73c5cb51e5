"""A mesh lays named dimensions over the ranks; on a real 4-engine cluster its torch groups and MPI communicators
hold exactly the ranks the mesh says, in coordinate order, and the engine registry holds each mesh once."""
import pytest

import nbdist
from nbdist.cluster.meshes.mesh import make_mesh
from nbdist.errors import DistUsageError

# -- the mesh (plain data) -----------------------------------------------------------------------------------------


def test_tp_is_innermost_and_pp_outermost_whatever_the_order_given():
    m = make_mesh(8, tp=2, dp=2, pp=2)
    assert m.names == ("pp", "dp", "tp")
    assert m.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one host
    assert m.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.coords(5) == {"pp": 1, "dp": 0, "tp": 1} and m.rank_at(pp=1, dp=0, tp=1) == 5


def test_other_names_sit_between_dp_and_tp_in_the_order_given():
    assert make_mesh(16, tp=2, cp=2, dp=2, ep=2).names == ("dp", "cp", "ep", "tp")


def test_every_rank_has_one_coordinate_per_dimension_and_groups_partition_the_mesh():
    m = make_mesh(12, dp=3, pp=2, tp=2)
    for dim in m.names:
        groups = m.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(12))
        assert all(len(g) == m.dim_size(dim) for g in groups)
        for group in groups:
            assert [m.coords(r)[dim] for r in group] == list(range(m.dim_size(dim)))
    assert [m.rank_at(**m.coords(r)) for r in range(12)] == list(range(12))


def test_a_mesh_may_use_fewer_ranks_than_the_world():
    m = make_mesh(4, pp=2)
    assert m.size == 2 and m.coords(3) is None and m.group_of("pp", 3) == []
    assert "2 of the 4 ranks outside it" in str(m)


@pytest.mark.parametrize("dims, message", [
    ({"dp": 4, "pp": 2}, "mesh pp=2 × dp=4 needs 8 ranks but the cluster has 4"),
    ({"dp": 0}, "dp=0 must be a whole number >= 1"),
    ({"dp": 2.0}, "dp=2.0 must be a whole number >= 1"),
    ({"dp": True}, "dp=True must be a whole number >= 1"),
    ({}, "a mesh needs at least one dimension"),
])
def test_impossible_meshes_get_one_line(dims, message):
    with pytest.raises(DistUsageError, match=message):
        make_mesh(4, **dims)


def test_a_mesh_prints_as_a_table_and_draws_one_cell_per_rank():
    m = make_mesh(4, dp=2, pp=2)
    lines = str(m).splitlines()
    assert lines[1].split() == ["rank", "pp", "dp"] and lines[3].split() == ["1", "0", "1"]
    fig = m.figure()
    cells = [text for row in fig.data[0].text for text in row]
    assert len(cells) == 4 and all(f"rank {r}<br>" in "".join(cells) for r in range(4))
    assert "<table>" in m._repr_html_()


# -- on the ranks --------------------------------------------------------------------------------------------------


def _view(m):
    """On each rank: its coordinates, its torch groups' ranks, its MPI communicators' (rank, size), and sums over
    each torch group and each MPI communicator of (rank + 1)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from nbdist.cluster.meshes.ranks import rank_mesh

    me = rank_mesh.here(m)
    out = {"coords": me.coords}
    for dim in m.names:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t, group=me.group(dim))
        comm = me.comm(dim)
        out[dim] = {
            "torch_ranks": dist.get_process_group_ranks(me.group(dim)),
            "ranks": me.ranks(dim),
            "mpi": (comm.rank, comm.size),
            "torch_sum": t.item(),
            "mpi_sum": comm.allreduce(dist.get_rank() + 1, op=MPI.SUM),
        }
    return out


def test_groups_and_communicators_on_the_ranks_match_the_mesh(cluster4):
    m = nbdist.mesh(cluster4, dp=2, pp=2)
    for rank, seen in enumerate(cluster4.run(_view, m)):
        assert seen["coords"] == m.coords(rank)
        for dim in m.names:
            group = m.group_of(dim, rank)
            expected_sum = sum(r + 1 for r in group)
            assert seen[dim]["torch_ranks"] == seen[dim]["ranks"] == group
            assert seen[dim]["mpi"] == (m.coords(rank)[dim], m.dim_size(dim))
            assert seen[dim]["torch_sum"] == seen[dim]["mpi_sum"] == expected_sum


def test_a_mesh_is_made_once_and_listed_in_what_the_ranks_hold(cluster4):
    first = nbdist.mesh(cluster4, pp=2, dp=2)
    again = nbdist.mesh(cluster4, dp=2, pp=2)
    assert first == again
    held = [row for row in cluster4.holdings() if row["kind"] == "mesh" and row["name"] == first.name]
    assert sorted(row["rank"] for row in held) == [0, 1, 2, 3]
    assert "this rank at pp=1, dp=1" in next(row["what"] for row in held if row["rank"] == 3)
    assert first.name in str(cluster4.status())


def test_ranks_outside_a_smaller_mesh_hold_nothing_of_it(cluster4):
    m = nbdist.mesh(cluster4, pp=2)
    held = {row["rank"] for row in cluster4.holdings() if row["name"] == m.name}
    assert held == {0, 1}
    seen = cluster4.run(_view, m, ranks=[0, 1])
    assert [s["pp"]["torch_ranks"] for s in seen] == [[0, 1], [0, 1]]

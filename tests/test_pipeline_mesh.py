"""Pipelines on a mesh: dp=2 replicas x pp=2 stages on 4 real engines train exactly like one process on the same
global batches (float32, atol 1e-5), with every schedule, both transports and the stepper."""
import pytest
import torch
from torch import nn

import nbdist
from nbdist.pipeline_parallel.ranks import pipeline as on_ranks
from nbdist.errors import DistUsageError
from nbdist.cluster.options import ClusterOptions

ATOL = 1e-5
STEPS = 3
LOSS = nn.functional.mse_loss


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i in range(6):
        layers += [nn.Linear(10, 10), nn.Tanh()] if i < 5 else [nn.Linear(10, 2)]
    return nn.Sequential(*layers)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def global_batches(size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(7)
    return [(torch.randn(size, 10), torch.randn(size, 2)) for _ in range(STEPS)]


def serial(batches) -> tuple[list[float], dict, dict]:
    """One process, the whole global batch per step: losses, final weights, last gradients."""
    model = build_model()
    opt = adam(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = LOSS(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    grads = {k: p.grad for k, p in model.named_parameters()}
    return losses, model.state_dict(), grads


@pytest.fixture(scope="module")
def reference():
    return serial(global_batches())


def assert_close_dicts(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=ATOL, rtol=0)


def replica_weights(cluster4, pipe, replica: int) -> dict:
    return cluster4.run(on_ranks.parameters, pipe.id, False, ranks=pipe.pipelines[replica])


@pytest.mark.parametrize("schedule, chunks, transport", [
    ("1f1b", 1, "auto"), ("gpipe", 1, "auto"), ("interleaved-1f1b", 2, "auto"), ("zb-h1", 1, "auto"),
    ("1f1b", 1, "torch"),
])
def test_dp_by_pp_equals_one_process(cluster4, reference, schedule, chunks, transport):
    m = nbdist.mesh(cluster4, dp=2, pp=2)
    pipe = nbdist.pipeline(build_model, mesh=m, schedule=schedule, microbatches=4, chunks=chunks,
                           optimizer=adam, transport=transport, cluster=cluster4)
    assert pipe.replicas == 2 and pipe.pipelines == [[0, 2], [1, 3]]
    losses = [pipe.step(x, y, LOSS) for x, y in global_batches()]
    expected_losses, expected_weights, expected_grads = reference
    assert losses == pytest.approx(expected_losses, abs=ATOL)
    assert_close_dicts(pipe.state_dict(), expected_weights)
    assert_close_dicts(pipe.grads(), expected_grads)
    pipe.close()


def test_the_replicas_stay_identical(cluster4):
    m = nbdist.mesh(cluster4, dp=2, pp=2)
    pipe = nbdist.pipeline(build_model, mesh=m, schedule="1f1b", microbatches=2, optimizer=adam, cluster=cluster4)
    for x, y in global_batches():
        pipe.step(x, y, LOSS)
    first, second = replica_weights(cluster4, pipe, 0), replica_weights(cluster4, pipe, 1)
    for a, b in zip(first, second):
        assert a.keys() == b.keys()
        for stage in a:
            for key in a[stage]:
                assert torch.equal(a[stage][key], b[stage][key]), (stage, key)
    pipe.close()


def test_the_timeline_shows_both_replicas(cluster4):
    m = nbdist.mesh(cluster4, dp=2, pp=2)
    pipe = nbdist.pipeline(build_model, mesh=m, schedule="1f1b", microbatches=4, cluster=cluster4)
    x, y = global_batches()[0]
    pipe.step(x, y, LOSS)
    timeline = pipe.timeline
    assert sorted(timeline.spans) == [0, 1, 2, 3] and timeline.pipelines == [[0, 2], [1, 3]]
    assert [str(s.action) for s in timeline.spans[1]] == [str(s.action) for s in timeline.spans[0]]
    figure = timeline.figure()
    labels = {label for trace in figure.data for label in trace.y}
    assert labels == {"rank 0 (replica 0)", "rank 1 (replica 1)", "rank 2 (replica 0)", "rank 3 (replica 1)"}
    hovers = " ".join(h for trace in figure.data for h in trace.hovertext)
    assert "from rank 2" in hovers and "from rank 3" in hovers  # each replica's messages name its own ranks
    pipe.close()


def test_stepping_a_dp_pipeline_to_the_end_equals_its_full_step(cluster4, reference):
    m = nbdist.mesh(cluster4, dp=2, pp=2)
    batches = global_batches()
    stepped = nbdist.pipeline(build_model, mesh=m, schedule="1f1b", microbatches=4, optimizer=adam, cluster=cluster4)
    losses = []
    for x, y in batches:
        st = stepped.stepper(x, y, LOSS)
        st.next(3)
        losses.append(st.run())
    expected_losses, expected_weights, _ = reference
    assert losses == pytest.approx(expected_losses, abs=ATOL)
    assert_close_dicts(stepped.state_dict(), expected_weights)
    assert sorted(stepped.timeline.spans) == [0, 1, 2, 3] and stepped.timeline.cuts
    stepped.close()


def test_without_a_mesh_a_pipeline_uses_the_first_ranks(cluster4):
    pipe = nbdist.pipeline(build_model, 2, "1f1b", microbatches=2, cluster=cluster4)
    assert pipe.replicas == 1 and pipe.pipelines == [[0, 1]] and pipe.ranks == [0, 1]
    pipe.step(*global_batches()[0], LOSS)
    assert sorted(pipe.timeline.spans) == [0, 1]
    assert {row["rank"] for row in cluster4.holdings() if row["name"] == pipe.id} == {0, 1}
    pipe.close()
    assert not [row for row in cluster4.holdings() if row["name"] == pipe.id]


@pytest.mark.parametrize("make, message", [
    (lambda c: dict(mesh=nbdist.mesh(c, dp=2, pp=2), schedule="pipedream"), "pipedream updates weights"),
    (lambda c: dict(mesh=nbdist.mesh(c, dp=4)), "a pipeline runs along a mesh's pp dimension"),
    (lambda c: dict(mesh=nbdist.mesh(c, pp=2, tp=2)), "tp=2 needs a tensor-parallel plan for each stage"),
    (lambda c: dict(mesh=nbdist.mesh(c, dp=2, pp=2), stages=4), "stages=4 but the mesh has pp=2"),
    (lambda c: dict(mesh="dp=2", stages=None), "mesh must be made by nbdist.mesh"),
    (lambda c: dict(stages=2, transport="carrier-pigeon"), "unknown transport 'carrier-pigeon'"),
    (lambda c: dict(stages=None), "give stages=p"),
])
def test_bad_mesh_pipelines_get_one_line(cluster4, make, message):
    with pytest.raises(DistUsageError, match=message):
        nbdist.pipeline(build_model, cluster=cluster4, **make(cluster4))


def test_a_batch_must_split_over_replicas_and_microbatches(cluster4):
    pipe = nbdist.pipeline(build_model, mesh=nbdist.mesh(cluster4, dp=2, pp=2), microbatches=4, cluster=cluster4)
    x, y = torch.randn(12, 10), torch.randn(12, 2)
    with pytest.raises(DistUsageError, match="batch of 12 inputs does not split into 2 replicas × 4 equal"):
        pipe.step(x, y, LOSS)
    pipe.close()


def test_objects_made_before_a_restart_say_so_in_one_line():
    cluster = nbdist.Cluster(ClusterOptions(n=2)).start()
    try:
        m = nbdist.mesh(cluster, dp=2)
        pipe = nbdist.pipeline(build_model, 2, "gpipe", microbatches=2, cluster=cluster)
        cluster.restart()
        with pytest.raises(DistUsageError, match="mesh mesh:dp=2 was made before the engines were restarted"):
            nbdist.pipeline(build_model, mesh=m, cluster=cluster)
        with pytest.raises(DistUsageError, match=f"pipeline {pipe.id} was made before the engines were restarted"):
            pipe.step(*global_batches()[0], LOSS)
        assert cluster.holdings() == []
    finally:
        cluster.stop()


def test_the_live_view_shows_every_rank_of_every_replica(cluster4):
    pipe = nbdist.pipeline(build_model, mesh=nbdist.mesh(cluster4, dp=2, pp=2), schedule="gpipe", microbatches=2,
                           cluster=cluster4)
    st = pipe.stepper(*global_batches()[0], LOSS)
    view = st.widget()
    st.next(2)
    st.run()
    html = view.static_html()
    assert all(f"<td>rank {r}</td>" in html for r in range(4))
    measured = view._figures[0]
    assert {label for trace in measured.data for label in trace.y} == {
        "rank 0 (replica 0)", "rank 1 (replica 1)", "rank 2 (replica 0)", "rank 3 (replica 1)"}
    pipe.close()

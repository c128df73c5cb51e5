"""Training on `--backend mpi` (torch.distributed over MPI, backend/ranks/mpi_backend.py) equals one process: DDP, FSDP2
(reshard after forward on and off), DTensor tensor parallelism and the pipeline, three optimizer steps each
(float32, atol 1e-5). The libraries run unchanged: every collective they issue goes through the MPI backend."""
import pytest
import torch
from torch import nn

import nbdist
from nbdist.cluster.options import ClusterOptions

ATOL = 1e-5
STEPS = 3
WIDTH = 16


def build_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(8, WIDTH), torch.randn(8, WIDTH)) for _ in range(STEPS)]


def serial_weights() -> dict[str, torch.Tensor]:
    model = build_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def mpi_cluster():
    cluster = nbdist.Cluster(ClusterOptions(n=2, backend="mpi")).start()
    yield cluster
    cluster.stop()


def assert_weights(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=ATOL, rtol=0)


# -- on the ranks: each trains with its share of every batch (data parallel) or the whole batch (tensor parallel) --


def train_ddp(build, data) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    assert dist.get_backend() == "mpi4py"
    model = DistributedDataParallel(build())
    train_on_my_share(model, data)
    return {k: v.detach() for k, v in model.module.state_dict().items()}


def train_fsdp2(build, data, reshard: bool) -> dict:
    """FSDP2 per layer and at the root (as nbdist's ZeRO-2/3 apply it), on an explicitly CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nbdist.data_parallel.ranks import zero

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = zero.shard(build(), mesh, 3 if reshard else 2)  # stage 3 reshards after forward, stage 2 does not
    train_on_my_share(model, data)
    return {k: v.full_tensor().detach() for k, v in model.state_dict().items()}


def train_on_my_share(model, data) -> None:
    """SGD steps, each rank on its share of every batch (data parallel)."""
    import torch.distributed as dist

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, size = dist.get_rank(), dist.get_world_size()
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
        optimizer.step()


def train_tensor_parallel(build, data) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}


# -- the claims -------------------------------------------------------------------------------------------------------


def test_ddp_on_the_mpi_backend_equals_one_process(mpi_cluster):
    for weights in mpi_cluster.run(train_ddp, build_mlp, batches()):
        assert_weights(weights, serial_weights())


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_on_the_mpi_backend_equals_one_process(mpi_cluster, reshard):
    for weights in mpi_cluster.run(train_fsdp2, build_mlp, batches(), reshard):
        assert_weights(weights, serial_weights())


def test_tensor_parallel_mlp_on_the_mpi_backend_equals_one_process(mpi_cluster):
    for weights in mpi_cluster.run(train_tensor_parallel, build_mlp, batches()):
        assert_weights(weights, serial_weights())


@pytest.mark.parametrize("transport", ["torch", "mpi"])
def test_pipeline_on_the_mpi_backend_equals_one_process(mpi_cluster, transport):
    pipe = nbdist.pipeline(build_mlp, 2, "1f1b", microbatches=4, cluster=mpi_cluster, transport=transport,
                           optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    for x, y in batches():
        pipe.step(x, y, nn.functional.mse_loss)
    assert_weights(pipe.state_dict(), serial_weights())
    pipe.close()

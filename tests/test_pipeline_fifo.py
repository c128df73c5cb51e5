"""The torch transport as NCCL will run it, on CPU: one gloo group per pipeline, messages posted in rounds and matched
in order per pair (no tags), every schedule checked by `check_nccl` first. Each claim is against one process
(float32)."""
import pytest
import torch
from test_pipeline import ATOL, LOSS, assert_same_grads, build_model, serial

import nbdist
from nbdist.cluster.options import ClusterOptions
from nbdist.errors import DistUsageError
from nbdist.schedules import NAMES, Schedule


@pytest.fixture(scope="module")
def three():
    cluster = nbdist.Cluster(ClusterOptions(n=3)).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(1)
    return torch.randn(24, 12), torch.randn(24, 3)


@pytest.mark.parametrize("name, stages", [(n, p) for n in NAMES if n != "pipedream" for p in (2, 3)])
def test_every_schedule_in_fifo_order_equals_serial(three, batch, name, stages):
    """p=3 puts interleaved stages around the ring (rank 2 -> rank 0): three groups each way."""
    chunks = 2 if name.startswith("interleaved") else 1
    microbatches = 2 * stages  # interleaved walks micro-batches in groups of p
    pipe = nbdist.pipeline(build_model, stages, name, microbatches=microbatches, chunks=chunks, transport="torch",
                           cluster=three)
    assert pipe.transport == "torch"
    loss = pipe.step(*batch, LOSS)
    expected_loss, expected_grads = serial(batch)
    assert loss == pytest.approx(expected_loss, abs=ATOL)
    assert_same_grads(pipe.grads(), expected_grads)
    pipe.close()


def test_stepped_then_abandoned_then_stepped_again(three, batch):
    """A stepper left midway holds receives FIFO matching cannot cancel: the next step runs on new pair groups and
    is still exact; stepping tick by tick on the torch transport is exact too."""
    pipe = nbdist.pipeline(build_model, 3, "1f1b", microbatches=4, transport="torch", cluster=three)
    abandoned = pipe.stepper(*batch, LOSS)
    abandoned.next(5)
    assert abandoned.state().in_flight  # messages sent, not yet received
    expected_loss, expected_grads = serial(batch)
    assert pipe.step(*batch, LOSS) == pytest.approx(expected_loss, abs=ATOL)
    assert_same_grads(pipe.grads(), expected_grads)
    stepper = pipe.stepper(*batch, LOSS)
    while not stepper.done:
        stepper.next()
    assert stepper.loss == pytest.approx(expected_loss, abs=ATOL)
    assert_same_grads(pipe.grads(), expected_grads)
    pipe.close()


@pytest.mark.parametrize("name, chunks", [("interleaved-1f1b", 2), ("zb-h1", 1), ("gpipe", 1)])
def test_stepping_tick_by_tick_on_the_torch_transport_equals_serial(three, batch, name, chunks):
    """Each call posts every round before its boundary and waits only for what is partnered (schedules/nccl.py):
    one tick per call, over the ring (interleaved: rank 2 -> rank 0) and a split backward, ends like a full step."""
    pipe = nbdist.pipeline(build_model, 3, name, microbatches=6, chunks=chunks, transport="torch", cluster=three)
    stepper = pipe.stepper(*batch, LOSS)
    while not stepper.done:
        stepper.next()
    expected_loss, expected_grads = serial(batch)
    assert stepper.loss == pytest.approx(expected_loss, abs=ATOL)
    assert_same_grads(pipe.grads(), expected_grads)
    pipe.close()


def test_two_pipelines_on_the_same_ranks_keep_their_messages_apart(three, batch):
    """Each pipeline has its own pair groups: one stepped halfway does not take the other's messages."""
    first = nbdist.pipeline(build_model, 2, "gpipe", microbatches=4, transport="torch", cluster=three)
    second = nbdist.pipeline(build_model, 2, "1f1b", microbatches=4, transport="torch", cluster=three)
    halfway = first.stepper(*batch, LOSS)
    halfway.next(4)
    expected_loss, _ = serial(batch)
    assert second.step(*batch, LOSS) == pytest.approx(expected_loss, abs=ATOL)
    assert halfway.run() == pytest.approx(expected_loss, abs=ATOL)
    first.close()
    second.close()


def test_a_schedule_that_would_mismatch_under_nccl_is_refused_before_building(three):
    """Rank 0 sends micro-batch 0 then 1; rank 1 receives 1 first: fine with MPI tags, wrong data under FIFO."""
    actions = {
        0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B1", "0B1", "0RECV_B0", "0B0"],
        1: ["1RECV_F1", "1F1", "1B1", "1SEND_B1", "1RECV_F0", "1F0", "1B0", "1SEND_B0"],
    }
    unsafe = Schedule.from_actions(actions, name="swapped")
    with pytest.raises(DistUsageError) as refused:
        nbdist.pipeline(build_model, 2, unsafe, microbatches=2, transport="torch", cluster=three)
    line = str(refused.value)
    assert "\n" not in line and "rank 1" in line and "1RECV_F1" in line and "tick" in line
    pipe = nbdist.pipeline(build_model, 2, unsafe, microbatches=2, transport="mpi", cluster=three)  # tags sort it
    assert pipe.step(torch.randn(8, 12), torch.randn(8, 3), LOSS) is not None
    pipe.close()

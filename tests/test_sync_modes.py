"""The Trainer's synchronisation strategies (nbdist/training/ranks/sync_modes.py, sync_ssp.py) on real MPI clusters of 2 and
4 engines, each against a reference that does not share its code:

- local SGD: torch's own post-local SGD (DDP with the post-local SGD hook, PostLocalSGDOptimizer over a
  PeriodicModelAverager), driven with the same data: equal parameters on every rank (float32, atol 1e-6);
- EASGD: the paper's equations 5-6 computed in this process for N simulated replicas: equal workers and center;
- synchronous all-reduce (with micro-batches) and SSP with staleness 0: one process doing SGD on the global batch;
- SSP with a straggler: no applied update older than the bound, the fast replicas ran ahead to it, and after
  finish() every replica holds the initial parameters plus every replica's updates (atol 1e-5);
- a rank that raises frees the others (no hang, no restart) and leaves their synchronizers refusing in one line;
- bad options are refused in one line naming them.

Functions sent to the ranks import what they use: ipyparallel looks their global names up on the engine. The model
and the data are functions passed along as arguments.
"""
from __future__ import annotations

import pytest
import torch

import nbdist

LR, MOMENTUM = 0.05, 0.9
LOCAL = 8  # samples per replica and step


def model_fn():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(rank: int, step: int, n: int = 8):
    """Replica `rank`'s share at `step`: its own samples of y = sin(sum x)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 6, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True))


# -- run on the ranks ----------------------------------------------------------------------------------------------


def train(model_fn, batch, kind: str, options: dict, steps: int, microbatches: int = 1, momentum: float = 0.9,
          slow: dict | None = None, finish: int = 1) -> dict:
    """`steps` steps of `kind` on this rank's shares; rank r sleeps slow[r] seconds before each step."""
    import time

    import torch
    from mpi4py import MPI

    from nbdist.training.ranks import sync_modes

    rank = MPI.COMM_WORLD.rank
    model = model_fn()
    initial = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    sync = sync_modes.make(kind, model, optimizer, MPI.COMM_WORLD, options)
    reports = []
    try:
        for step in range(steps):
            time.sleep((slow or {}).get(rank, 0.0))
            reports.append(sync.step(step, *batch(rank, step), torch.nn.functional.mse_loss, microbatches))
        before_finish = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        for _ in range(finish):
            sync.finish()
        state = sync.state()
        return {"reports": reports, "initial": initial, "before_finish": before_finish, "state": state,
                "params": torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(),
                "contributed": getattr(sync, "contributed", None)}
    finally:
        sync.close()


def torch_post_local_sgd(model_fn, batch, period: int, warmup: int, steps: int) -> torch.Tensor:
    """The same training with torch's post-local SGD on the default process group: DDP averages gradients for the
    first `warmup` steps (the hook), then the PeriodicModelAverager averages parameters after the optimizer."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = model_fn()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=warmup,
                                             post_local_gradient_allreduce=False), post_localSGD_hook)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      PeriodicModelAverager(period=period, warmup_steps=warmup))
    for step in range(steps):
        x, y = batch(dist.get_rank(), step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


# -- references in this process ------------------------------------------------------------------------------------


def gradient_at(model: torch.nn.Module, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.nn.utils.vector_to_parameters(point, model.parameters())
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def synchronous_sgd(replicas: int, steps: int) -> tuple[torch.Tensor, list[list[float]]]:
    """One process, SGD with momentum on the global batch (every replica's share, concatenated): the parameters,
    and at each step the loss on each replica's share before the step."""
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        x, y = zip(*(batch(r, step) for r in range(replicas)))
        with torch.no_grad():
            losses.append([torch.nn.functional.mse_loss(model(x[r]), y[r]).item() for r in range(replicas)])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(x)), torch.cat(y)).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), losses


def easgd_equations(replicas: int, steps: int, alpha: float, tau: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Zhang et al. 2015, eq. 5-6 with plain SGD (eta = LR), the elastic terms at steps t % tau == 0:
    x_i <- x_i - eta g_i(x_i) - alpha (x_i - c);  c <- c + alpha sum_i (x_i - c)."""
    model = model_fn()
    start = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    workers, center = [start.clone() for _ in range(replicas)], start.clone()
    for t in range(steps):
        grads = [gradient_at(model, workers[i], *batch(i, t)) for i in range(replicas)]
        pulls = [alpha * (w - center) if t % tau == 0 else torch.zeros_like(w) for w in workers]
        workers = [w - LR * g - p for w, g, p in zip(workers, grads, pulls)]
        center = center + sum(pulls)
    return workers, center


# -- clusters ------------------------------------------------------------------------------------------------------


@pytest.fixture(params=[2, 4], ids=["2 engines", "4 engines"])
def engines(request) -> tuple[int, nbdist.Cluster]:
    return request.param, request.getfixturevalue("cluster" if request.param == 2 else "cluster4")


# -- the claims ----------------------------------------------------------------------------------------------------


def test_local_sgd_trains_as_torchs_post_local_sgd(engines):
    n, cluster = engines
    period, warmup, steps = 3, 2, 7  # averages after steps 2 and 5; step 6 is local: the replicas differ
    mine = cluster.run(train, model_fn, batch, "local-sgd", {"period": period, "warmup": warmup}, steps, finish=0,
                       timeout=120)
    theirs = cluster.run(torch_post_local_sgd, model_fn, batch, period, warmup, steps, timeout=120)
    for rank in range(n):
        torch.testing.assert_close(mine[rank]["params"], theirs[rank], rtol=0, atol=1e-6, msg=f"rank {rank}")
    assert (mine[0]["params"] - mine[1]["params"]).abs().max() > 1e-4  # local steps since the last average
    assert all(r["comm_s"] > 0 for r in mine[0]["reports"][:3])  # warm-up, warm-up, first average
    assert mine[0]["reports"][3]["comm_s"] == 0  # step 3: local only


def test_local_sgd_finish_averages_the_replicas(cluster):
    results = cluster.run(train, model_fn, batch, "local-sgd", {"period": 4}, 6, finish=2, timeout=120)
    mean = sum(r["before_finish"] for r in results) / len(results)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["params"], mean, rtol=0, atol=1e-6, msg=f"rank {rank}")
    assert results[0]["state"] == {"kind": "local-sgd", "steps": 6}


def test_easgd_follows_the_papers_equations(engines):
    n, cluster = engines
    alpha, tau, steps = 0.2, 2, 7
    results = cluster.run(train, model_fn, batch, "easgd", {"alpha": alpha, "tau": tau}, steps, momentum=0.0,
                          timeout=120)
    workers, center = easgd_equations(n, steps, alpha, tau)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["before_finish"], workers[rank], rtol=0, atol=1e-6, msg=f"worker {rank}")
        torch.testing.assert_close(r["state"]["center"], center, rtol=0, atol=1e-6, msg=f"center on rank {rank}")
        assert torch.equal(r["params"], r["state"]["center"]), f"rank {rank} after finish: not the center"
    assert (workers[0] - center).abs().max() > 1e-4  # the workers did move apart from the center


@pytest.mark.parametrize("kind, options, microbatches", [("allreduce", {}, 2), ("ssp", {"staleness": 0}, 1)],
                         ids=["allreduce, 2 micro-batches", "ssp, staleness 0"])
def test_synchronous_strategies_train_as_one_process(engines, kind, options, microbatches):
    n, cluster = engines
    steps = 6
    results = cluster.run(train, model_fn, batch, kind, options, steps, microbatches, timeout=120)
    reference, losses = synchronous_sgd(n, steps)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["params"], reference, rtol=0, atol=1e-5, msg=f"rank {rank}")  # ssp: drained
        fresh = [[0] * (n - 1) if kind == "ssp" and step else [] for step in range(steps)]
        assert [report["staleness"] for report in r["reports"]] == fresh, f"rank {rank}"
        mine = [report["loss"] for report in r["reports"]]
        assert mine == pytest.approx([losses[step][rank] for step in range(steps)], abs=1e-5), f"rank {rank}"


def test_ssp_lets_fast_replicas_run_ahead_by_the_bound_and_drains_to_every_update(cluster4):
    bound, steps, slow = 2, 12, {3: 0.05}
    results = cluster4.run(train, model_fn, batch, "ssp", {"staleness": bound}, steps, slow=slow, finish=2, timeout=120)
    initial = results[0]["initial"]
    everything = initial + sum(r["contributed"] for r in results)
    for rank, r in enumerate(results):
        staleness = [s for report in r["reports"] for s in report["staleness"]]
        assert staleness and 0 <= min(staleness) and max(staleness) <= bound, f"rank {rank}: {staleness}"
        if rank not in slow:  # ran ahead of the straggler as far as allowed, and waited there
            assert max(staleness) == bound, f"rank {rank}: {staleness}"
            assert sum(report["idle_s"] for report in r["reports"]) > 0.25 * steps * slow[3], rank
        torch.testing.assert_close(r["params"], everything, rtol=0, atol=1e-5, msg=f"rank {rank} after finish")
        assert r["state"]["clock"] == steps and r["state"]["peer_clocks"] == [steps] * 4
    mean = [sum(every) / len(every) for every in ([s for report in r["reports"] for s in report["staleness"]]
                                                  for r in results)]
    assert mean[3] < min(mean[:3]) / 2, mean  # the straggler gets fresh updates: the others are ahead of it


# -- failures --------------------------------------------------------------------------------------------------------


def fails_while_others_wait(model_fn, batch, kind: str, options: dict, fail_rank: int, fail_step: int) -> int:
    """Rank `fail_rank` raises before step `fail_step`; the others go on and wait for it inside the strategy (SSP
    after running `staleness` clocks ahead). Every rank keeps its synchronizer in its registry."""
    import torch
    from mpi4py import MPI

    from nbdist.runtime.ranks import registry
    from nbdist.training.ranks import sync_modes

    rank = MPI.COMM_WORLD.rank
    model = model_fn()
    sync = registry.put("test-sync", kind, sync_modes.make(
        kind, model, torch.optim.SGD(model.parameters(), lr=0.05), MPI.COMM_WORLD, options))
    for step in range(fail_step + options.get("staleness", 0) + 2):
        if rank == fail_rank and step == fail_step:
            raise ValueError(f"broken at step {step}")
        sync.step(step, *batch(rank, step), torch.nn.functional.mse_loss)
    return step


def step_again(model_fn, batch, kind: str) -> tuple[int, str]:
    """(pid, what happens when the kept synchronizer is used again), then close it. Only a broken one is stepped:
    a whole one would wait in its next collective for the broken ones."""
    import os

    import torch

    from nbdist.runtime.ranks import registry

    sync = registry.get("test-sync", kind)
    error = "none"
    if sync.broken is not None:
        try:
            sync.step(99, *batch(0, 0), torch.nn.functional.mse_loss)
        except Exception as e:  # noqa: BLE001 - the message is the claim
            error = f"{type(e).__name__}: {e}"
    sync.close()
    registry.drop("test-sync", kind)
    return os.getpid(), error


def pid() -> int:
    import os

    return os.getpid()


@pytest.mark.parametrize("kind, options", [("local-sgd", {"period": 1}), ("easgd", {"alpha": 0.2}),
                                           ("ssp", {"staleness": 1})])
def test_a_rank_that_raises_frees_the_waiting_ones(cluster, kind, options):
    pids = cluster.run(pid)
    with pytest.raises(nbdist.DistError, match=r"rank 1 raised ValueError: broken at step 3.*interrupted rank\(s\) 0"):
        cluster.run(fails_while_others_wait, model_fn, batch, kind, options, 1, 3, timeout=60)
    after = cluster.run(step_again, model_fn, batch, kind, timeout=30)
    assert [p for p, _ in after] == pids  # the same engines: freed, not restarted
    error = after[0][1]
    assert error.startswith(f"DistUsageError: {kind}: this synchronizer was interrupted in ") and "\n" not in error
    assert "rank 0" in error and "make a new one" in error
    assert after[1][1] == "none"  # rank 1 raised before communicating: its synchronizer is still whole


def bad_options(cases: list) -> list[str]:
    import torch
    from mpi4py import MPI

    from nbdist.training.ranks import sync_modes

    messages = []
    for kind, options in cases:
        model = torch.nn.Linear(2, 1)
        try:
            sync_modes.make(kind, model, torch.optim.SGD(model.parameters(), lr=0.1), MPI.COMM_WORLD, options)
            messages.append("accepted")
        except Exception as e:  # noqa: BLE001 - the message is the claim
            messages.append(f"{type(e).__name__}: {e}")
    model = torch.nn.Linear(2, 1)
    sync = sync_modes.make("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1), MPI.COMM_WORLD, {})
    try:  # every rank refuses before communicating: no rank is left waiting
        sync.step(0, torch.zeros(8, 2), torch.zeros(8, 1), torch.nn.functional.mse_loss, microbatches=9)
        messages.append("accepted")
    except Exception as e:  # noqa: BLE001 - the message is the claim
        messages.append(f"{type(e).__name__}: {e}")
    sync.close()
    return messages


def test_bad_kinds_and_options_are_refused_in_one_line(cluster):
    cases = [("adasum", {}), ("local-sgd", {"perod": 2}), ("local-sgd", {"period": 0}), ("local-sgd", {"warmup": -1}),
             ("easgd", {"alpha": 0.6}), ("easgd", {"tau": True}), ("ssp", {"staleness": 1.5}),
             ("allreduce", {"period": 2})]
    expected = ["'adasum'", "'perod'", "period", "warmup", "alpha=0.6 for 2 replicas", "tau", "staleness", "'period'",
                "microbatches must be an integer from 1 to this replica's 8 samples, got 9"]
    for messages in cluster.run(bad_options, cases):
        assert len(messages) == len(expected)
        for (kind, _), message, named in zip(cases + [("allreduce", {})], messages, expected):
            assert message.startswith("DistUsageError: ") and "\n" not in message, message
            assert named in message, (kind, message)

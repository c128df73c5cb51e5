"""What stands between a start and the first training step, and does not have to (issue 21's first-step figure):
the kernel loads a Trainer's modules while the engines start, a fit that waits sends the ranks their work before it
draws its dashboard, and a plan's profile copies no weights it replaces."""
from __future__ import annotations

import subprocess
import sys
import time
from functools import partial

import pytest
import torch
from torch import nn

import nbdist
from nbdist import data, models
from nbdist.cluster.launching import warm
from nbdist.sharding import profile
from nbdist.training import dashboard


def _modules_loaded_by_the_loader(setup: str) -> dict:
    """In a fresh Python: after `setup`, run warm.loader to its end; which of its modules it loaded, in how many
    steps (a step per module)."""
    code = f"""
import json, sys
{setup}
from nbdist.cluster.launching import warm
names = warm.LOADED_WHILE_STARTING
before = {{n for n in names if n in sys.modules}}
step = warm.loader(names)
steps = 0
while step():
    steps += 1
print(json.dumps({{"before": sorted(before), "after": sorted(n for n in names if n in sys.modules), "steps": steps,
                  "torch": "torch" in sys.modules}}))
"""
    import json

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_kernel_loads_a_trainers_modules_while_the_engines_start_one_per_step():
    loaded = _modules_loaded_by_the_loader("import torch")
    assert loaded["before"] == []
    assert loaded["after"] == sorted(warm.LOADED_WHILE_STARTING)
    assert loaded["steps"] == len(warm.LOADED_WHILE_STARTING)  # not in an IPython kernel: no dashboard


def test_a_kernel_without_torch_is_not_made_to_import_it_while_waiting():
    loaded = _modules_loaded_by_the_loader("")
    assert loaded == {"before": [], "after": [], "steps": 0, "torch": False}


def _slow(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return time.perf_counter()


def test_a_live_view_is_called_as_soon_as_the_work_is_sent(cluster):
    """The wait calls `progress` once before it first waits: a dashboard opened by it does not hold back the ranks,
    nor wait for the first half second of their work."""
    calls: list[float] = []
    sent = time.perf_counter()
    ended = cluster.run_each(_slow, {0: (1.0,), 1: (1.0,)}, progress=lambda ar: calls.append(time.perf_counter()))
    assert calls, "progress was never called"
    assert calls[0] - sent < 0.3, f"first progress call {calls[0] - sent:.2f} s after sending"
    assert calls[0] < min(ended), "the first progress call came only after the ranks' work ended"


def test_a_waiting_fit_draws_its_dashboard_after_the_ranks_have_their_work(cluster, monkeypatch):
    order: list[str] = []
    run_each, open_dashboard = type(cluster).run_each, dashboard.Dashboard.open.__func__

    def sending(self, *args, **kwargs):
        order.append("work sent")
        return run_each(self, *args, **kwargs)

    def opening(cls, *args, **kwargs):
        order.append("dashboard opened")
        return open_dashboard(cls, *args, **kwargs)

    monkeypatch.setattr(type(cluster), "run_each", sending)
    monkeypatch.setattr(dashboard.Dashboard, "open", classmethod(opening))
    tr = nbdist.Trainer(partial(models.mlp, width=16, layers=2, inputs=8, outputs=1, seed=0),
                        partial(data.regression_dataset, samples=64, inputs=8), torch.nn.functional.mse_loss,
                        partial(torch.optim.SGD, lr=0.01), batch_size=16, cluster=cluster, live="always")
    try:
        records = tr.fit(steps=2)
    finally:
        tr.close()
    assert order == ["work sent", "dashboard opened"]
    assert len(records) == 2 and all(r["loss"] is not None for r in records)


def test_a_plans_tensor_parallel_profile_slices_without_copying_the_replaced_weights():
    model = models.mlp(width=64, layers=2, inputs=16, outputs=4, seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sliced = profile._tp_sliced(model, 2)
    for name, p in model.named_parameters():  # the model itself untouched
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
    shapes = {name: tuple(layer.weight.shape) for name, layer in sliced.named_modules() if isinstance(layer, nn.Linear)}
    originals = {name: layer for name, layer in model.named_modules() if isinstance(layer, nn.Linear)}
    assert shapes.keys() == originals.keys()
    for name, layer in sliced.named_modules():
        if isinstance(layer, nn.Linear):
            rows, cols = layer.weight.shape
            torch.testing.assert_close(layer.weight, originals[name].weight[:rows, :cols], rtol=0, atol=0)
            assert layer.weight.data_ptr() != originals[name].weight.data_ptr()
    assert any(shapes[n] != tuple(originals[n].weight.shape) for n in shapes), "nothing was sliced"
    assert not any(isinstance(layer, nn.Identity) for layer in sliced.modules()), "a placeholder was left in"
    x = torch.randn(3, 16)
    assert sliced(x).shape == (3, 4)

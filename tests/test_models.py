"""nbdist.models and nbdist.data: the claims the pipeline and tensor-parallel features build on, checked against
references (the whole model against its pieces, the full attention against its head shards, a fresh process's
weights against ours, the standard library's files against the corpus). Fast: no cluster."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

from nbdist import data
from nbdist.errors import DistUsageError
from nbdist.models import GPTConfig, gpt, lm_loss, mlp
from nbdist.models.gpt import Attention, Block, Embedding, Head

TINY = dict(vocab=256, seq=16, layers=2, hidden=32, heads=4)


def tokens(batch: int = 3, length: int = 16, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def digest(model: nn.Module) -> str:
    """One hash of every parameter's bytes, in order: equal digests, identical weights."""
    h = hashlib.sha256()
    for key, value in model.state_dict().items():
        h.update(key.encode() + value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# -- layout ----------------------------------------------------------------------------------------------------------


def test_gpt_is_one_flat_sequential_with_the_named_parts():
    model = gpt(vocab=100, seq=12, layers=3, hidden=24, heads=3)
    assert [type(m) for m in model] == [Embedding, Block, Block, Block, Head]
    assert model.config == GPTConfig(vocab=100, seq=12, layers=3, hidden=24, heads=3, ff=96)
    block = model[1]
    for name in ("q", "k", "v", "out"):
        linear = getattr(block.attn, name)
        assert (linear.in_features, linear.out_features, linear.bias is not None) == (24, 24, True)
    assert (block.mlp.fc.in_features, block.mlp.fc.out_features) == (24, 96)
    assert isinstance(block.mlp.act, nn.GELU)
    assert (block.mlp.proj.in_features, block.mlp.proj.out_features) == (96, 24)
    assert isinstance(block.ln1, nn.LayerNorm) and isinstance(block.ln2, nn.LayerNorm)
    assert model[-1].lm.bias is None and model[-1].lm.weight.shape == (100, 24)
    assert gpt(hidden=32, heads=4, ff=40)[1].mlp.fc.out_features == 40


def test_gpt_logits_shape_and_a_shorter_sequence():
    model = gpt(**TINY)
    assert model(tokens(3, 16)).shape == (3, 16, 256)
    assert model(tokens(2, 5)).shape == (2, 5, 256)


def test_mlp_alternates_linear_and_relu_with_the_asked_sizes():
    model = mlp(width=8, layers=3, inputs=5, outputs=2)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    assert [(m.in_features, m.out_features) for m in model if isinstance(m, nn.Linear)] == [(5, 8), (8, 8), (8, 2)]
    assert model(torch.randn(4, 5)).shape == (4, 2)
    assert [type(m) for m in mlp(layers=1)] == [nn.Linear]
    assert mlp()(torch.randn(2, 64)).shape == (2, 64)


def test_gpt2_init_and_an_untrained_loss_of_ln_vocab():
    """GPT-2's init: weights normal(0, 0.02), biases zero, LayerNorms identity; near-zero logits then give a loss of
    about ln(vocab), the loss of a uniform guess."""
    model = gpt(vocab=256, seq=64, layers=2, hidden=128, heads=4)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln" in name:
            assert torch.all(p == 1), name
        else:
            assert abs(p.std().item() - 0.02) < 0.002 and abs(p.mean().item()) < 0.002, name
    x, y = data.token_batch(data.byte_corpus(), 0, batch=8, seq=64)
    assert abs(lm_loss(model(x), y).item() - math.log(256)) < 0.05


# -- determinism ----------------------------------------------------------------------------------------------------


def test_same_seed_same_weights_whatever_the_global_random_state_which_is_left_alone():
    torch.manual_seed(1)
    first, first_mlp = gpt(**TINY), mlp(width=16)
    torch.manual_seed(2)
    torch.randn(100)
    before = torch.get_rng_state()
    second, second_mlp = gpt(**TINY), mlp(width=16)
    assert torch.equal(torch.get_rng_state(), before)
    assert digest(first) == digest(second) and digest(first_mlp) == digest(second_mlp)
    assert digest(gpt(**TINY, seed=1)) != digest(first) and digest(mlp(width=16, seed=1)) != digest(first_mlp)


@pytest.mark.slow
def test_a_fresh_process_builds_the_same_weights_and_data():
    """What every rank relies on: another interpreter (another hash salt, another global seed) builds the same."""
    code = ("import json, torch, sys; sys.path.insert(0, sys.argv[1]); from test_models import digest, TINY\n"
            "from nbdist.models import gpt, mlp; from nbdist import data\ntorch.manual_seed(123)\n"
            "x, y = data.token_batch(data.byte_corpus(), 7, 4, 16, seed=3)\n"
            "print(json.dumps([digest(gpt(**TINY)), digest(mlp(width=16)), x.tolist(), "
            "data.regression_batch(2, 4)[1].tolist()]))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "77"}).stdout
    x, _ = data.token_batch(data.byte_corpus(), 7, 4, 16, seed=3)
    assert json.loads(out) == [digest(gpt(**TINY)), digest(mlp(width=16)), x.tolist(),
                               data.regression_batch(2, 4)[1].tolist()]


# -- the properties pipelines and tensor parallelism rely on ---------------------------------------------------------


def test_causal_a_later_token_does_not_change_earlier_logits():
    model = gpt(**TINY)
    x = tokens(2, 16)
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    before, after = model(x), model(changed)
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_the_model_cut_in_two_composes_to_the_whole():
    model = gpt(**TINY)
    x = tokens()
    assert torch.equal(model[3:](model[:3](x)), model(x))


def _randomize(module: nn.Module, seed: int = 9) -> None:
    """Random values in every parameter (biases too), so a bias counted twice, or a head mixed up, shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _column(linear: nn.Linear, part: slice) -> nn.Linear:
    """A column-parallel shard: some of the output features (as ColwiseParallel leaves each rank)."""
    out = nn.Linear(linear.in_features, part.stop - part.start)
    out.load_state_dict({"weight": linear.weight[part], "bias": linear.bias[part]})
    return out


def _row(linear: nn.Linear, part: slice, with_bias: bool) -> nn.Linear:
    """A row-parallel shard: some of the input features; the bias is added once, by one shard (as RowwiseParallel)."""
    out = nn.Linear(part.stop - part.start, linear.out_features)
    bias = linear.bias if with_bias else torch.zeros_like(linear.bias)
    out.load_state_dict({"weight": linear.weight[:, part], "bias": bias})
    return out


def _attention_shard(attn: Attention, part: slice, first: bool) -> Attention:
    shard = copy.deepcopy(attn)
    shard.q, shard.k, shard.v = (_column(getattr(attn, n), part) for n in ("q", "k", "v"))
    shard.out = _row(attn.out, part, with_bias=first)
    return shard


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_split_by_heads_sums_to_the_full_attention(tp):
    """Tensor parallelism by hand: q, k, v split by output features (whole heads per shard), out by input features;
    the same Attention code runs each shard (it reads the head count from the tensor) and the sum of the shards'
    outputs (RowwiseParallel's all-reduce) is the full attention."""
    hidden, heads = 32, 4
    attn = gpt(hidden=hidden, heads=heads, layers=1)[1].attn
    _randomize(attn)
    x = torch.randn(2, 10, hidden, generator=torch.Generator().manual_seed(4))
    width = hidden // tp
    shards = [_attention_shard(attn, slice(r * width, (r + 1) * width), first=r == 0) for r in range(tp)]
    assert shards[0].q(x).shape[-1] == hidden // tp
    torch.testing.assert_close(sum(s(x) for s in shards), attn(x), rtol=0, atol=1e-5)


def test_mlp_of_a_block_split_column_then_row_sums_to_the_whole():
    block_mlp = gpt(hidden=32, heads=4, layers=1)[1].mlp
    _randomize(block_mlp)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    halves = []
    for r, part in enumerate((slice(0, 64), slice(64, 128))):
        half = copy.deepcopy(block_mlp)
        half.fc, half.proj = _column(block_mlp.fc, part), _row(block_mlp.proj, part, with_bias=r == 0)
        halves.append(half)
    torch.testing.assert_close(halves[0](x) + halves[1](x), block_mlp(x), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_tiny_gpt_learns_the_bytes_of_python_source():
    """30 Adam steps on token_batch: the loss falls well below ln(256), where an untrained model starts."""
    torch.manual_seed(0)
    model, corpus = gpt(**TINY), data.byte_corpus(1 << 18)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        x, y = data.token_batch(corpus, step, batch=16, seq=16)
        loss = lm_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(256)) < 0.1
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_lm_loss_is_the_mean_cross_entropy():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    by_hand = -torch.stack([logits[b, t].log_softmax(-1)[targets[b, t]] for b in range(2) for t in range(3)]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), by_hand)


# -- bad input: one line ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build, names", [
    (lambda: gpt(hidden=65, heads=4), "hidden (65) must be divisible by heads (4)"),
    (lambda: gpt(vocab=0), "gpt vocab"),
    (lambda: gpt(seq=-1), "gpt seq"),
    (lambda: gpt(layers=0), "gpt layers"),
    (lambda: gpt(heads=0), "gpt heads"),
    (lambda: gpt(hidden=2.5), "gpt hidden"),
    (lambda: gpt(ff=0), "gpt ff"),
    (lambda: gpt(seed=-1), "seed"),
    (lambda: mlp(width=0), "mlp width"),
    (lambda: mlp(layers=0), "mlp layers"),
    (lambda: mlp(outputs=True), "mlp outputs"),
    (lambda: gpt(**TINY)(tokens(1, 17)), "17 tokens per sequence, but the model was built for seq=16"),
    (lambda: data.token_batch(torch.arange(8), 0, 2, 8), "too few for windows of seq+1 = 9"),
    (lambda: data.token_batch(torch.rand(100), 0, 2, 8), "1-D tensor of token ids"),
    (lambda: data.token_batch(torch.arange(100), -1, 2, 8), "step"),
    (lambda: data.regression(noise=-0.1), "noise"),
    (lambda: data.regression(samples=0), "samples"),
    (lambda: data.byte_corpus(0), "max_bytes"),
])
def test_bad_input_is_refused_in_one_line(build, names):
    with pytest.raises(DistUsageError) as error:
        build()
    assert names in str(error.value) and "\n" not in str(error.value)


# -- data ------------------------------------------------------------------------------------------------------------


def test_byte_corpus_is_the_standard_library_source_in_name_order():
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    first, second = files[0].read_bytes(), files[1].read_bytes()
    corpus = data.byte_corpus(len(first) + 100)
    assert corpus.dtype == torch.uint8 and len(corpus) == len(first) + 100
    assert corpus.numpy().tobytes() == first + second[:100]
    compile(first, str(files[0]), "exec")  # the bytes are Python source
    whole = data.byte_corpus(1 << 40)  # more than there is: all of it
    assert len(whole) == sum(f.stat().st_size for f in files)


def test_byte_corpus_is_deterministic_and_each_caller_gets_its_own_tensor():
    a = data.byte_corpus(4096)
    a[:10] = 0
    b = data.byte_corpus(4096)
    assert not torch.equal(a, b)
    assert torch.equal(b, data.byte_corpus(4096))


def test_token_batch_is_windows_of_the_corpus_shifted_by_one():
    corpus = torch.arange(10_000)  # each window of consecutive numbers shows its own offset
    x, y = data.token_batch(corpus, step=3, batch=5, seq=7, seed=1)
    assert x.shape == y.shape == (5, 7) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, x[:, :1] + torch.arange(7)) and torch.equal(y, x + 1)
    again = data.token_batch(corpus, step=3, batch=5, seq=7, seed=1)
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(data.token_batch(corpus, 4, 5, 7, seed=1)[0], x)
    assert not torch.equal(data.token_batch(corpus, 3, 5, 7, seed=2)[0], x)
    # the last window fits: a corpus of exactly seq+1 tokens has one window, at offset 0
    x, y = data.token_batch(torch.arange(8), 0, batch=3, seq=7)
    assert torch.equal(x, torch.arange(7).expand(3, 7)) and torch.equal(y, torch.arange(1, 8).expand(3, 7))


def test_token_batch_of_bytes_is_int64_and_shifted():
    x, y = data.token_batch(data.byte_corpus(), step=0, batch=4, seq=32)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and int(x.min()) >= 0


def test_regression_is_deterministic_and_its_targets_are_the_teacher_plus_noise():
    X, Y = data.regression(samples=4096, inputs=6, outputs=2, seed=4, noise=0.05)
    assert X.shape == (4096, 6) and Y.shape == (4096, 2) and X.dtype == Y.dtype == torch.float32
    X2, Y2 = data.regression(samples=4096, inputs=6, outputs=2, seed=4, noise=0.05)
    assert torch.equal(X, X2) and torch.equal(Y, Y2)
    teacher = data.regression_teacher(inputs=6, outputs=2, seed=4)
    assert abs((Y - teacher(X)).std().item() - 0.05) < 0.005
    assert not torch.equal(data.regression(samples=8, inputs=6, outputs=2, seed=5)[0], X[:8])


def test_regression_batches_are_fresh_per_step_from_the_same_teacher():
    x0, y0 = data.regression_batch(0, batch=512, inputs=6, outputs=2, seed=4, noise=0.0)
    x1, y1 = data.regression_batch(1, batch=512, inputs=6, outputs=2, seed=4, noise=0.0)
    assert not torch.equal(x0, x1)
    assert torch.equal(data.regression_batch(1, batch=512, inputs=6, outputs=2, seed=4, noise=0.0)[1], y1)
    teacher = data.regression_teacher(inputs=6, outputs=2, seed=4)
    torch.testing.assert_close(y0, teacher(x0))
    torch.testing.assert_close(y1, teacher(x1))
    X, Y = data.regression(samples=512, inputs=6, outputs=2, seed=4, noise=0.0)
    torch.testing.assert_close(Y, teacher(X))


def test_a_model_built_under_the_meta_device_stays_there():
    """What a pipeline and a plan do to learn a model's shape without its memory (pipeline_parallel/api.py's
    meta_model): nbdist's own models must not pull themselves back onto the CPU there."""
    with torch.device("meta"):
        built = [mlp(width=8, layers=2, seed=0), gpt(vocab=16, seq=4, layers=1, hidden=8, heads=2)]
    assert {p.device.type for model in built for p in model.parameters()} == {"meta"}
    assert mlp(width=8, layers=2, seed=0)[0].weight.device.type == "cpu"  # and elsewhere on the CPU

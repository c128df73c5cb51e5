"""Models nbdist did not write, built as a user would: tiny random configs of Hugging Face `transformers` models
(Llama: grouped-query attention and rotary positions; GPT-2: a head tied to the embedding and Conv1D layers; BERT:
an encoder with an attention mask and a classification head) and a ResNet-style CNN with BatchNorm written here.

Each builder seeds itself, so every rank and the test process build the same weights; dropout is 0 (a parallel
run cannot draw a process's random masks). Batches are fixed: `batch(name)` gives (inputs, targets, loss_fn) of 8
samples, `example(name)` two of them (what a plan profiles).
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, SAMPLES = 128, 16, 8


def llama(layers: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=kv_heads, max_position_embeddings=64))


def gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def bert(layers: int = 4):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (He et al. 2016), as a user writes one."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer2(self.layer1(self.stem(x)))), 1))


def resnet():
    return ResNet()


BUILDERS = {"llama": llama, "gpt2": gpt2, "bert": bert, "resnet": resnet}


def cross_entropy(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def batch(name: str, samples: int = SAMPLES):
    """(inputs, targets, loss_fn) of one fixed global batch for model `name`: the language models and BERT take
    dicts with labels and train on their own loss (targets and loss_fn None); the CNN takes images and classes."""
    g = torch.Generator().manual_seed(1)
    if name == "resnet":
        return (torch.randn(samples, 1, 16, 16, generator=g), torch.randint(0, 10, (samples,), generator=g),
                cross_entropy)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    if name == "bert":
        mask = torch.ones(samples, SEQ, dtype=torch.long)
        mask[::2, SEQ - 4:] = 0  # some padding: the mask reaches every layer
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.randint(0, 3, (samples,), generator=g)}, None, None
    return {"input_ids": ids, "labels": ids}, None, None


def example(name: str):
    inputs, _, _ = batch(name)
    return inputs[:2] if isinstance(inputs, torch.Tensor) else {k: v[:2] for k, v in inputs.items()}


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def serial(name: str, steps: int = 3, optimizer=adam, inputs=None, targets=None, loss_fn=None):
    """One process: `steps` optimizer steps of model `name` on its batch. Returns (losses, state_dict, grads)."""
    from nbdist.models import batches

    if inputs is None:
        inputs, targets, loss_fn = batch(name)
    model = BUILDERS[name]().train()
    opt = optimizer(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = batches.loss_of(batches.call(model, inputs), targets, loss_fn)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, grads


def largest_difference(got: dict, want: dict) -> tuple[float, str | None]:
    """The largest element-wise difference between two state dicts with the same keys, and its key."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst, where = 0.0, None
    for key, value in want.items():
        diff = float((got[key].double() - value.double()).abs().max()) if value.numel() else 0.0
        if diff > worst:
            worst, where = diff, key
    return worst, where

"""The Trainer with a user's model, data and loss (issue 40): Hugging Face models trained on dict batches with their
own loss (loss_fn=None), a DataLoader with its collate_fn, an iterable data set, BatchNorm synchronised, and DCP
checkpoints saved under one plan resumed under another; each equal to one process reading the same global batches.

The order is torch's DistributedSampler's: the references here are built from torch's own DistributedSampler (one
per replica, set_epoch each epoch, batches of batch_size / dp), not from nbdist's functions.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset
from user_models import BUILDERS, SEQ, VOCAB, adam, cross_entropy, largest_difference

import nbdist
from nbdist import data
from nbdist.errors import DistUsageError

ATOL = 1e-5
BATCH, SAMPLES = 8, 40  # 5 global batches per epoch: the runs below cross an epoch


class Tokens(Dataset):
    """A map-style data set of dicts, Hugging Face style: input ids and labels (the model shifts them)."""

    def __init__(self, samples: int = SAMPLES):
        self.ids = torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class TokenStream(IterableDataset):
    """The same samples as a stream, in order."""

    def __iter__(self):
        tokens = Tokens()
        return (tokens[i] for i in range(len(tokens)))


class Sentences(Dataset):
    """Dicts for a BERT classifier: ids, an attention mask with padding, a class label."""

    def __init__(self, samples: int = SAMPLES):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
        self.mask = torch.ones(samples, SEQ, dtype=torch.long)
        self.mask[::3, SEQ - 5:] = 0
        self.labels = torch.randint(0, 3, (samples,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Images(Dataset):
    def __init__(self, samples: int = SAMPLES):
        g = torch.Generator().manual_seed(4)
        self.x, self.y = torch.randn(samples, 1, 16, 16, generator=g), torch.randint(0, 10, (samples,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def pad_collate(samples: list[dict]) -> dict:
    """A collate_fn as a user's DataLoader has one (here: stack, and an attention mask of ones)."""
    ids = torch.stack([s["input_ids"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def tokens():
    return Tokens()


def loader():
    return DataLoader(Tokens(), batch_size=BATCH, shuffle=True, collate_fn=pad_collate)


def stream():
    return TokenStream()


def images():
    return Images()


def sentences():
    return Sentences()


def sampler_batches(dataset, steps: int, replicas: int, seed: int = 0) -> list[list[int]]:
    """The global batches torch's DistributedSampler deals out: per step, every replica's batch of BATCH / replicas
    indices (BatchSampler, drop_last), replica 0's first; epochs set with set_epoch."""
    samplers = [DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=seed, drop_last=True)
                for r in range(replicas)]
    out, epoch = [], 0
    while len(out) < steps:
        for s in samplers:
            s.set_epoch(epoch)
        per_replica = [list(BatchSampler(s, BATCH // replicas, drop_last=True)) for s in samplers]
        for step in zip(*per_replica):
            out.append([i for share in step for i in share])
        epoch += 1
    return out[:steps]


def serial(name: str, global_batches: list, collate, loss_fn=None):
    model = BUILDERS[name]().train()
    opt = adam(model.parameters())
    losses = []
    for samples in global_batches:
        batch = collate(samples)
        opt.zero_grad(set_to_none=True)
        if loss_fn is None:
            loss = model(**batch).loss
        else:
            loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, model.state_dict()


def stack_dicts(samples: list[dict]) -> dict:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def stack_pairs(samples: list) -> tuple:
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def check(trainer, steps: int, want_losses, want_state) -> None:
    try:
        trainer.fit(steps=steps)
        losses = trainer.history.losses()
        state = trainer.state_dict()
    finally:
        trainer.close()
    assert losses == pytest.approx(want_losses, abs=ATOL)
    worst, where = largest_difference(state, want_state)
    assert worst < ATOL, (worst, where)


def test_the_order_is_torchs_distributed_sampler(cluster):
    """nbdist.data's global batch k and replica r's share of it are exactly what DistributedSampler (one per
    replica, set_epoch) and a BatchSampler of batch / replicas give, on 1, 2 and 4 replicas, across epochs."""
    dataset = Tokens()
    for replicas in (1, 2, 4):
        samplers = [DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=5, drop_last=True)
                    for r in range(replicas)]
        step = 0
        for epoch in range(3):
            for s in samplers:
                s.set_epoch(epoch)
            per_replica = [list(BatchSampler(s, BATCH // replicas, drop_last=True)) for s in samplers]
            for shares in zip(*per_replica):
                indices = data.batch_indices(len(dataset), step, BATCH, seed=5)
                for r, share in enumerate(shares):
                    assert data.replica_share(indices, replicas, r).tolist() == share
                step += 1
        assert step == 3 * (SAMPLES // BATCH)


@pytest.mark.parametrize("data_fn, plan", [(tokens, None), (loader, None), (tokens, {"dp": 2, "zero": 3}),
                                           (tokens, {"pp": 2, "microbatches": 2})],
                         ids=["dicts-plan-None", "dataloader-collate", "zero3", "pp2"])
def test_a_hugging_face_llama_trains_on_its_own_loss_like_one_process(cluster, data_fn, plan):
    """Dict batches, loss_fn=None (the model's own loss from its labels), a plan or none (data parallel over
    every engine; a Llama is no Sequential): 7 steps, across an epoch, like one process on the same batches."""
    steps = 7
    replicas = 1 if plan and plan.get("pp") else 2
    batches = [[Tokens()[i] for i in b] for b in sampler_batches(Tokens(), steps, replicas)]
    collate = pad_collate if data_fn is loader else stack_dicts
    want = serial("llama", batches, collate)
    check(nbdist.Trainer(BUILDERS["llama"], data_fn, None, adam, plan=plan, batch_size=BATCH, live=False), steps, *want)


def test_a_bert_classifier_trains_through_a_pipeline_like_one_process(cluster):
    """An encoder with an attention mask and a classification head, its own loss, cut in two stages."""
    steps = 4
    batches = [[Sentences()[i] for i in b] for b in sampler_batches(Sentences(), steps, 1)]
    want = serial("bert", batches, stack_dicts)
    check(nbdist.Trainer(BUILDERS["bert"], sentences, None, adam, plan={"pp": 2, "microbatches": 2},
                         batch_size=BATCH, live=False), steps, *want)


def test_an_iterable_data_set_is_read_in_order_and_dealt_out(cluster):
    """A stream: global batch k is its samples k*B .. (k+1)*B - 1 (its end starts it again: an epoch)."""
    steps = 7
    stream_order = [[i % SAMPLES for i in range(k * BATCH, (k + 1) * BATCH)] for k in range(steps)]
    want = serial("gpt2", [[Tokens()[i] for i in b] for b in stream_order], stack_dicts)
    check(nbdist.Trainer(BUILDERS["gpt2"], stream, None, adam, batch_size=BATCH, live=False), steps, *want)


def test_a_batchnorm_cnn_trains_like_one_process_with_synchronised_batchnorm(cluster):
    steps = 4
    batches = [[Images()[i] for i in b] for b in sampler_batches(Images(), steps, 2)]
    want = serial("resnet", batches, stack_pairs, cross_entropy)
    check(nbdist.Trainer(BUILDERS["resnet"], images, cross_entropy, adam, plan={"dp": 2, "sync_batchnorm": True},
                         batch_size=BATCH, live=False), steps, *want)


def test_a_checkpoint_of_one_plan_resumes_under_another(cluster, tmp_path):
    """GPT-2 (tied head) trained 3 steps on a pipeline (pp=2), checkpointed, resumed under ZeRO-3 (dp=2) for 3 more:
    where 6 uninterrupted steps of one process end."""
    batches = [[Tokens()[i] for i in b] for b in sampler_batches(Tokens(), 6, 1)]
    want = serial("gpt2", batches, stack_dicts)
    first = nbdist.Trainer(BUILDERS["gpt2"], tokens, None, adam, plan={"pp": 2, "microbatches": 2},
                           batch_size=BATCH, checkpoint_dir=str(tmp_path), live=False)
    try:
        first.fit(steps=3)
        first.save()
    finally:
        first.close()
    second = nbdist.Trainer(BUILDERS["gpt2"], tokens, None, adam, plan={"dp": 2, "zero": 3}, batch_size=BATCH,
                            live=False).resume(str(tmp_path))
    assert second.step == 3
    try:
        second.fit(steps=3)
        losses, state = second.history.losses(), second.state_dict()
    finally:
        second.close()
    assert losses == pytest.approx(want[0][3:], abs=ATOL)
    worst, where = largest_difference(state, want[1])
    assert worst < ATOL, (worst, where)


def test_ssp_with_adam_says_it_is_not_synchronous_training(cluster):
    """sync='ssp' at staleness 0 equals synchronous training only for SGD (each replica's Adam sees only its own
    gradients): said in one warning line (the README said it trains like one process, whatever the optimizer)."""
    with pytest.warns(UserWarning, match=r"sync='ssp' sends each replica's own optimizer step: with Adam .* not "
                                         r"one process"):
        trainer = nbdist.Trainer(BUILDERS["llama"], tokens, None, adam, sync="ssp", sync_options={"staleness": 0},
                                 batch_size=BATCH, live=False)
    trainer.close()


BAD_DATA = [
    ("dicts without labels", lambda: [{"input_ids": torch.zeros(SEQ, dtype=torch.long)}] * 16, None,
     r"data_fn gives dicts without 'labels' \(input_ids\), and loss_fn=None trains on the loss the model computes"),
    ("dicts and a loss_fn but no labels", lambda: [{"input_ids": torch.zeros(SEQ, dtype=torch.long)}] * 16,
     cross_entropy, r"gives dicts \(input_ids\) and a loss_fn compares the output with their 'labels', which they"),
    ("pairs and loss_fn=None", lambda: [(torch.zeros(SEQ, dtype=torch.long),) * 2] * 16, None,
     r"gives \(input, target\) pairs, and loss_fn=None trains on a loss the model's output carries: give loss_fn"),
    ("a DataLoader of another batch size", lambda: DataLoader(Tokens(), batch_size=4), None,
     r"DataLoader makes batches of 4, but the Trainer's batch_size is 8: give batch_size=4"),
    ("fewer samples than a batch", lambda: Tokens(4), None,
     r"batch_size 8 is larger than data_fn's 4 samples"),
    ("samples that are strings", lambda: ["text"] * 16, None,
     r"samples must be \(input, target\) pairs of tensors or dicts of tensors"),
]


@pytest.mark.parametrize("data_fn, loss_fn, line", [c[1:] for c in BAD_DATA], ids=[c[0] for c in BAD_DATA])
def test_bad_data_for_a_users_model_is_one_line(cluster, data_fn, loss_fn, line):
    from nbdist.runtime.ranks import registry

    before = cluster.run(registry.names, "trainer")
    with pytest.raises(DistUsageError, match=line) as raised:
        nbdist.Trainer(BUILDERS["llama"], data_fn, loss_fn, adam, batch_size=BATCH, live=False)
    assert "\n" not in str(raised.value)
    assert cluster.run(registry.names, "trainer") == before


def one_shot():
    return iter([{"input_ids": torch.zeros(SEQ, dtype=torch.long), "labels": torch.zeros(SEQ, dtype=torch.long)}
                 for _ in range(12)])


def test_a_one_shot_iterator_is_one_line(cluster):
    with pytest.raises(DistUsageError, match=r"data_fn one_shot returned an iterator \(list_iterator\), which can be "
                                             r"read only once: return an iterable data set"):
        nbdist.Trainer(BUILDERS["llama"], one_shot, None, adam, batch_size=BATCH, live=False)


def test_epochs_of_an_iterable_data_set_are_one_line(cluster):
    trainer = nbdist.Trainer(BUILDERS["gpt2"], stream, None, adam, batch_size=BATCH, live=False)
    try:
        with pytest.raises(DistUsageError, match=r"fit\(epochs=\.\.\.\) counts passes over the data set, but an "
                                                 r"iterable data set has no length: give steps="):
            trainer.fit(epochs=1)
        trainer.fit(steps=1)
    finally:
        trainer.close()

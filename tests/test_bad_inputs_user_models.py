"""Bad input to the arguments a user's own model brings (issue 40): split points, example inputs, tensor-parallel
plans, pipelines of models that are not Sequential. Each is ONE DistUsageError line naming the problem and the way
out, printed nothing, left nothing on the ranks (tests/test_bad_inputs_sharding.py's `refused`)."""
from __future__ import annotations

import pytest
import torch
from test_bad_inputs_sharding import refused
from user_models import BUILDERS, example

import nbdist

LLAMA, GPT2, RESNET = BUILDERS["llama"], BUILDERS["gpt2"], BUILDERS["resnet"]


def llama_one_kv_head():
    from user_models import llama

    return llama(kv_heads=1)


def ids_as_floats():
    return {"input_ids": torch.rand(2, 16), "labels": torch.zeros(2, 16, dtype=torch.long)}


BAD_PLANS = [  # (id, shard's arguments, the line)
    ("split point not a module", dict(model_fn=LLAMA, pp=2, microbatches=4, split_points=["model.layer.2"]),
     r"split point 'model\.layer\.2' is not a module of the model: split points name units such as "
     r"model\.embed_tokens"),
    ("split point inside a unit", dict(model_fn=LLAMA, pp=2, microbatches=4, split_points=["model.layers.1.mlp"]),
     r"split point 'model\.layers\.1\.mlp' lies inside model\.layers\.1, which runs whole on one stage"),
    ("split point at the first unit", dict(model_fn=LLAMA, pp=2, microbatches=4, split_points=["model.embed_tokens"]),
     r"split point 'model\.embed_tokens' is the model's first unit: .*the first stage would be empty"),
    ("split points out of order", dict(model_fn=LLAMA, pp=2, microbatches=4, chunks=2, schedule="interleaved-1f1b",
                                       split_points=["model.layers.3", "model.layers.1", "model.layers.2"]),
     r"split_points \[.*\] must be in the order the forward reaches them, each once"),
    ("a split point twice", dict(model_fn=LLAMA, pp=2, microbatches=4, chunks=2, schedule="interleaved-1f1b",
                                 split_points=["model.layers.1", "model.layers.1", "model.layers.2"]),
     r"must be in the order the forward reaches them, each once"),
    ("too few split points", dict(model_fn=LLAMA, pp=2, microbatches=4, chunks=2, schedule="interleaved-1f1b",
                                  split_points=["model.layers.2"]),
     r"1 split point\(s\) make 2 stages, but pp × chunks = 4: give 3 split point\(s\)"),
    ("split points at pp=1", dict(model_fn=LLAMA, dp=2, split_points=["model.layers.2"]),
     r"split_points cut pipeline stages, but pp=1 has none"),
    ("split points and balance", dict(model_fn=LLAMA, pp=2, microbatches=4, balance=[4, 4],
                                      split_points=["model.layers.2"]),
     r"give the stages in one place: balance \(layers per stage\) or split_points"),
    ("split points a string", dict(model_fn=LLAMA, pp=2, microbatches=4, split_points="model.layers.2"),
     r"split_points must be a list of module names"),
    ("a cut off the main path", dict(model_fn=LLAMA, pp=2, microbatches=4, split_points=["model.rotary_emb"]),
     r"the pipeline cut before model\.rotary_emb is not on the model's main path"),
    ("tp plan for a missing module", dict(model_fn=LLAMA, tp=2, tp_plan={"model.layers.*.attn.q_proj": "colwise"}),
     r"tp_plan names 'model\.layers\.\*\.attn\.q_proj', which matches no module of LlamaForCausalLM"),
    ("tp plan with an unknown style", dict(model_fn=LLAMA, tp=2,
                                           tp_plan={"model.layers.*.self_attn.q_proj": "colwise_rep"}),
     r"tp_plan\['model\.layers\.\*\.self_attn\.q_proj'\] = 'colwise_rep': nbdist applies 'colwise' and 'rowwise'"),
    ("tp plan on a Conv1D", dict(model_fn=GPT2, tp=2, tp_plan={"transformer.h.0.mlp.c_fc": "colwise"}),
     r"transformer\.h\.0\.mlp\.c_fc is a Conv1D"),
    ("tp that does not divide the key-value heads", dict(model_fn=llama_one_kv_head, tp=2, tp_plan="auto"),
     r"tp=2 does not divide the model's 1 num key value heads \(config\.num_key_value_heads\)"),
    ("half a tensor-parallel pair", dict(model_fn=LLAMA, tp=2, tp_plan={"model.layers.*.self_attn.q_proj": "colwise"}),
     r"the tensor-parallel plan does not run on one rank's 1/2 slice of LlamaForCausalLM \(RuntimeError: .*\): each "
     r"colwise layer's output must reach a rowwise layer"),
    ("tp plan at tp=1", dict(model_fn=LLAMA, dp=2, tp_plan="auto"),
     r"tp_plan splits layers over tensor-parallel ranks, but tp=1"),
    ("tp plan auto without one", dict(model_fn=RESNET, tp=2, tp_plan="auto", example_input=example("resnet")),
     r"tp_plan='auto' reads the plan .* but ResNet has none"),
    ("tp plan a list", dict(model_fn=LLAMA, tp=2, tp_plan=["model.layers.0.mlp.up_proj"]),
     r"tp_plan must be a non-empty dict"),
    ("tp>1 without a plan", dict(model_fn=LLAMA, tp=2),
     r"tp=2 needs to know which layers of LlamaForCausalLM to split: give tp_plan=.* or tp_plan='auto'"),
    ("no example input", dict(model_fn=RESNET, dp=2, example_input=None),
     r"cannot tell what ResNet takes as input: give example_input="),
    ("an example input that is a string", dict(model_fn=LLAMA, dp=2, example_input="hello"),
     r"example_input must be a tensor, a tuple of tensors or a dict of tensors"),
    ("an example input of uneven samples", dict(model_fn=LLAMA, dp=2, example_input={
        "input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(3, 16, dtype=torch.long)}),
     r"example_input's tensors disagree on the number of samples"),
    ("an example input the model cannot take", dict(model_fn=LLAMA, dp=2, example_input=ids_as_floats()),
     r"profiling LlamaForCausalLM on the example input \(input_ids torch\.float32 \(2, 16\).*\) failed in "
     r"model\.embed_tokens \(Embedding\)"),
    ("a model function that returns no module", dict(model_fn=lambda: "llama", dp=2),
     r"model_fn must return an nn\.Module"),
]


@pytest.mark.parametrize("options, line", [c[1:] for c in BAD_PLANS], ids=[c[0] for c in BAD_PLANS])
def test_a_bad_plan_of_a_users_model_is_one_line(cluster, capfd, options, line):
    options = {"example_input": example("llama"), **options}
    model_fn = options.pop("model_fn")
    refused(cluster, capfd, lambda: nbdist.shard(model_fn, **options), line)


def test_a_pipelines_tp_plan_naming_no_module_is_one_line(cluster4):
    """nbdist.pipeline(mesh=..., tp_plan=...) with a name the stage does not have: it trained unsplit without a
    word before."""
    from nbdist.errors import DistUsageError
    from nbdist.runtime.ranks import registry

    mesh = cluster4.mesh(pp=2, tp=2)
    before = cluster4.run(registry.names, "pipeline")
    with pytest.raises(DistUsageError, match=r"tp_plan\[0\] names '5', which is no module of stage 0") as raised:
        nbdist.pipeline(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                                    torch.nn.Linear(8, 2)),
                        mesh=mesh, microbatches=2, tp_plan={0: {"5": "colwise"}, 1: {}}, cluster=cluster4)
    assert "\n" not in str(raised.value)
    assert cluster4.run(registry.names, "pipeline") == before


def test_a_sequential_pipeline_without_a_loss_is_one_line(cluster, capfd):
    pipe = nbdist.shard(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), pp=2,
                        microbatches=2).apply()
    try:
        refused(cluster, capfd, lambda: pipe.step(torch.randn(4, 8)),
                r"loss_fn=None trains on the loss the model's output carries, but a Sequential's output is a tensor")
    finally:
        pipe.close()

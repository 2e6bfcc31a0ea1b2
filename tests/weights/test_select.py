"""weights/select.py: which tensors and shard files a stage needs, on sharded indexes of several families."""

from __future__ import annotations

import pytest

from swarm.errors import ConfigError, ModelError
from swarm.ranges import LayerRange
from swarm.weights.select import metadata_files, select_shards, select_tensors


def _llama_layer(i: int, bias: bool = False) -> list[str]:
    names = [f"model.layers.{i}.{m}.weight" for m in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    if bias:
        names += [f"model.layers.{i}.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    return names


def _index(*shards: list[str]) -> dict[str, str]:
    n = len(shards)
    return {name: f"model-{i:05d}-of-{n:05d}.safetensors" for i, names in enumerate(shards, 1) for name in names}


def _file(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


# Llama-3-like, 4 layers in 3 shards, layer 1 split across shards 1 and 2 (as transformers' size-based
# sharding does), untied LM head in the last shard.
L1 = _llama_layer(1)
LLAMA = _index(["model.embed_tokens.weight", *_llama_layer(0), *L1[:4]],
               [*L1[4:], *_llama_layer(2)],
               [*_llama_layer(3), "model.norm.weight", "lm_head.weight"])
LLAMA_CFG = {"model_type": "llama", "num_hidden_layers": 4}

# Qwen2.5-0.5B-like: q/k/v biases, tied LM head (no lm_head.weight), embedding alone in shard 1.
QWEN = _index(["model.embed_tokens.weight"],
              [*_llama_layer(0, bias=True), *_llama_layer(1, bias=True)],
              [*_llama_layer(2, bias=True), "model.norm.weight"])
QWEN_CFG = {"model_type": "qwen2", "num_hidden_layers": 3, "tie_word_embeddings": True}

# GPT-2 as transformers saves GPT2LMHeadModel: transformer.* names, learned position embedding, tied head.
GPT2 = _index(["transformer.wte.weight", "transformer.wpe.weight"],
              [f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight",
                                                                  "attn.c_proj.weight", "mlp.c_fc.weight")],
              ["transformer.h.2.ln_1.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"])
GPT2_CFG = {"model_type": "gpt2", "n_layer": 3}

# Phi-3: fused qkv and gate_up projections, layers 10+ sort before 2 in a name-sorted shard plan.
PHI3 = _index(["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
               "model.layers.0.mlp.gate_up_proj.weight"],
              ["model.layers.1.self_attn.qkv_proj.weight", "model.layers.10.self_attn.qkv_proj.weight",
               "model.layers.11.mlp.gate_up_proj.weight"],
              [*(f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2, 10)), "model.norm.weight",
               "lm_head.weight"])
PHI3_CFG = {"model_type": "phi3", "num_hidden_layers": 12}


@pytest.mark.parametrize("weight_map, config, layers, shards", [
    (LLAMA, LLAMA_CFG, (0, 1), [1]),            # head: embedding + layer 0, all in shard 1
    (LLAMA, LLAMA_CFG, (1, 2), [1, 2]),         # a layer split across two shards needs both
    (LLAMA, LLAMA_CFG, (2, 3), [2]),
    (LLAMA, LLAMA_CFG, (3, 4), [3]),            # tail: norm + untied lm_head beside layer 3
    (LLAMA, LLAMA_CFG, (0, 4), [1, 2, 3]),
    (QWEN, QWEN_CFG, (1, 2), [2]),
    (QWEN, QWEN_CFG, (2, 3), [1, 3]),           # tied tail reads the embedding in shard 1
    (QWEN, QWEN_CFG, (0, 1), [1, 2]),
    (GPT2, GPT2_CFG, (0, 1), [1, 2]),           # wte + wpe + h.0
    (GPT2, GPT2_CFG, (2, 3), [1, 3]),           # tied: wte; ln_f
    (GPT2, GPT2_CFG, (1, 2), [2]),
    (PHI3, PHI3_CFG, (1, 2), [2]),              # layer 1, not 10 or 11
    (PHI3, PHI3_CFG, (10, 12), [2, 3]),         # layers 10, 11 + norm + lm_head
    (PHI3, PHI3_CFG, (2, 10), [3]),
])
def test_shards_of_a_range(weight_map, config, layers, shards):
    n = len(set(weight_map.values()))
    sel = select_shards(weight_map, config, LayerRange(*layers))
    assert list(sel.shards) == [_file(i, n) for i in shards]
    assert set(sel.tensors) <= set(weight_map)


def test_tensors_are_exactly_the_range_and_extras():
    mid = select_tensors(LLAMA, LLAMA_CFG, LayerRange(1, 3))
    assert set(mid) == set(_llama_layer(1) + _llama_layer(2))
    head = select_tensors(GPT2, GPT2_CFG, LayerRange(0, 1))
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= set(head)
    assert not any(n.startswith("transformer.h.1.") or n.startswith("transformer.ln_f") for n in head)
    tail = select_tensors(QWEN, QWEN_CFG, LayerRange(2, 3))
    assert "model.embed_tokens.weight" in tail and "model.norm.weight" in tail  # tied head
    assert "model.embed_tokens.weight" not in select_tensors(LLAMA, LLAMA_CFG, LayerRange(3, 4))  # untied
    assert select_tensors(PHI3, PHI3_CFG, LayerRange(1, 2)) == ("model.layers.1.self_attn.qkv_proj.weight",)


@pytest.mark.parametrize("weight_map, config, layers, error, match", [
    (LLAMA, {"model_type": "bert", "num_hidden_layers": 4}, (0, 1), ModelError, "not supported"),
    (LLAMA, LLAMA_CFG, (2, 5), ConfigError, "out of bounds"),
    ({k: v for k, v in LLAMA.items() if ".layers.2." not in k}, LLAMA_CFG, (1, 3), ModelError, "layer 2"),
    ({k: v for k, v in LLAMA.items() if k != "model.norm.weight"}, LLAMA_CFG, (3, 4), ModelError, "final norm"),
    ({k: v for k, v in QWEN.items() if "embed" not in k}, QWEN_CFG, (2, 3), ModelError, "tied"),
    ({k: v for k, v in QWEN.items() if "embed" not in k}, QWEN_CFG, (0, 1), ModelError, "embedding"),
    (LLAMA, {"model_type": "llama"}, (0, 1), ModelError, "num_hidden_layers"),
])
def test_bad_checkpoints_are_named(weight_map, config, layers, error, match):
    with pytest.raises(error, match=match):
        select_shards(weight_map, config, LayerRange(*layers))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2"])
def test_selection_is_what_load_block_reads(family, synthetic):
    """The torch-free selection names exactly the tensors ``block_tensor_names`` (the loader) reads."""
    import json

    from swarm.model.block import block_tensor_names
    from swarm.model.resolve import tensor_index

    model = synthetic(family, dtype="float32")
    names = tensor_index(model)
    config = json.loads((model / "config.json").read_text())
    for start in range(4):
        for end in range(start + 1, 5):
            r = LayerRange(start, end)
            assert set(select_tensors(names, config, r)) == block_tensor_names(model, r), (family, r)


def test_metadata_files():
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "README.md",
             "model.safetensors.index.json", "model-00001-of-00002.safetensors", "pytorch_model.bin",
             "onnx/tokenizer.json", ".gitattributes"]
    assert metadata_files(files) == sorted(["chat_template.jinja", "config.json", "generation_config.json",
                                            "merges.txt", "special_tokens_map.json", "tokenizer.json",
                                            "tokenizer.model", "tokenizer_config.json", "vocab.json"])

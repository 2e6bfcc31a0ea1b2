"""weights/manifest.py: the model id covers tensor values, not names or shard layout; it is cached."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarm.errors import ModelError
from swarm.weights.manifest import tensor_manifest
from swarm.weights.identify import model_id


@pytest.fixture
def model_dir(synthetic, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(synthetic("llama", dtype="float32"), out)
    return out


def test_id_covers_values_not_layout(model_dir, tmp_path):
    mid = model_id(model_dir)
    assert len(mid) == 64 and model_id(model_dir) == mid
    copy = tmp_path / "renamed-copy"
    shutil.copytree(model_dir, copy)
    assert model_id(copy) == mid  # the name of the directory does not matter
    # the same tensors split over two shards: same id
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    resharded = tmp_path / "resharded"
    resharded.mkdir()
    shutil.copy(model_dir / "config.json", resharded / "config.json")
    save_file({n: tensors[n] for n in names[::2]}, str(resharded / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(resharded / "model-00002-of-00002.safetensors"))
    assert model_id(resharded) == mid
    # one value changed by one ulp: another model
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    t = dict(tensors)
    name = names[len(names) // 2]
    flat = t[name].clone().view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
    t[name] = flat.view(tensors[name].shape)
    save_file(t, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert model_id(other) != mid
    assert tensor_manifest(other)[name][2] != tensor_manifest(model_dir)[name][2]


def test_cached_per_file_state(model_dir, tmp_path):
    cache = tmp_path / "cache"
    mid = model_id(model_dir, cache)
    files = list(cache.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["model_id"] == mid
    # a forged cache entry is used only while the files are unchanged: touching a shard re-hashes
    doc = json.loads(files[0].read_text())
    files[0].write_text(json.dumps({**doc, "model_id": "f" * 64}))
    assert model_id(model_dir, cache) == "f" * 64
    shard = model_dir / "model.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert model_id(model_dir, cache) == mid


def test_truncated_shard_is_refused(model_dir):
    shard = model_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ModelError, match="truncated"):
        model_id(model_dir)

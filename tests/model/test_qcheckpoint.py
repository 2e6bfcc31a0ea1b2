"""FP8 checkpoints with block scales (the layout DeepSeek-V3/R1, Qwen3 FP8 and GLM-4.5 FP8 publish):
a stage dequantizes each weight with its ``weight_scale_inv`` blocks to the bits transformers loads on
a CPU, and refuses what it cannot read instead of loading garbage (issue 47)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarm.errors import ModelError
from swarm.kernels.fp8 import FP4_VALUES
from swarm.model import qcheckpoint, qformats
from swarm.model.block import block_tensor_names, load_block
from swarm.ranges import LayerRange

BLOCK = (16, 16)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_fp8(weight: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float32 -> (float8_e4m3fn weight, float32 weight_scale_inv per block of ``block``, the last
    ones cut short where N or K is not a multiple: DeepSeek-V3's ceil-division rule), as its tools do."""
    n, k = weight.shape
    grid = (-(-n // block[0]), -(-k // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:n, :k] = weight
    blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)[:n, :k].contiguous()
    return q, scale


@pytest.fixture(scope="module")
def fp8_dir(synthetic, tmp_path_factory) -> Path:
    src = synthetic("llama", "float32")
    out = tmp_path_factory.mktemp("llama-fp8")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJ):
            tensors[name], tensors[qcheckpoint.scale_name(name)] = _to_fp8(t)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (out / "config.json").write_text(json.dumps(config))
    return out


def _weights(block) -> dict[str, torch.Tensor]:
    """Every parameter of ``block`` by name, an FP8-held Linear's weight as the values it multiplies by."""
    out = {n: p for n, p in block.named_parameters()}
    for name, mod in block.named_modules():
        if qcheckpoint.FP8_ATTR in mod.__dict__:
            out[f"{name}.weight"] = qcheckpoint.weight_of(mod, block.dtype)
    return out


def _fp8_held(block) -> int:
    return sum(qcheckpoint.FP8_ATTR in m.__dict__ for m in block.modules())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_stage_holds_the_weights_transformers_dequantizes(fp8_dir, dtype):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(fp8_dir), dtype=getattr(torch, dtype)).eval()
    expected = {n: p for n, p in reference.named_parameters() if any(f".{q}." in n for q in PROJ)}
    assert len(expected) == 4 * len(PROJ) and all(p.dtype == getattr(torch, dtype) for p in expected.values())
    block = load_block(fp8_dir, LayerRange(0, 4), dtype=dtype, device="cpu")
    if block.kernel_mode == "fma":  # held as published: a byte a value, and its scales
        assert _fp8_held(block) == 4 * len(PROJ)
    held = {n: p for n, p in _weights(block).items() if any(f".{q}." in n for q in PROJ)}
    for name, want in expected.items():
        got = [p for n, p in held.items() if name.endswith(n) or n.endswith(name.removeprefix("model."))]
        assert len(got) == 1, (name, sorted(held)[:4])
        assert torch.equal(got[0], want), name  # the same bits, not just close
    # the scales are part of what the stage loaded: its receipts' range digest covers them
    assert any(n.endswith("q_proj.weight_scale_inv") for n in block.loaded_tensors)
    assert set(block.loaded_tensors) == block_tensor_names(fp8_dir, LayerRange(0, 4))
    ids = torch.tensor([[5, 17, 3, 42, 9, 11]])
    with torch.no_grad():
        want_next = reference(ids).logits[0, -1].argmax().item()
        got_next = block.forward_batch([(block.new_cache(), 0, ids)], tile=1)[0][0, -1].argmax().item()
    assert got_next == want_next


def test_a_dequantized_weight_is_each_value_times_its_blocks_scale():
    w = torch.randn(32, 48)
    q, scale = _to_fp8(w, (16, 16))
    out = qcheckpoint.dequantize(q, scale, (16, 16))
    assert out.dtype == torch.float32
    assert torch.equal(out[16:, 32:], q[16:, 32:].float() * scale[1, 2])
    assert torch.equal(qcheckpoint.dequantize(q, scale, None), out)  # the block from the shapes
    ragged = qcheckpoint.dequantize(q[:, :40], scale, (16, 16))  # a last block cut short (ceil, as DeepSeek's grids)
    assert torch.equal(ragged, out[:, :40])
    with pytest.raises(ModelError, match="not one per 16x16 block"):
        qcheckpoint.dequantize(q, scale[:, :2], (16, 16))


def test_a_float8_weight_without_its_scales_is_refused(fp8_dir, tmp_path):
    broken = tmp_path / "no-scales"
    shutil.copytree(fp8_dir, broken)
    tensors = {n: t for n, t in load_file(str(broken / "model.safetensors")).items()
               if n != "model.layers.1.self_attn.q_proj.weight_scale_inv"}
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model.layers.1.self_attn.q_proj.weight is stored in torch.float8_e4m3fn "
                                         r"without its block scales"):
        load_block(broken, LayerRange(0, 4), dtype="float32", device="cpu")


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq"])
def test_other_quantization_methods_are_refused_by_name(synthetic, tmp_path, method):
    src = synthetic("llama", "float32")
    out = tmp_path / method
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=f"quantized with '{method}'"):
        load_block(out, LayerRange(0, 2), dtype="float32", device="cpu")


def _by_blocks(q: torch.Tensor, scale: torch.Tensor, b: int) -> torch.Tensor:
    """DeepSeek-V3's rule written out (its inference/kernel.py): block (i, j) of b x b, the last ones cut
    short, is its float8 values times scale[i, j] in float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * b:(i + 1) * b, j * b:(j + 1) * b] = q[i * b:(i + 1) * b, j * b:(j + 1) * b].float() * scale[i, j]
    return out


def _published_and_floats(src: Path, out: Path, published: dict, floats: dict, quantization_config: dict):
    """``src`` written twice: at ``out`` with the ``published`` tensors and ``quantization_config``, and
    beside it with the ``floats`` they decode to. Returns (that checkpoint, the float one)."""
    float_dir = out.parent / f"{out.name}-floats"
    for path, tensors in ((out, published), (float_dir, floats)):
        shutil.copytree(src, path)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    return out, float_dir


def _batched_greedy(blocks, prompt: list[int], new_tokens: int, tile: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through ``blocks`` as a stage computes (``forward_batch``): the ids and each step's logits."""
    caches = [b.new_cache() for b in blocks]
    ids, logits, pos, toks = [], [], 0, list(prompt)
    with torch.no_grad():
        while len(ids) < new_tokens:
            h = torch.tensor([toks])
            for b, c in zip(blocks, caches):
                h = b.forward_batch([(c, pos, h)], tile=tile)[0]
            pos += len(toks)
            logits.append(h[0, -1])
            toks = [int(h[0, -1].argmax())]
            ids.append(toks[0])
    return ids, logits


def _assert_same_bits(quantized: Path, floats: Path, ranges: list[LayerRange], span: LayerRange,
                      dtype: str = "float32"):
    """The chain of blocks of ``ranges`` computes the same logits, bit for bit, on both checkpoints (prefill
    and decode, as a stage runs them), and a block of ``span`` holds the same values (the stacked experts'
    too; an FP8-held weight as the values it multiplies by); returns the quantized one's block."""
    runs = [_batched_greedy([load_block(d, r, dtype=dtype, device="cpu") for r in ranges], [1, 5, 9, 3, 7], 6, tile)
            for tile in (1, 2) for d in (quantized, floats)]
    for a, b in ((runs[0], runs[1]), (runs[2], runs[3])):
        assert a[0] == b[0]
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    held = load_block(quantized, span, dtype=dtype, device="cpu")
    same = load_block(floats, span, dtype=dtype, device="cpu")
    if _fp8_held(held):  # a byte a value (and a scale a block) instead of four
        assert held.loaded_bytes < same.loaded_bytes
    got, want = _weights(held), _weights(same)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    return held


def _llama_pair(synthetic, tmp_path: Path) -> tuple[Path, Path]:
    """A Llama checkpoint with every decoder Linear in FP8 (16x16 blocks), and its dequantized floats."""
    src = synthetic("llama", "float32")
    fp8_tensors, float_tensors = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJ):
            q, scale = _to_fp8(t, (16, 16))
            fp8_tensors[name], fp8_tensors[qcheckpoint.scale_name(name)] = q, scale
            float_tensors[name] = _by_blocks(q, scale, 16)
        else:
            fp8_tensors[name] = float_tensors[name] = t
    return _published_and_floats(src, tmp_path / "fp8", fp8_tensors, float_tensors,
                                 {"quant_method": "fp8", "weight_block_size": [16, 16]})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_llama_checkpoint_in_fp8_runs_exactly_as_its_dequantized_floats(synthetic, tmp_path, dtype):
    """Held as published, the FP8 weights go through the fused decoder layer (fma_layer.c) like floats do:
    a chain of blocks gives the logits of the same chain on the floats the scales decode to, bit for bit."""
    from swarm.model import fused

    quantized, floats = _llama_pair(synthetic, tmp_path)
    held = _assert_same_bits(quantized, floats, [LayerRange(0, 2), LayerRange(2, 4)], LayerRange(1, 3), dtype)
    if held.kernel_mode == "fma":
        assert _fp8_held(held) == 2 * len(PROJ)
        assert all(fused.layer_plan(layer, held.dtype, None) is not None for layer in held.layers)


DEEPSEEK_FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj")  # what DeepSeek-V3's FP8 release stores in FP8: attention and every expert's Linears


def _deepseek_pair(synthetic, tmp_path: Path, experts: bool) -> tuple[Path, Path]:
    """A DeepSeek-V3 checkpoint with DEEPSEEK_FP8's Linears in FP8 (the routed experts' too when ``experts``;
    shapes that are no multiple of the block among them), and its dequantized floats."""
    src = synthetic("deepseek_v3", "float32")
    fp8_tensors, float_tensors, ragged = {}, {}, 0
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and t.dim() == 2 and any(f".{p}." in name for p in DEEPSEEK_FP8) \
                and (experts or ".experts." not in name):
            q, scale = _to_fp8(t, (16, 16))  # q_a_proj (24, 32), o_proj (32, 40), ...: last blocks cut short
            ragged += t.shape[0] % 16 != 0 or t.shape[1] % 16 != 0
            fp8_tensors[name], fp8_tensors[qcheckpoint.scale_name(name)] = q, scale
            float_tensors[name] = _by_blocks(q, scale, 16)
        else:
            fp8_tensors[name] = float_tensors[name] = t
    routed = sum(n.endswith("_scale_inv") and ".experts." in n for n in fp8_tensors)
    assert (routed >= 3 * 8 if experts else routed == 0) and ragged >= 4
    return _published_and_floats(src, tmp_path / f"fp8-{experts}", fp8_tensors, float_tensors,
                                 {"quant_method": "fp8", "weight_block_size": [16, 16]})


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])  # bfloat16: 10 s
def test_a_deepseek_checkpoint_in_fp8_runs_exactly_as_its_dequantized_floats(synthetic, tmp_path, dtype):
    """Latent attention, the dense layer and the shared experts held in FP8: a chain of stages on the FP8
    layout gives the bits of the same chain on the floats the scales decode to."""
    quantized, floats = _deepseek_pair(synthetic, tmp_path, experts=False)
    held = _assert_same_bits(quantized, floats, [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)],
                             LayerRange(1, 3), dtype)
    if held.kernel_mode == "fma":
        assert _fp8_held(held) >= 2 * 5  # two layers' attention Linears at least


def _assert_held_experts_keep_a_stages_contracts(quantized: Path, floats: Path, dtype: str, layers: int,
                                                moe_layers: int):
    """The routed experts of ``quantized`` are held as published (both fused matrices of ``moe_layers`` layers),
    multiplied by swarm.kernels.fp8 (not the floats' torch GEMMs: close to them, not their bits), and the block
    keeps what a stage needs: its start-up proof passes, a chunk's rows get the bits they get one at a time or
    in tiles of 2, and greedy decoding picks the floats' tokens."""
    from swarm.kernels.check import check_block

    held = load_block(quantized, LayerRange(0, layers), dtype=dtype, device="cpu")
    same = load_block(floats, LayerRange(0, layers), dtype=dtype, device="cpu")
    if held.kernel_mode != "fma":
        pytest.skip(f"checkpoints are held as published where the fma kernels run: {held.kernel_why}")
    experts = [m for m in held.modules() if isinstance(m.__dict__.get("gate_up_proj"), qformats.QExperts)]
    assert len(experts) == moe_layers
    assert all(isinstance(m.__dict__.get("down_proj"), qformats.QExperts) for m in experts)
    assert held.loaded_bytes < 0.6 * same.loaded_bytes
    prompt = [1, 5, 9, 3, 7]
    ids, logits = _batched_greedy([held], prompt, 6, 1)
    want_ids, want_logits = _batched_greedy([same], prompt, 6, 1)
    assert ids == want_ids
    tol = dict(rtol=0, atol=1e-4) if dtype == "float32" else dict(rtol=0, atol=0.1)
    assert all(torch.allclose(a.float(), b.float(), **tol) for a, b in zip(logits, want_logits))
    tiled = _batched_greedy([held], prompt, 6, 2)
    assert tiled[0] == ids and all(torch.equal(a, b) for a, b in zip(tiled[1], logits))
    assert check_block(held, 1).ok
    with torch.no_grad():  # the prompt in one chunk, and one row at a time: the same last row
        whole = held.forward_batch([(held.new_cache(), 0, torch.tensor([prompt]))], tile=1)[0][0, -1]
        cache = held.new_cache()
        for i, tok in enumerate(prompt):
            row = held.forward_batch([(cache, i, torch.tensor([[tok]]))], tile=1)[0][0, -1]
    assert torch.equal(whole, row)
    return held


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_routed_experts_are_held_in_fp8_and_keep_a_stages_contracts(synthetic, tmp_path, dtype):
    """The routed experts (most of a DeepSeek checkpoint's bytes) stay FP8 too."""
    quantized, floats = _deepseek_pair(synthetic, tmp_path, experts=True)
    _assert_held_experts_keep_a_stages_contracts(quantized, floats, dtype, 4, 3)


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts (E, K, R) as transformers' gpt-oss holds them -> MXFP4 (blocks (E, R, K / 32, 16) uint8, scales
    (E, R, K / 32) uint8), as gpt-oss's release stores them: each group of 32 over K with one power of two."""
    t = w.transpose(1, 2)
    e_, r, k = t.shape
    groups = t.reshape(e_, r, k // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).to(torch.int32)
    scaled = groups / torch.ldexp(torch.ones(()), exp)[..., None]
    idx = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1)
    blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def _gpt_oss_pair(synthetic, tmp_path: Path) -> tuple[Path, Path]:
    """gpt-oss's release: every expert's gate_up and down projections in MXFP4 (``*_blocks``, ``*_scales``), the
    rest in floats; and beside it the floats transformers dequantizes those blocks to (checked here)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = synthetic("gpt_oss", "float32", intermediate_size=32)
    q_tensors, f_tensors = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _to_mxfp4(t)
            q_tensors[name + "_blocks"], q_tensors[name + "_scales"] = blocks, scales
            ours = qcheckpoint.dequantize_mxfp4(blocks, scales)
            assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            assert ours.shape == t.shape and not torch.equal(ours, t)  # a real quantization, same layout
            f_tensors[name] = ours
        else:
            q_tensors[name] = f_tensors[name] = t
    assert sum(n.endswith("_blocks") for n in q_tensors) == 2 * 4
    keep_float = ["model.layers.*.self_attn", "model.embed_tokens", "lm_head"]
    return _published_and_floats(src, tmp_path / "mxfp4", q_tensors, f_tensors,
                                 {"quant_method": "mxfp4", "modules_to_not_convert": keep_float})


def test_gpt_oss_mxfp4_experts_dequantized_run_exactly_as_the_floats_transformers_decodes(synthetic, tmp_path,
                                                                                        monkeypatch):
    """Where the fma kernels do not run (here: SWARM_KERNELS=rows), the MXFP4 experts are dequantized at load:
    a chain of stages gives the bits of the same chain on the floats transformers decodes them to."""
    quantized, floats = _gpt_oss_pair(synthetic, tmp_path)
    monkeypatch.setenv("SWARM_KERNELS", "rows")
    held = _assert_same_bits(quantized, floats, [LayerRange(0, 2), LayerRange(2, 4)], LayerRange(0, 4))
    assert held.kernel_mode == "rows"
    assert any(n.endswith("gate_up_proj_scales") for n in held.loaded_tensors)
    assert set(held.loaded_tensors) == block_tensor_names(quantized, LayerRange(0, 4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_mxfp4_experts_are_held_as_published_and_keep_a_stages_contracts(synthetic, tmp_path, dtype):
    """Where the fma kernels run, the experts stay MXFP4 (4.25 bits a weight), decoded by swarm.kernels.fp8."""
    quantized, floats = _gpt_oss_pair(synthetic, tmp_path)
    held = _assert_held_experts_keep_a_stages_contracts(quantized, floats, dtype, 4, 4)
    assert set(held.loaded_tensors) == block_tensor_names(quantized, LayerRange(0, 4))


@pytest.mark.parametrize("kernels", ["fma", "rows"])
def test_stage_check_takes_published_checkpoints_and_counts_what_the_block_holds(synthetic, tmp_path, monkeypatch,
                                                                                 fp8_dir, kernels):
    """``swarm stage --check`` (preflight) reads FP8 and MXFP4 tensors' dtypes as a stage loads them, and counts
    the bytes load_block holds: the published bytes where the fma kernels run, the dequantized floats elsewhere."""
    from swarm.config import StageConfig
    from swarm.stage.preflight import preflight

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if kernels == "rows":
        monkeypatch.setenv("SWARM_KERNELS", "rows")
    mxfp4, _ = _gpt_oss_pair(synthetic, tmp_path)
    for model in (fp8_dir, mxfp4):
        layers = LayerRange(1, 3)
        block = load_block(model, layers, dtype="float32", device="cpu")
        reported = preflight(StageConfig.of(model=str(model), layers=layers, device="cpu", dtype="float32",
                                            key_path=tmp_path / "k.key"))
        assert reported["weights_bytes"] == block.loaded_bytes, model
        assert block.kernel_mode == kernels

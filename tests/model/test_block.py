"""Layer blocks chained in one process == transformers generate; only owned tensors are read."""

import pytest
import torch

from swarm.errors import ConfigError, ContextOverflow, ModelError, ProtocolError
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from tests.support.models import FAMILY_CONFIGS, chained_greedy, reference_greedy

PROMPT = [1, 5, 9, 3, 7, 2, 8, 11, 4]
SPLITS = {1: [(0, 4)], 2: [(0, 3), (3, 4)], 3: [(0, 1), (1, 3), (3, 4)], 4: [(0, 1), (1, 2), (2, 3), (3, 4)]}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_chained_blocks_match_transformers(synthetic, family, stages):
    d = synthetic(family)
    ref = reference_greedy(d, PROMPT, 16, "float64")
    blocks = [load_block(d, LayerRange(a, b), dtype="float64", device="cpu") for a, b in SPLITS[stages]]
    assert chained_greedy(blocks, PROMPT, 16) == ref


def test_block_reads_only_its_tensors(synthetic):
    d = synthetic("llama")
    full = load_block(d, LayerRange(0, 4), dtype="float64", device="cpu")
    mid = load_block(d, LayerRange(1, 3), dtype="float64", device="cpu")
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in mid.loaded_tensors)
    per_layer = {n for n in full.loaded_tensors if n.startswith("model.layers.1.")}
    assert len(mid.loaded_tensors) == 2 * len(per_layer)
    assert mid.embed is None and mid.lm_head is None and mid.norm is None
    layer_params = sum(p.numel() for p in full.layers[1].parameters())
    assert mid.parameter_count() == 2 * layer_params
    assert mid.loaded_bytes == 2 * layer_params * 8


def test_tied_lm_head_reads_embedding(synthetic):
    d = synthetic("llama", tie_word_embeddings=True)
    tail = load_block(d, LayerRange(3, 4), dtype="float64", device="cpu")
    assert "model.embed_tokens.weight" in tail.loaded_tensors and tail.is_tail and not tail.is_head


def test_rollback_equals_fresh(synthetic):
    """Writing positions, rolling kv_len back, and rewriting gives the same logits as a fresh cache."""
    d = synthetic("qwen2")
    b = load_block(d, LayerRange(0, 4), dtype="float64", device="cpu")
    cache = b.new_cache()
    b.forward(cache, 0, token_ids=torch.tensor([PROMPT]))
    b.forward(cache, len(PROMPT), token_ids=torch.tensor([[40, 41, 42]]))  # speculation to reject
    assert cache.kv_len == len(PROMPT) + 3
    rolled = b.forward(cache, len(PROMPT), token_ids=torch.tensor([[50, 51]]))
    fresh_cache = b.new_cache()
    fresh = b.forward(fresh_cache, 0, token_ids=torch.tensor([PROMPT + [50, 51]]))
    assert cache.kv_len == len(PROMPT) + 2
    torch.testing.assert_close(rolled, fresh[:, -2:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_forward_paused_between_layers_gives_the_same_bits(synthetic, family):
    """forward_steps pauses after every layer but the last; another session's forward in a pause
    changes nothing of either's bits; closing it while paused rolls its cache back."""
    d = synthetic(family)
    b = load_block(d, LayerRange(0, 4), dtype="float32", device="cpu")
    prompt, other = torch.tensor([PROMPT]), torch.tensor([[3, 1, 4]])
    whole = b.forward_batch([(b.new_cache(), 0, prompt)], tile=2)[0]
    other_alone = b.forward_batch([(b.new_cache(), 0, other)], tile=2)[0]
    cache, other_cache = b.new_cache(), b.new_cache()
    steps = b.forward_steps([(cache, 0, prompt)], tile=2)
    pauses, overtaken = 0, None
    while True:
        try:
            next(steps)
        except StopIteration as done:
            paused = done.value[0]
            break
        pauses += 1
        if overtaken is None:
            overtaken = b.forward_batch([(other_cache, 0, other)], tile=2)[0]
    assert pauses == 3  # 4 layers
    assert torch.equal(paused, whole) and torch.equal(overtaken, other_alone)
    assert cache.kv_len == len(PROMPT)
    steps = b.forward_steps([(cache, len(PROMPT), torch.tensor([[6, 6]]))])
    next(steps)
    steps.close()  # given up while paused: as if it never began
    assert cache.kv_len == len(PROMPT)
    again = b.forward_batch([(cache, len(PROMPT), torch.tensor([[7]]))], tile=2)[0]
    fresh = b.forward_batch([(b.new_cache(), 0, torch.tensor([PROMPT + [7]]))], tile=2)[0]
    assert torch.equal(again, fresh[:, -1:])


def test_gap_and_overflow(synthetic):
    d = synthetic("llama")
    b = load_block(d, LayerRange(0, 4), dtype="float64", device="cpu")
    cache = b.new_cache(max_len=10)
    with pytest.raises(ProtocolError, match="not contiguous"):
        b.forward(cache, 3, token_ids=torch.tensor([[1]]))
    with pytest.raises(ContextOverflow, match="maximum context of 10"):
        b.forward(cache, 0, token_ids=torch.tensor([[1] * 11]))
    assert cache.kv_len == 0


def test_bad_ranges_and_dirs(synthetic, tmp_path):
    d = synthetic("llama")
    with pytest.raises(ConfigError, match="out of bounds"):
        load_block(d, LayerRange(2, 5), device="cpu")
    with pytest.raises(ModelError, match="config.json"):
        load_block(tmp_path, LayerRange(0, 1), device="cpu")


@pytest.mark.parametrize("stages", [2, 3])
def test_stories260k_blocks_match_transformers(stories_dir, stages):
    ranges = {2: [(0, 2), (2, 5)], 3: [(0, 1), (1, 4), (4, 5)]}[stages]
    prompt = [1, 403, 407, 261, 378, 1256 % 512]
    ref = reference_greedy(stories_dir, prompt, 24, "float32")
    blocks = [load_block(stories_dir, LayerRange(a, b), dtype="float32", device="cpu") for a, b in ranges]
    assert chained_greedy(blocks, prompt, 24) == ref


def test_a_block_says_why_it_runs_the_rows_mode(synthetic, monkeypatch):
    """``kernel_why`` (what a stage reports with ``kernels.mode == "rows"``): the dtype or the setting
    that keeps the fma kernels off; empty in the fma mode; set_kernel_mode's reason after a fallback."""
    from swarm.kernels import fma
    from swarm.model.block import rows_reason

    cpu = torch.device("cpu")
    wide = load_block(synthetic("llama"), LayerRange(0, 2), dtype="float64", device="cpu")
    assert wide.kernel_mode == "rows"
    assert wide.kernel_why == rows_reason(cpu, torch.float64) == (
        "the fma kernels cannot run: they take float32 or bfloat16 on the CPU, this block is float64 on cpu")
    monkeypatch.setenv("SWARM_KERNELS", "rows")
    block = load_block(synthetic("llama", "float32"), LayerRange(0, 2), dtype="float32", device="cpu")
    assert block.kernel_mode == "rows" and block.kernel_why == "the fma kernels cannot run: SWARM_KERNELS=rows"
    assert rows_reason(cpu, torch.float64) == "SWARM_KERNELS=rows"  # asked for: the dtype is not the reason
    monkeypatch.delenv("SWARM_KERNELS")
    if not fma.available()[0]:
        pytest.skip(f"no fma kernels here: {fma.available()[1]}")
    assert rows_reason(cpu, torch.float32) == ""
    block.set_kernel_mode("fma")
    assert block.kernel_why == ""
    block.set_kernel_mode("rows", why="the fma kernels failed the start-up proof: ...")
    assert block.kernel_why == "the fma kernels failed the start-up proof: ..."


def test_a_blocks_tensors_start_on_64_byte_boundaries_wherever_the_file_puts_them(synthetic, tmp_path):
    """safetensors hands out views at the tensor's offset in the file; MKL gives a GEMV (a router's logits,
    the rows mode) other bits at another alignment, so a block copies what is not aligned: its bits never
    depend on the file's layout (a resharded copy of the same weights computes the same)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = synthetic("qwen2_moe", "float32")
    shifted = tmp_path / "shifted"
    shutil.copytree(src, shifted)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(tensors, str(shifted / "model.safetensors"), metadata={"format": "pt", "pad": "x" * 13})
    with safe_open(str(shifted / "model.safetensors"), framework="pt") as f:
        assert any(f.get_tensor(n).data_ptr() % 64 for n in f.keys())  # the file does put some off the boundary
    x = torch.randn(1, 3, FAMILY_CONFIGS["qwen2_moe"]["hidden_size"], dtype=torch.float32)
    outs = []
    for d in (src, shifted):
        block = load_block(d, LayerRange(1, 3), dtype="float32", device="cpu")
        assert not [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.data_ptr() % 64], d
        block.set_kernel_mode("rows")  # torch's own ops, MKL's GEMVs among them
        with torch.no_grad():
            outs.append(block.forward_batch([(block.new_cache(), 0, x)], tile=1)[0])
    assert torch.equal(outs[0], outs[1])

"""The fma mode's fused decoder layer (swarm.model.fused, fma_layer.c) == the module path, bit for bit:
hidden states, logits and every KV cache row, for float32, bfloat16 and block-format weights, packed
sessions, decode rows, chunks, spans, pauses between layers and rollback."""

from __future__ import annotations

import pytest
import torch

from swarm.kernels import fma
from swarm.model.block import load_block
from swarm.ranges import LayerRange

pytestmark = pytest.mark.skipif(not fma.available()[0], reason=f"no fma kernels here: {fma.available()[1]}")

V = 101


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Factory: a seeded random 3-layer Llama (D 64, H 4 of Dh 16, Hkv 2, MLP 96: every K a multiple of 32,
    as q4_0 needs), with q/k/v/o and MLP biases or without, saved in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    made = {}

    def get(bias: bool):
        if bias not in made:
            config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=V, max_position_embeddings=512,
                                 attention_bias=bias, mlp_bias=bias, rms_norm_eps=1e-5)
            torch.manual_seed(7)
            model = LlamaForCausalLM(config).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, 0.25)  # not transformers' init: norms and biases far from 1 and 0
            out = tmp_path_factory.mktemp(f"llama-bias{int(bias)}")
            model.save_pretrained(out)
            made[bias] = out
        return made[bias]

    return get


def _rows(cache, n, skip=()):
    return [t[:, :n].clone() for i in cache.layer_ids if i not in skip for t in (cache._keys[i], cache._values[i])]


def _script(block, fused: bool, head: bool, span=None, skip=()) -> tuple[list, list]:
    """Prefill of two packed sessions (T 7 and 3, tile 4), decode rows of both, a verify chunk beside a decode
    row, a rollback, a third session joining; returns every output and every cache's rows."""
    block.fused = fused
    g = torch.Generator().manual_seed(3)
    d = block.hidden_size

    def x(t):
        if head:
            return torch.randint(0, V, (1, t), generator=g)
        return torch.randn((1, t, d), generator=g).to(block.dtype)

    a, b, c = (block.new_cache(span=span) for _ in range(3))
    out = []
    out += block.forward_batch([(a, 0, x(7)), (b, 0, x(3))], tile=4, span=span)
    out += block.forward_batch([(a, 7, x(1)), (b, 3, x(1))], span=span)
    out += block.forward_batch([(b, 4, x(4)), (a, 8, x(1))], tile=2, span=span)
    out += block.forward_batch([(b, 5, x(2))], span=span)  # rollback: b's positions 5..7 rewritten
    out += block.forward_batch([(c, 0, x(5)), (a, 9, x(1)), (b, 7, x(1))], tile=3, span=span)
    return out, [r for cache in (a, b, c) for r in _rows(cache, cache.kv_len, skip)]


def _same(block, head: bool, span=None, monkeypatch=None, skip=()):
    calls = []
    if monkeypatch is not None:
        real = fma.decoder_layer
        monkeypatch.setattr(fma, "decoder_layer", lambda *args: calls.append(1) or real(*args))
    want = _script(block, False, head, span, skip)
    assert not calls  # the module path makes no fused call
    got = _script(block, True, head, span, skip)
    if monkeypatch is not None:
        assert calls  # the fused path ran
    assert len(want[0]) == len(got[0]) and len(want[1]) == len(got[1])
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert w.dtype == g.dtype and torch.equal(w, g)


@pytest.mark.parametrize("dtype,quantize", [("float32", None), ("bfloat16", None), ("float32", "q8_0"),
                                            ("float32", "q4_0")])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_layers_give_the_module_paths_bits(tiny, dtype, quantize, bias, monkeypatch):
    """Head, middle and tail blocks (embedding; hidden states in; logits out) and a span inside a block."""
    d = tiny(bias)
    for start, end in ((0, 2), (1, 2), (1, 3)):
        block = load_block(d, LayerRange(start, end), dtype=dtype, device="cpu", quantize=quantize)
        assert block.kernel_mode == "fma"
        _same(block, head=start == 0, monkeypatch=monkeypatch)
    block = load_block(d, LayerRange(0, 3), dtype=dtype, device="cpu", quantize=quantize)
    _same(block, head=False, span=LayerRange(1, 2))
    assert all(p is not None for p in block._fused_plans)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_other_llama_structured_families(synthetic, family, dtype):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Mistral's sliding window (6 positions: the script
    passes it)."""
    block = load_block(synthetic(family), LayerRange(0, 4), dtype=dtype, device="cpu")
    _same(block, head=True)
    assert all(p is not None for p in block._fused_plans)


def test_logits_rows_and_pauses(tiny):
    """logits_rows on the tail; forward_steps paused after each layer with another session's forward run in
    the pause; closed while paused: rolled back."""
    block = load_block(tiny(True), LayerRange(0, 3), dtype="float32", device="cpu")
    ids, other = torch.tensor([[5, 9, 2, 7, 1]]), torch.tensor([[3, 4]])

    def run(fused):
        block.fused = fused
        a, b = block.new_cache(), block.new_cache()
        first = block.forward_batch([(a, 0, ids), (b, 0, other)], logits_rows=[2, 0])
        steps = block.forward_steps([(a, 5, ids[:, :3])], logits_rows=[1])
        overtaken = []
        while True:
            try:
                next(steps)
            except StopIteration as done:
                paused = done.value
                break
            overtaken += block.forward_batch([(b, b.kv_len, other[:, :1])])
        closed = block.forward_steps([(a, 8, ids[:, :2])])
        next(closed)
        closed.close()
        assert a.kv_len == 8
        return first + paused + overtaken + _rows(a, a.kv_len) + _rows(b, b.kv_len)

    want, got = run(False), run(True)
    assert [t.shape for t in want] == [t.shape for t in got]
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_a_replaced_layer_forward_runs_instead(tiny):
    """A layer whose forward a test double replaced (the skip cheat) runs that; the layers around it stay
    fused and take its output (its cache rows: written by neither)."""
    block = load_block(tiny(False), LayerRange(0, 3), dtype="float32", device="cpu")
    layer = block.layers[1]
    layer.forward = lambda h, *a, **k: h
    try:
        _same(block, head=True, skip=(1,))
    finally:
        del layer.forward


def test_an_error_in_a_fused_layer_rolls_the_caches_back(tiny, monkeypatch):
    block = load_block(tiny(False), LayerRange(0, 3), dtype="float32", device="cpu")
    cache = block.new_cache()
    block.forward_batch([(cache, 0, torch.tensor([[1, 2, 3]]))])
    real, calls = fma.decoder_layer, []

    def failing(plan, rows, slot):
        calls.append(slot)
        if slot == 1:
            raise MemoryError("no memory for a decoder layer over 2 rows")
        real(plan, rows, slot)

    monkeypatch.setattr(fma, "decoder_layer", failing)
    with pytest.raises(MemoryError):
        block.forward_batch([(cache, 3, torch.tensor([[4, 5]]))])
    assert calls == [0, 1] and cache.kv_len == 3
    monkeypatch.setattr(fma, "decoder_layer", real)
    again = block.forward_batch([(cache, 3, torch.tensor([[6]]))])[0]
    fresh = block.forward_batch([(block.new_cache(), 0, torch.tensor([[1, 2, 3, 6]]))])[0]
    assert torch.equal(again, fresh[:, -1:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stories260k(stories_dir, dtype):
    """The real 5-layer Llama: a head block and a tail block."""
    for start, end in ((0, 3), (3, 5)):
        block = load_block(stories_dir, LayerRange(start, end), dtype=dtype, device="cpu")
        _same(block, head=start == 0)
        assert all(p is not None for p in block._fused_plans)

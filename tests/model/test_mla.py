"""DeepSeek-V3 (``swarm.model.mla`` and its MoE in ``swarm.model.moe``): the KV cache holds the latents,
a 3-stage ring equals transformers in float32, and with routing ties forced, healed by replay ==
uninterrupted bit for bit; the start-up proof fails on a non-invariant MLA path.
(Ring == speculative == one process with ties, healed in a ring and resumed == fresh with ties,
packed == solo and the proof on every kernel mode run in the suites every MoE family is in: test_moe,
test_batching, test_invariant, test_ring, test_block.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm.heal import plan_replay
from swarm.kernels.check import check_block
from swarm.model import plan
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from tests.model.test_moe import _tied_routes
from tests.support.models import FAMILY_CONFIGS, chained_greedy, make_synthetic, reference_greedy

PROMPT = [1, 5, 9, 3, 7, 2, 8, 11, 4]
RANGES = [(0, 1), (1, 3), (3, 4)]  # the dense layer alone on the head, MoE layers after
CONFIG = FAMILY_CONFIGS["deepseek_v3"]
LATENT = CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"]  # 16 + 8 cached per position and layer
DEEPSEEK_V3 = Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3" / "config.json"


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 in float32 with every routing choice a tie (``test_moe._tied_routes``)."""
    root = tmp_path_factory.mktemp("deepseek")
    return _tied_routes(make_synthetic("deepseek_v3", root / "src", dtype="float32"), root / "tied")


def _blocks(model: Path, dtype: str = "float32"):
    return [load_block(model, LayerRange(a, b), dtype=dtype, device="cpu") for a, b in RANGES]


def _step(blocks, caches, pos: int, ids: list[int]) -> torch.Tensor:
    """Positions ``[pos, pos + len(ids))`` through every block: the tail's (1, T, V) logits."""
    h = None
    for b, c in zip(blocks, caches):
        h = b.forward(c, pos, token_ids=torch.tensor([ids])) if b.is_head else b.forward(c, pos, hidden=h)
    return h


def _decode(blocks, caches, pos: int, ids: list[int], new_tokens: int):
    """Feed ``ids`` at ``pos``, then decode greedily: (new ids, the logits row of each)."""
    out, rows = [], []
    while len(out) < new_tokens:
        logits = _step(blocks, caches, pos, ids)
        pos += len(ids)
        rows.append(logits[0, -1])
        ids = [int(logits[0, -1].argmax())]
        out.append(ids[0])
    return out, rows


def assert_resumed_equals_fresh(blocks, prompt: list[int]) -> None:
    """Exactness contract 5 on ``blocks`` (covering a model in order): a session resumed from another's stored
    prefix blocks (the stage's PrefixStore, one whole block of 16 positions of ``prompt``'s first 20) decodes
    a fresh prefill's ids and logits rows, bit for bit."""
    from swarm.stage.prefix import PrefixStore

    ids = (prompt * 3)[:20]
    first = [b.new_cache(64) for b in blocks]
    _step(blocks, first, 0, ids)
    stores = [PrefixStore(16) for _ in blocks]
    assert [s.store("ns", ids, c, len(ids)) for s, c in zip(stores, first)] == [1] * len(blocks)
    resumed = [b.new_cache(64) for b in blocks]
    assert [s.load(s.lookup("ns", ids, len(ids) - 1), c) for s, c in zip(stores, resumed)] == [16] * len(blocks)
    got, got_rows = _decode(blocks, resumed, 16, ids[16:], 8)
    want, want_rows = _decode(blocks, [b.new_cache(64) for b in blocks], 0, ids, 8)
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_rows, want_rows))


def _preflight(model: Path, layers: LayerRange, dtype: str, key: Path) -> dict:
    """The stage's own preflight (its SWARM_STAGE_OK payload) for ``layers`` of ``model``."""
    from swarm.config import StageConfig
    from swarm.stage.preflight import preflight

    return preflight(StageConfig.of(model=str(model), layers=layers, dtype=dtype, device="cpu", key_path=key))


def test_the_cache_holds_latents_and_every_count_of_kv_bytes_agrees(synthetic, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # preflight sets it; restored afterwards
    model = synthetic("deepseek_v3", "float32")
    block = load_block(model, LayerRange(1, 3), dtype="float32", device="cpu")
    cache = block.new_cache(64)
    block.forward(cache, 0, hidden=torch.randn(1, 5, CONFIG["hidden_size"]))
    for layer in (1, 2):  # one "head": the latent as keys, the rotary key as values; no per-head K or V
        assert cache._keys[layer].shape == (1, 64, 1, CONFIG["kv_lora_rank"])
        assert cache._values[layer].shape == (1, 64, 1, CONFIG["qk_rope_head_dim"])
    assert block.kv_bytes_per_position() == 2 * LATENT * 4 == cache.nbytes() // 64
    assert block.kv_bytes_per_position(LayerRange(2, 3)) == LATENT * 4
    config = json.loads((model / "config.json").read_text())
    assert plan.kv_bytes_per_token_layer(config, "float32") == LATENT * 4
    assert plan.kv_bytes_per_token_layer(config, "bfloat16") == LATENT * 2
    assert _preflight(model, LayerRange(1, 3), "float32", tmp_path / "k")["kv_bytes_per_position"] == 2 * LATENT * 4


def test_the_router_stays_float32_in_a_bfloat16_block_as_transformers_keeps_it(synthetic, tmp_path,
                                                                                monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = synthetic("deepseek_v3", "float32")
    block = load_block(model, LayerRange(1, 2), dtype="bfloat16", device="cpu")
    gate = block.layers[0].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert block.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).model.layers[1].mlp.gate
    assert ref.weight.dtype == torch.float32 and torch.equal(ref.weight, gate.weight)
    assert block.loaded_bytes == plan.range_bytes(plan.model_shapes(model), LayerRange(1, 2), "bfloat16") \
        == _preflight(model, LayerRange(1, 2), "bfloat16", tmp_path / "k")["weights_bytes"]


def test_swarm_plan_counts_dense_and_moe_layers_apart(synthetic) -> None:
    model = synthetic("deepseek_v3", "float32")
    fp = plan.footprint(plan.model_shapes(model), "float32")
    assert fp.per_layer[0] < fp.per_layer[1] == fp.per_layer[3] == fp.layer  # first_k_dense_replace = 1
    for a, b in RANGES:
        block = load_block(model, LayerRange(a, b), dtype="float32", device="cpu")
        extra = (fp.head if a == 0 else 0) + (fp.tail if b == 4 else 0)
        assert block.loaded_bytes == fp.layers_bytes(LayerRange(a, b)) + extra == fp.stage_bytes(LayerRange(a, b), 0)


def test_swarm_plan_on_the_published_deepseek_v3_config() -> None:
    fp = plan.footprint(plan.model_shapes(DEEPSEEK_V3), "bfloat16")
    assert fp.total == 2 * 671_132_864_512  # its 671B parameters (the MTP layer is no stage's)
    assert fp.kv_token_layer == (512 + 64) * 2  # the latent and the rotary key, not 2 x 128 heads x 192
    assert fp.per_layer[0] < fp.per_layer[3]  # three dense layers, then MoE layers
    placements = plan.split(fp, [80 * 10**9] * 24, kv_tokens=4096, reserve=10**9)  # 3 MoE layers a card
    held = [p.layers for p in placements if p.layers]
    assert held[0].start == 0 and held[-1].end == 61 and all(x.end == y.start for x, y in zip(held, held[1:]))
    assert all(p.bytes <= p.capacity - 10**9 for p in placements)


@pytest.mark.ring
def test_a_three_stage_ring_equals_transformers_in_float32(synthetic, tmp_path) -> None:
    from tests.support.ring import run_inprocess

    model = synthetic("deepseek_v3", "float32")
    want = reference_greedy(model, PROMPT, 12, "float32")
    assert run_inprocess(model, RANGES, PROMPT, 12, tmp_path, dtype="float32") == want


def test_healed_by_replay_equals_uninterrupted_with_ties(tied) -> None:
    """Exactness contract 3: a ring whose stages all restart from nothing and replay the committed prefix
    in one chunk (``swarm.heal.plan_replay``) reproduces the driver token and continues with the bits of
    the uninterrupted run (decode steps one position at a time)."""
    blocks = _blocks(tied)
    want, want_rows = _decode(blocks, [b.new_cache(64) for b in blocks], 0, PROMPT, 12)
    replay = plan_replay(PROMPT, want[:5])
    spares = _blocks(tied)  # fresh stages holding the same layers
    got, got_rows = _decode(spares, [b.new_cache(64) for b in spares], 0, list(replay.prefix), 8)
    assert got[0] == replay.driver == want[4]
    assert got == want[4:] and all(torch.equal(a, b) for a, b in zip(got_rows, want_rows[4:]))
    assert chained_greedy(blocks, PROMPT, 12) == want


def test_the_proof_fails_on_a_non_invariant_mla_path(synthetic) -> None:
    """Latent attention whose chunk rows come out one ulp off their one-token bits (as attention over a
    chunk-wide expanded K can) must fail the start-up proof, in the fma mode as in rows."""
    model = synthetic("deepseek_v3", "float32")
    block = load_block(model, LayerRange(0, 2), dtype="float32", device="cpu")
    assert check_block(block).ok
    for layer in block.layers:
        attn = layer.self_attn
        wrapped = attn.forward

        def by_width(hidden_states, *args, wrapped=wrapped, **kwargs):
            out, weights = wrapped(hidden_states, *args, **kwargs)
            if hidden_states.shape[1] > 1:
                out = torch.nextafter(out, torch.full_like(out, float("inf")))
            return out, weights

        attn.forward = by_width
    for mode in ("rows", block.kernel_mode):
        block.set_kernel_mode(mode)
        report = check_block(block)
        assert not report.ok and "differs when chunked" in report.reason

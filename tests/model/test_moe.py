"""Sparse mixture-of-experts families (``swarm.model.moe``): per-expert weights fused, stable routing,
per-token expert blocks; every contract on MoE blocks, with routing ties forced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.kernels.check import check_block
from swarm.model import moe
from swarm.model.block import block_tensor_names, load_block
from swarm.ranges import LayerRange
from tests.support.models import FAMILY_CONFIGS, MOE_FAMILIES, chained_greedy, make_synthetic
from tests.support.ring import greedy_and_speculative

PROMPT = [1, 5, 9, 3, 7, 2, 8, 11, 4]
RANGES = [(0, 1), (1, 3), (3, 4)]


def _tied_routes(model_dir: Path, out_dir: Path) -> Path:
    """A copy of ``model_dir`` whose routers give experts 0 and 1 (and 2 and 3) the same scores for
    every token: each pair's router rows made equal, so every choice between them is a tie.

    DeepSeek-V3's grouped router: experts 0-5 (groups 0, 1 and 2 of two) get one router row and one
    score correction bias, above every other expert's, so every token's choice is a tie twice over:
    two of the three tied groups stay eligible (groups 0 and 1), three of their four tied experts are
    chosen (experts 0, 1, 2). Dense layers (``first_k_dense_replace``) have no router."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)  # gpt-oss: biased
            if router is None:  # a dense MLP
                continue
            if hasattr(router, "e_score_correction_bias"):
                router.weight[1:6].copy_(router.weight[0].expand(5, -1))
                router.e_score_correction_bias[:6] = 1.0
                continue
            for p in (router.weight, getattr(router, "bias", None)):
                if p is not None:
                    p[1].copy_(p[0])
                    p[3].copy_(p[2])
    model.save_pretrained(out_dir)
    return out_dir


def test_a_tie_goes_to_the_lower_expert_index() -> None:
    class Router(torch.nn.Module):  # shaped like transformers' top-k routers
        def __init__(self, qwen: bool):
            super().__init__()
            self.top_k, self.hidden_dim = 2, 4
            self.weight = torch.nn.Parameter(torch.tensor([[1.0, 0, 0, 0], [2, 0, 0, 0], [2, 0, 0, 0], [2, 0, 0, 0]]))
            if qwen:
                self.norm_topk_prob = False

    for qwen in (False, True):
        router = Router(qwen)
        moe.stable_router(router)
        _, weights, chosen = router(torch.tensor([[1.0, 0, 0, 0]]))
        assert chosen.tolist() == [[1, 2]]  # experts 1, 2 and 3 tie: the two lowest indices, in order
        assert weights[0, 0] == weights[0, 1]
        if not qwen:  # Mixtral normalises the top-k weights
            assert torch.allclose(weights.sum(), torch.tensor(1.0))


def _deepseek_router():
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = AutoConfig.for_model("deepseek_v3", **FAMILY_CONFIGS["deepseek_v3"])  # 8 experts, 4 groups of 2
    return DeepseekV3TopkRouter(config)


def test_grouped_routing_ties_go_to_the_lower_group_and_expert_index() -> None:
    router = _deepseek_router()
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor([0.0, 1, 1, 1, 1, 1, 1, 3])  # experts 1-6 tie, 7 is best, 0 worst
    moe.grouped_router(router)
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    # group sums of their best two (groups of two experts): g0 = s0 + s1 < g1 = g2 = 2 s1 (a tie) < g3 = s1 + s3:
    # g3 and then g1 (not g2) stay eligible; the top 3 of experts 2, 3, 6, 7: 7, then 2 and 3 (6 ties them)
    logits, weights, chosen = router(x)
    assert chosen.tolist() == [[7, 2, 3]]
    scores = torch.sigmoid(logits)[:, [7, 2, 3]]
    assert torch.equal(weights, scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor)


def test_grouped_routing_picks_what_transformers_picks_without_ties() -> None:
    torch.manual_seed(0)
    router, plain = _deepseek_router(), _deepseek_router()
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.1)
        plain.load_state_dict(router.state_dict())
    moe.grouped_router(router)
    x = torch.randn(64, 32)
    logits, weights, chosen = router(x)
    want_logits, want_weights, want_chosen = plain(x)
    assert torch.equal(logits, want_logits)
    order, want_order = chosen.argsort(dim=-1), want_chosen.argsort(dim=-1)  # transformers' order is unsorted
    assert torch.equal(chosen.gather(1, order), want_chosen.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_block_reads_only_its_layers_experts_and_passes_the_proof(family, tmp_path) -> None:
    d = make_synthetic(family, tmp_path / family, dtype="float32")
    block = load_block(d, LayerRange(1, 3), dtype="float32", device="cpu")
    names = block_tensor_names(d, LayerRange(1, 3))
    assert set(block.loaded_tensors) == names
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in names)
    # Mixtral's and Qwen's checkpoints hold experts one by one (fused on load), gpt-oss's fused already
    assert any((".experts.3." if family != "gpt_oss" else ".experts.gate_up_proj") in n for n in names)
    assert check_block(block).ok and check_block(block, 2).ok


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_the_proof_fails_on_a_non_invariant_moe_path(family, tmp_path) -> None:
    """An expert block whose chunk rows come out one ulp off their one-token bits (as transformers'
    grouped expert GEMMs can) must fail the start-up proof."""
    d = make_synthetic(family, tmp_path / "m", dtype="float32")
    block = load_block(d, LayerRange(1, 3), dtype="float32", device="cpu")
    assert check_block(block, 2).ok
    for layer in block.layers:
        wrapped = layer.mlp.forward

        def by_width(x, wrapped=wrapped):
            y = wrapped(x)
            return y if x.shape[1] == 1 else torch.nextafter(y, torch.full_like(y, float("inf")))

        layer.mlp.forward = by_width
    report = check_block(block, 2)
    assert not report.ok and "differs" in report.reason


@pytest.mark.ring
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_forced_ties_keep_ring_one_process_speculative_and_packed_alike(family, tmp_path) -> None:
    d = _tied_routes(make_synthetic(family, tmp_path / "src", dtype="float64"), tmp_path / "tied")
    blocks = [load_block(d, LayerRange(a, b), dtype="float64", device="cpu") for a, b in RANGES]
    reference = chained_greedy(blocks, PROMPT, 10)
    assert all(check_block(b, 2).ok for b in blocks)

    greedy, speculative = greedy_and_speculative(d, RANGES, PROMPT, 10, tmp_path)
    assert greedy == reference == speculative


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_swarm_plan_counts_what_a_moe_block_holds(family, tmp_path) -> None:
    from swarm.model import plan

    d = make_synthetic(family, tmp_path / family, dtype="float32")
    model = plan.model_shapes(d)
    for scheme, dtype in (("float32", "float32"), ("int8", "auto")):
        quantize = None if scheme == "float32" else scheme
        block = load_block(d, LayerRange(1, 3), dtype=dtype, device="cpu", quantize=quantize)
        assert block.loaded_bytes == plan.range_bytes(model, LayerRange(1, 3), scheme)


@pytest.mark.ring
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_forced_ties_keep_a_healed_generation_identical_to_the_uninterrupted_one(family, tmp_path) -> None:
    """The middle stage of a 3-stage ring of a tied MoE model stops mid-generation; the spare takes its
    range from the survivors' resent hidden states, and the ids equal one process's uninterrupted run."""
    from tests.coordinator.test_heal_kept import NEW, PROMPT as HEAL_PROMPT, RANGES as HEAL_RANGES, heal_inprocess

    d = _tied_routes(make_synthetic(family, tmp_path / "src", dtype="float64"), tmp_path / "tied")
    blocks = [load_block(d, LayerRange(a, b), dtype="float64", device="cpu") for a, b in HEAL_RANGES]
    out, rec, _ = heal_inprocess(d, tmp_path, 1)
    assert out == chained_greedy(blocks, HEAL_PROMPT, NEW)
    (event,) = rec["heal_events"]
    assert event["stage"] == 1 and event["replay"] == "survivors_kept", event


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_forced_ties_keep_a_session_resumed_from_a_stored_prefix_identical_to_a_fresh_one(family, tmp_path) -> None:
    """Exactness contract 5 on every MoE family with tied routes: a session resumed from another's stored
    prefix blocks (the stage's PrefixStore) decodes the bits a fresh prefill gives."""
    from tests.model.test_mla import assert_resumed_equals_fresh

    d = _tied_routes(make_synthetic(family, tmp_path / "src", dtype="float64"), tmp_path / "tied")
    blocks = [load_block(d, LayerRange(a, b), dtype="float64", device="cpu") for a, b in RANGES]
    assert_resumed_equals_fresh(blocks, PROMPT)

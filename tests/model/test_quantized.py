"""Blocks with weights held quantized (``load_block(quantize=...)``, ``swarm stage --quantize``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.config import StageConfig
from swarm.errors import ConfigError
from swarm.kernels import quant
from swarm.kernels.check import check_block
from swarm.kernels.facts import stage_class
from swarm.model import plan
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from swarm.stage.preflight import preflight
from tests.support.models import chained_greedy, make_synthetic
from tests.support.ring import greedy_and_speculative

pytestmark = pytest.mark.skipif(not quant.usable()[0], reason=quant.usable()[1] or "usable")

RANGES = [(0, 1), (1, 3), (3, 4)]
PROMPT = [5, 17, 42, 8, 61, 23, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # untied: the LM head (97 x 32) is int8-quantized too (int4 leaves it: 97 rows are not a multiple of 16)
    return make_synthetic("llama", tmp_path_factory.mktemp("q"), dtype="float32", tie_word_embeddings=False)


def _blocks(model_dir: Path, scheme: str | None, ranges=RANGES):
    return [load_block(model_dir, LayerRange(a, b), dtype="bfloat16", device="cpu", quantize=scheme) for a, b in ranges]


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_quantized_blocks_hold_the_planned_bytes_and_pass_the_startup_proof(tiny, scheme, tmp_path,
                                                                             monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # preflight sets it; restored afterwards
    model = plan.model_shapes(tiny)
    dense = _blocks(tiny, None)
    for (a, b), block, full in zip(RANGES, _blocks(tiny, scheme), dense):
        r = LayerRange(a, b)
        reported = preflight(StageConfig.of(model=str(tiny), layers=r, quantize=scheme, device="cpu",
                                         key_path=tmp_path / "k.key"))
        assert block.loaded_bytes == plan.range_bytes(model, r, scheme) == reported["weights_bytes"]
        assert reported["quantize"] == scheme and reported["dtype"] == "bfloat16"
        assert block.loaded_bytes < full.loaded_bytes
        assert check_block(block).ok
        facts = stage_class(block).facts
        assert facts["quant"]["scheme"] == scheme and stage_class(full).id != stage_class(block).id
        held = [m for m in block.layers.modules() if "swarm_quant" in m.__dict__]
        assert held and all(m.weight.numel() == 0 for m in held)  # the float copies are gone
    # the quantized path really computes with other weights than the bfloat16 block
    x = torch.tensor([PROMPT])
    q0, d0 = _blocks(tiny, scheme, [(0, 1)])[0], dense[0]
    assert not torch.equal(q0.forward(q0.new_cache(), 0, token_ids=x), d0.forward(d0.new_cache(), 0, token_ids=x))


def test_a_non_invariant_quantized_path_fails_the_proof(tiny, monkeypatch) -> None:
    """A quantized GEMM whose chunk rows come out one ulp off their solo bits (as a kernel switching
    algorithms by M would give) must fail check_block."""
    block = _blocks(tiny, "int8", [(1, 3)])[0]
    real = quant.linear_rows

    def by_width(x, q, bias, tile):
        y = real(x, q, bias, tile)
        return y if x.shape[0] == 1 else torch.nextafter(y, torch.full_like(y, float("inf")))

    assert check_block(block, 2).ok
    monkeypatch.setattr(quant, "linear_rows", by_width)
    report = check_block(block, 2)  # packed sessions: rows of several sessions share each call
    assert not report.ok and "differs" in report.reason


def test_quantization_needs_bfloat16_on_the_cpu(tiny) -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        load_block(tiny, LayerRange(0, 1), dtype="float32", device="cpu", quantize="int8")
    with pytest.raises(ConfigError, match="int8, int4"):
        load_block(tiny, LayerRange(0, 1), device="cpu", quantize="int3")
    with pytest.raises(ConfigError, match="int8, int4"):
        StageConfig.of(model=str(tiny), layers=LayerRange(0, 1), quantize="nf4")


@pytest.mark.ring
@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_a_quantized_ring_is_one_process_with_the_same_weights_and_speculation_is_greedy(tiny, scheme,
                                                                                           tmp_path) -> None:
    reference = chained_greedy(_blocks(tiny, scheme), PROMPT, 10)

    greedy, speculative = greedy_and_speculative(tiny, RANGES, PROMPT, 10, tmp_path, dtype="auto", quantize=scheme)
    assert greedy == reference == speculative


def test_an_auditor_loads_the_scheme_a_receipt_names(tiny) -> None:
    from swarm.auditor.judge import Blocks

    block = _blocks(tiny, "int4", [(1, 3)])[0]
    receipt = {"layers": [1, 3], "dtype": "bfloat16", "repro": stage_class(block).as_dict()}
    again = Blocks(tiny).for_receipt(receipt)
    assert again.quantize == "int4" and stage_class(again).id == stage_class(block).id
    assert Blocks(tiny).for_receipt({"layers": [1, 3], "dtype": "bfloat16"}).quantize is None

"""swarm.kernels.facts: a block's reproducibility class, and within one class the same bits at any
thread count (check_block's recorded inputs through its own groupings)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from swarm import repro
from swarm.kernels import check, facts, fma
from swarm.model.block import load_block
from swarm.ranges import LayerRange

FMA_OK, FMA_WHY = fma.available()
WIDE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
            num_hidden_layers=2, vocab_size=2048)  # SmolLM2's widths: GEMMs wide enough to be split over threads


def _digest(outs) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in outs:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _run_at(block, threads: int, tile: int) -> tuple[str, str]:
    """check_block's seeded sessions, chunked and packed, at ``threads`` threads: (digest, class id)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    fma.set_threads(threads)
    try:
        plans = check._inputs(block, seed=3)
        chunked = [t for plan in plans for t in check._chunked_solo(block, plan, tile)]
        packed = [t for outs in check._packed(block, plans, tile, seed=3) for t in outs]
        return _digest(chunked + packed), facts.stage_class(block, tile=tile).id
    finally:
        torch.set_num_threads(before)
        fma.set_threads(None)


@pytest.mark.skipif(not FMA_OK, reason=f"the fma kernels cannot run here: {FMA_WHY}")
def test_fma_one_class_gives_the_same_bits_at_any_thread_count(synthetic):
    model = synthetic("llama", "float32", **WIDE)
    for part in ((0, 1), (1, 2)):  # the head (token ids in) and the tail (logits out)
        block = load_block(model, LayerRange(*part), dtype="float32", device="cpu")
        block.set_kernel_mode("fma")
        one, two, four = (_run_at(block, n, tile=1) for n in (1, 2, 4))
        assert one == two == four


def test_rows_same_class_same_bits_and_a_thread_count_that_changes_bits_changes_the_class(synthetic):
    """In the rows mode the BLAS's bits depend on torch's thread count, so the class names it: equal
    classes give equal bits, and wherever bits differ the classes differ too (never the reverse)."""
    model = synthetic("llama", "float32", **WIDE)
    for part in ((0, 1), (1, 2)):
        block = load_block(model, LayerRange(*part), dtype="float32", device="cpu")
        block.set_kernel_mode("rows")
        runs = [_run_at(block, n, tile=1) for n in (1, 2, 1, 2)]
        assert runs[0] == runs[2] and runs[1] == runs[3]  # one class: the same bits, run after run
        assert runs[0][1] != runs[1][1]  # 1 and 2 threads are two classes


def test_the_class_states_the_facts_of_the_block(synthetic):
    model = synthetic("llama", "float32", **WIDE)
    block = load_block(model, LayerRange(0, 2), dtype="float32", device="cpu")
    block.set_kernel_mode("rows")
    rows = facts.stage_class(block)
    f = rows.facts
    assert f["schema"] == repro.SCHEMA and f["device"] == "cpu" and f["dtype"] == "float32"
    assert f["torch"] == torch.__version__ and f["weights"] == block.range_digest
    assert f["kernel"]["mode"] == "rows" and f["kernel"]["tile"] == 1
    assert "cpu_vendor" in f  # the rows mode runs the BLAS, whose paths differ by vendor
    assert f["blas"] and f["isa"].startswith(("x86_64", "aarch64", "arm64", "AMD64"))
    assert repro.parse(rows.as_dict()) == rows
    tiled = facts.stage_class(block, tile=8)
    assert "kernel.tile 1 vs 8" in repro.comparable(rows, tiled).reason
    other = load_block(model, LayerRange(0, 1), dtype="float32", device="cpu")
    other.set_kernel_mode("rows")
    assert "weights" in repro.comparable(rows, facts.stage_class(other)).reason
    if FMA_OK:
        block.set_kernel_mode("fma")
        fused = facts.stage_class(block)
        assert "cpu_vendor" not in fused.facts  # fma.c's arithmetic is fixed by its source
        assert fused.facts["kernel"]["key_block"] == 64
        assert "kernel.mode rows vs fma" in repro.comparable(rows, fused).reason


def test_a_sub_range_class_names_its_own_weights(synthetic):
    model = synthetic("llama", "float32", **WIDE)
    block = load_block(model, LayerRange(0, 2), dtype="float32", device="cpu")
    whole, part = facts.stage_class(block), facts.stage_class(block, LayerRange(1, 2))
    assert part.facts["weights"] == block.digest_of(LayerRange(1, 2)) != whole.facts["weights"]


def test_the_thread_count_is_a_fact_of_the_rows_mode_on_the_cpu_only():
    assert facts.kernel_facts("rows", 1, threads=3)["threads"] == 3
    assert "threads" not in facts.kernel_facts("rows", 1, threads=3, cpu=False)
    assert "threads" not in facts.kernel_facts("fma", 1, threads=3)


def test_bad_kernel_facts_are_refused():
    with pytest.raises(ValueError, match="unknown kernel mode"):
        facts.kernel_facts("turbo")
    with pytest.raises(ValueError, match="at least 1"):
        facts.kernel_facts("rows", 0)


def test_kernels_in_use_names_the_isa_and_library_or_why_rows():
    """What a stage reports of its kernels (READY, --check, info_ok, /metrics, the dashboard)."""
    rows = facts.kernels_in_use("rows", "SWARM_KERNELS=rows")
    assert rows.as_dict() == {"mode": "rows", "isa": "", "library": "torch", "arithmetic": "",
                              "why": "SWARM_KERNELS=rows", "bf16_dot": ""}
    with pytest.raises(ValueError, match="unknown kernel mode"):
        facts.kernels_in_use("gemv")
    if not FMA_OK:
        with pytest.raises(RuntimeError, match="unavailable"):
            facts.kernels_in_use("fma")
        return
    path = fma.describe()
    used = facts.kernels_in_use("fma", "ignored outside rows")
    assert used == facts.KernelsInUse("fma", isa=fma.isa(), library=path.library, arithmetic=path.arithmetic,
                                      bf16_dot=path.bf16_dot)
    assert used.bf16_dot in ("vdpbf16ps", "fma")
    assert used.isa in ("avx512", "avx2", "neon") and used.library in ("installed", "built at run time")
    assert used.why == "" and used.arithmetic

"""Row-invariant kernels: a position's bits never depend on what shares its forward, on every family,
in float32 and bfloat16, on whichever x86-64 CPU runs the suite; and the start-up proof
(check_block) is the same property, failing where plain GEMMs would break it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swarm.kernels import check, fma, invariant
from swarm.kernels.check import check_block
from swarm.model.block import load_block
from swarm.model.cache import KVCache
from swarm.ranges import LayerRange
from tests.support.models import FAMILY_CONFIGS

# widths that are not multiples of any vector length, so tails and alignment show
ODD = {"gpt2": dict(n_embd=40, n_inner=172)}
WIDE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
            num_hidden_layers=2, vocab_size=2048)  # SmolLM2's widths


FMA_OK, FMA_WHY = fma.available()
needs_fma = pytest.mark.skipif(not FMA_OK, reason=f"the fma kernels cannot run here: {FMA_WHY}")
MODES = [("float32", "fma"), ("float32", "rows"), ("bfloat16", "fma"), ("bfloat16", "rows")]


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("dtype,mode", MODES)
# tile 2 proves twice the rows at about three times the cost: it runs in `make test`, not in the unit tier
@pytest.mark.parametrize("tile", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_every_family_proves_row_invariance(synthetic, family, dtype, mode, tile):
    if mode == "fma" and not FMA_OK:
        pytest.skip(f"the fma kernels cannot run here: {FMA_WHY}")
    model = synthetic(family, "float32", **ODD.get(family, dict(hidden_size=40, intermediate_size=172)))
    for part in ((0, 2), (2, 4)):
        block = load_block(model, LayerRange(*part), dtype=dtype, device="cpu")
        assert block.kernel_mode == ("fma" if FMA_OK else "rows")
        block.set_kernel_mode(mode)
        report = check_block(block, tile)
        assert report.ok, report.reason
        assert report.tile == tile and report.seconds > 0


def _one_gemm(x, weight_t, bias, tile):
    """What a stage ran before: one GEMM over all rows, whatever their number."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_proof_fails_where_plain_gemms_break_speculation(synthetic, dtype, monkeypatch):
    """At SmolLM2's widths a 5-row GEMM (a verify chunk) gives a row other bits than the 1-row GEMM
    of a decode step. The proof catches that kernel; the row-invariant one passes."""
    torch.manual_seed(0)
    w = torch.randn(1536, 576).to(getattr(torch, dtype))
    x = torch.randn(5, 576).to(w.dtype)
    if all(torch.equal((x @ w.t())[i], (x[i:i + 1] @ w.t())[0]) for i in range(5)):
        pytest.skip("this BLAS happens to give 1-row and 5-row GEMMs the same bits here")
    model = synthetic("llama", "float32", **WIDE)
    block = load_block(model, LayerRange(0, 2), dtype=dtype, device="cpu")
    block.set_kernel_mode("rows")
    assert check_block(block, 1).ok
    monkeypatch.setattr(invariant, "linear_rows", _one_gemm)
    report = check_block(block, 1)
    assert not report.ok and "differs when chunked" in report.reason


@needs_fma
@pytest.mark.slow  # SmolLM2's widths: the costliest proof of the file; `make test` runs it
def test_the_proof_fails_where_the_fma_gemm_is_swapped_for_a_blas_gemm(synthetic, monkeypatch):
    """The fma mode's proof is no formality: with the BLAS's GEMM in place of the fma kernel's, a
    5-row chunk's rows stop matching decode rows, and the stage falls back to rows mode, proven."""
    from swarm.stage.kernel_proofs import prove_kernels

    torch.manual_seed(0)
    w, x = torch.randn(1536, 576), torch.randn(5, 576)
    if all(torch.equal((x @ w.t())[i], (x[i:i + 1] @ w.t())[0]) for i in range(5)):
        pytest.skip("this BLAS happens to give 1-row and 5-row GEMMs the same bits here")
    block = load_block(synthetic("llama", "float32", **WIDE), LayerRange(0, 2), dtype="float32", device="cpu")
    assert block.kernel_mode == "fma" and check_block(block, 1).ok
    monkeypatch.setattr(fma, "linear", lambda x, w, b=None: F.linear(x, w, b))
    report = check_block(block, 1)
    assert not report.ok and "fma kernels" in report.reason and "differs when chunked" in report.reason
    monkeypatch.setenv("SWARM_CACHE", str(block.model_dir.parent / "cache"))
    monkeypatch.setattr(check, "_REPORTS", {})  # proofs of the same weights by earlier tests
    kernels = prove_kernels(block)
    assert kernels["mode"] == "rows" and kernels["rows_ok"] and block.kernel_mode == "rows"
    assert kernels["why"].startswith("the fma kernels failed the start-up proof: ") and \
        "differs when chunked" in kernels["why"] and kernels["library"] == "torch" and kernels["isa"] == ""


@needs_fma
@pytest.mark.parametrize("k,n", [(576, 1536), (13, 7), (40, 172)])
def test_fma_linear_gives_a_row_the_same_bits_for_any_number_of_rows(k, n):
    torch.manual_seed(5)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(40, k)
    ref = fma.linear(x, w, b)
    torch.testing.assert_close(ref, F.linear(x.double(), w.double(), b.double()).float(), rtol=1e-4, atol=1e-4)
    for m in (1, 2, 3, 4, 5, 8, 17):
        for start in (0, 3):
            got = fma.linear(x[start:start + m].clone(), w, b)
            assert torch.equal(got, ref[start:start + m])
    assert fma.linear(x[:0], w, b).shape == (0, n)
    with pytest.raises(ValueError, match="shapes"):
        fma.linear(x, w[:, :-1], b)
    with pytest.raises(ValueError, match="float32"):
        fma.linear(x.double(), w, b)


@needs_fma
# SmolLM2's heads (9, 3, 64) over 150 keys cost the most: in `make test`, not in the unit tier
@pytest.mark.parametrize("h,hkv,dh,window,s", [pytest.param(9, 3, 64, None, 150, marks=pytest.mark.slow),
                                              (4, 4, 13, None, 23), (8, 2, 16, 5, 23),
                                              (8, 1, 16, 70, 150), (6, 3, 8, None, 130)])
def test_fma_attention_is_each_rows_decode_step(h, hkv, dh, window, s):
    """Every query row of a chunk gets the bits of a decode step at its position, over its own keys
    (sliding window included, key blocks of 64 crossed, kv heads with more than 3 query heads), and
    matches softmax attention computed in float64."""
    torch.manual_seed(6)
    keys, values = torch.randn(s + 41, hkv, dh)[:s], torch.randn(s + 41, hkv, dh)[:s]
    q = torch.randn(s, h, dh)
    full = fma.attention(q, keys, values, 0, dh ** -0.5, window)
    for p in range(s):
        lo = max(0, p - window + 1) if window else 0
        kk, vv = keys[lo:p + 1].double(), values[lo:p + 1].double()
        w = torch.softmax(torch.einsum("jhd,hd->hj", kk[:, torch.arange(h) // (h // hkv)], q[p].double())
                          * dh ** -0.5, -1)
        ref = torch.einsum("hj,jhd->hd", w, vv[:, torch.arange(h) // (h // hkv)])
        torch.testing.assert_close(full[p], ref.float(), rtol=1e-5, atol=1e-5)
        assert torch.equal(fma.attention(q[p:p + 1], keys[:p + 1], values[:p + 1], p, dh ** -0.5, window)[0], full[p])
        if p % 7 == 0:  # a chunk that starts here, over a longer cache
            assert torch.equal(fma.attention(q[p:], keys, values, p, dh ** -0.5, window), full[p:])
    with pytest.raises(ValueError, match="shapes"):
        fma.attention(q, keys[:5], values[:5], 0, 1.0)


@needs_fma
def test_fma_kernels_give_the_same_bits_on_any_number_of_threads():
    """The kernels' threads take disjoint outputs, each computed by the same code: 1, 2 and 3 threads
    (and a call from a second Python thread while the pool is busy) give identical bits."""
    import threading

    torch.manual_seed(8)
    x, w, b = torch.randn(37, 96), torch.randn(300, 96), torch.randn(300)
    q, keys, values = torch.randn(90, 9, 64), torch.randn(200, 3, 64), torch.randn(200, 3, 64)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((fma.linear(x, w, b), fma.attention(q, keys, values, 110, 0.125, None)))
        side: list = []
        worker = threading.Thread(target=lambda: side.append(fma.attention(q, keys, values, 110, 0.125, None)))
        worker.start()
        results.append((fma.linear(x, w, b), fma.attention(q, keys, values, 110, 0.125, None)))
        worker.join()
    finally:
        torch.set_num_threads(before)
    for lin, att in results[1:]:
        assert torch.equal(lin, results[0][0]) and torch.equal(att, results[0][1])
    assert torch.equal(side[0], results[0][1])


@pytest.mark.process
def test_kernels_can_be_turned_off_and_say_why():
    """SWARM_KERNELS=rows (and any machine without AVX2+FMA or a C compiler) gives the rows mode,
    with the reason; loading a block there says so."""
    import subprocess
    import sys

    code = ("from swarm.kernels import fma; ok, why = fma.available(); print(ok, why)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "SWARM_KERNELS": "rows"})
    assert out.stdout.strip() == "False SWARM_KERNELS=rows", out.stderr


def test_linear_rows_ignores_where_the_rows_sit_in_memory():
    """MKL on AMD gives a 2- or 3-row GEMM other bits when its input is not 16-byte aligned: a
    tile sliced out of a packed tensor must not inherit the slice's address."""
    torch.manual_seed(1)
    w = torch.randn(172, 40)
    rows = torch.randn(3, 40)
    ref = invariant.linear_rows(rows, w.t(), None, 2)
    for offset in range(8):
        buf = torch.empty(3 * 40 + 8)
        x = buf[offset:offset + 120].view(3, 40)
        x.copy_(rows)
        assert torch.equal(invariant.linear_rows(x, w.t(), None, 2), ref)
        for tile in (1, 2, 4):  # and a row's result does not depend on the rows beside it
            alone = invariant.linear_rows(x[1:2], w.t(), None, tile)
            assert torch.equal(invariant.linear_rows(x, w.t(), None, tile)[1], alone[0])


def test_linear_rows_pads_and_handles_bias_and_no_rows():
    torch.manual_seed(2)
    w, b = torch.randn(8, 6), torch.randn(8)
    x = torch.randn(5, 6)
    out = invariant.linear_rows(x, w.t(), b, 4)
    assert out.shape == (5, 8)
    torch.testing.assert_close(out, F.linear(x, w, b))
    assert invariant.linear_rows(x[:0], w.t(), b, 4).shape == (0, 8)


def test_per_token_applies_to_each_token_alone():
    torch.manual_seed(3)
    x = torch.randn(1, 7, 13)
    got = invariant.per_token(F.silu, x)
    for i in range(7):
        assert torch.equal(got[:, i:i + 1], F.silu(x[:, i:i + 1].clone()))
    with pytest.raises(ValueError, match=r"\(1, N, \.\.\.\)"):
        invariant.per_token(F.silu, torch.randn(2, 3, 4))


def test_attention_rows_is_the_decode_step_of_each_position():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attn(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    torch.manual_seed(4)
    h, hkv, dh, pos, t = 4, 2, 10, 6, 3
    cache = KVCache([0], 64)
    cache.begin(0, pos + t)
    keys, values = cache.update(torch.randn(1, hkv, pos + t, dh), torch.randn(1, hkv, pos + t, dh), 0)
    query = torch.randn(1, h, t, dh)
    got = invariant.attention_rows(sdpa_attention_forward, Attn(), query, keys, values, pos, lambda m, p, n: None)
    assert got.shape == (1, t, h, dh)
    for i in range(t):
        one, _ = sdpa_attention_forward(Attn(), query[:, :, i:i + 1].clone(), keys[:, :, :pos + i + 1],
                                        values[:, :, :pos + i + 1], None)
        assert torch.equal(got[:, i:i + 1], one)


def test_cache_views_have_the_same_strides_at_any_capacity():
    """A speculative chunk grows a session's cache earlier than decode steps would; the keys a row
    attends to must look the same to the kernel either way."""
    small, large = KVCache([0], 4096), KVCache([0], 4096)
    k = torch.randn(1, 2, 300, 8)
    small.begin(0, 10)
    ks, _ = small.update(k[:, :, :10], k[:, :, :10], 0)
    large.begin(0, 300)
    large.update(k, k, 0)  # grows to capacity 512
    large.commit()
    large.begin(0, 10)  # roll back, as a rejected chunk does, and write the same 10 positions
    kl, _ = large.update(k[:, :, :10], k[:, :, :10], 0)
    assert small._keys[0].shape[1] == 256 and large._keys[0].shape[1] == 512
    assert ks.stride() == kl.stride()
    assert torch.equal(ks, kl)


def test_rotary_table_gives_each_position_the_same_values_in_any_grouping(synthetic):
    block = load_block(synthetic("llama", "float32", head_dim=10), LayerRange(0, 1), dtype="float32", device="cpu")
    like = torch.zeros(1, 1, block.hidden_size)
    fresh = invariant.RotaryTable(block.rotary)
    many = fresh.lookup(like, torch.arange(0, 37).unsqueeze(0))
    other = invariant.RotaryTable(block.rotary)
    for p in (36, 3, 17):
        one = other.lookup(like, torch.tensor([[p]]))
        ref = block.rotary(like, torch.tensor([[p]]))
        for k in (0, 1):
            assert torch.equal(one[k][0, 0], many[k][0, p]) and torch.equal(one[k], ref[k])


def test_forward_rejects_a_bad_tile(synthetic):
    block = load_block(synthetic("llama", "float32"), LayerRange(0, 1), dtype="float32", device="cpu")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="tile"):
            block.forward_batch([(block.new_cache(), 0, torch.tensor([[1]]))], tile=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("tile", [1, 2])
def test_cuda_bf16_proves_row_invariance(synthetic, family, tile):
    """On a GPU in bf16: chunked and packed rows give a position decode's bits, every family (the
    start-up proof a CUDA stage runs)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    model = synthetic(family, "float32", **ODD.get(family, dict(hidden_size=40, intermediate_size=172)))
    for part in ((0, 2), (2, 4)):
        report = check_block(load_block(model, LayerRange(*part), dtype="bfloat16", device="cuda"), tile)
        assert report.ok, report.reason


@needs_fma
def test_fma_norm_and_silu_are_each_rows_own_and_match_torch():
    torch.manual_seed(7)
    x, w = torch.randn(1, 21, 40), torch.randn(40)
    got = fma.rms_norm(x, w, 1e-5)
    ref = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5)
    act = fma.silu(x)
    torch.testing.assert_close(act, F.silu(x), rtol=1e-5, atol=1e-6)
    for i in (0, 5, 20):  # a row alone, at another address, gets the bits it got among others
        assert torch.equal(fma.rms_norm(x[:, i:i + 1].clone(), w, 1e-5)[0, 0], got[0, i])
        assert torch.equal(fma.silu(x[:, i:i + 1].clone())[0, 0], act[0, i])
    with pytest.raises(ValueError, match="weight"):
        fma.rms_norm(x, w[:-1], 1e-5)


@pytest.mark.process
@needs_fma
def test_the_kernel_build_takes_a_compiler_command_line_and_says_why_it_failed(tmp_path, monkeypatch):
    """CC is split like a shell word list; a damaged cached library is built again; a compiler that
    fails silently and an unknown SWARM_KERNELS value each give a reason, never a crash. (Each build
    in a fresh interpreter: a library loaded here must not be rewritten under this process.)"""
    import os
    import subprocess
    import sys

    def build(cc: str) -> list[str]:
        code = "from swarm.kernels import fma; lib, why = fma._build(); print(lib is not None); print(why)"
        env = {**os.environ, "SWARM_CACHE": str(tmp_path), "CC": cc}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    # a compiler command line of two words, whose last -O0 overrides the build's -O3: the test is of the
    # build's plumbing, not of its code, and an unoptimized build takes a fraction of the time
    quick = tmp_path / "cc-O0.sh"
    quick.write_text('#!/bin/sh\nexec gcc "$@" -O0\n')
    assert build(f"sh {quick}") == ["True", ""]
    built = list((tmp_path / "kernels").glob("fma-*.so"))
    assert len(built) == 1
    damaged = built[0].with_suffix(".bad")
    damaged.write_bytes(b"not a library")
    damaged.replace(built[0])
    assert build(f"sh {quick}") == ["True", ""] and built[0].stat().st_size > 1000  # built again
    ok, why = build("false")
    assert ok == "False" and "false could not build fma.c: exit status 1" in why
    assert not list((tmp_path / "kernels").glob("*.tmp"))
    monkeypatch.setenv("SWARM_KERNELS", "row")
    assert fma.available() == (False, "SWARM_KERNELS='row' is not one of auto, fma, triton, rows")

"""The triton kernel mode: a row's bits never depend on what shares its call, in each Triton kernel and
through a whole block, on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported when there is no CUDA device) and, marked ``gpu``, on a real CUDA device.

Each invariance check compares a row computed among others with the same row computed alone, so it
fails for a kernel whose tiles, split of K or key blocks follow the number of rows (shown below by
running the same kernels with such a choice)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # no GPU: run the kernels' logic in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (`make test` installs it with the test extra)")

from swarm.kernels import check, facts, triton_ops  # noqa: E402
from swarm.kernels.check import check_block  # noqa: E402
from swarm.model.block import load_block  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from tests.support.models import FAMILY_CONFIGS, chained_greedy, reference_greedy  # noqa: E402

interpreted = pytest.mark.skipif(not triton_ops.INTERPRETED,
                                 reason="Triton's interpreter is off (TRITON_INTERPRET was unset at import)")


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    if triton_ops.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels would run in the interpreter, not on the GPU")


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
SMALL = dict(num_hidden_layers=2)  # two tiny layers: the interpreter runs each kernel launch in Python


def _linear_rows_are_their_own(device: str, dtype: torch.dtype) -> None:
    """Rows of a 40-row GEMM (K crosses a BLOCK_K step, N crosses a BLOCK_N tile) get the bits of the
    same rows alone, in 5- and 37-row calls at other offsets and beside other neighbours."""
    gen = torch.Generator().manual_seed(5)
    k, n = triton_ops.BLOCK_K + 36, triton_ops.BLOCK_N + 6
    w, b, x = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((n, k), (n,), (40, k)))
    ref = triton_ops.linear(x, w, b)
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(ref.double(), want, **TOL[dtype])
    for m in (1, 5, 37):
        for start in (0, 3):
            if start + m > 40:
                continue
            assert torch.equal(triton_ops.linear(x[start:start + m].clone(), w, b), ref[start:start + m])
            noisy = torch.randn(m + 4, k, generator=gen).to(device, dtype)
            noisy[2:2 + m] = x[start:start + m]  # the same rows among other neighbours, at another slot
            assert torch.equal(triton_ops.linear(noisy, w, b)[2:2 + m], ref[start:start + m])
    assert torch.equal(triton_ops.linear(x[7:8], w)[0], triton_ops.linear(x, w)[7])  # no bias, a strided row
    assert triton_ops.linear(x[:0], w, b).shape == (0, n)


def _attention_rows_are_decode_steps(device: str, dtype: torch.dtype, h: int, hkv: int, dh: int,
                                     window: int | None, s: int) -> None:
    """Every query row of a chunk gets the bits of a decode step at its position over its own keys
    (grouped-query heads, a sliding window, key blocks crossed), close to softmax attention in float64."""
    gen = torch.Generator().manual_seed(6)
    keys = torch.randn(s + 9, hkv, dh, generator=gen).to(device, dtype)[:s]  # a cache with room to spare
    values = torch.randn(s + 9, hkv, dh, generator=gen).to(device, dtype)[:s]
    q = torch.randn(s, h, dh, generator=gen).to(device, dtype)
    scale = dh ** -0.5
    full = triton_ops.attention(q, keys, values, 0, scale, window)
    group = torch.arange(h, device=device) // (h // hkv)
    for p in range(0, s, 11):
        lo = max(0, p - window + 1) if window else 0
        kk, vv = keys[lo:p + 1].double()[:, group], values[lo:p + 1].double()[:, group]
        weights = torch.softmax(torch.einsum("jhd,hd->hj", kk, q[p].double()) * scale, -1)
        torch.testing.assert_close(full[p].double(), torch.einsum("hj,jhd->hd", weights, vv), **TOL[dtype])
        decode = triton_ops.attention(q[p:p + 1].clone(), keys[:p + 1], values[:p + 1], p, scale, window)
        assert torch.equal(decode[0], full[p])
        chunk = triton_ops.attention(q[p:p + 5], keys[:p + 5], values[:p + 5], p, scale, window)  # a verify chunk
        assert torch.equal(chunk, full[p:p + 5])


def _norms_are_each_rows_own(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(1, 21, 40, generator=gen).to(device, dtype), torch.randn(40, generator=gen).to(device, dtype)
    got = triton_ops.rms_norm(x, w, 1e-5)
    xd = x.double()
    torch.testing.assert_close(got.double(), w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5),
                               **TOL[dtype])
    act = triton_ops.silu(x)
    torch.testing.assert_close(act.double(), F.silu(xd), **TOL[dtype])
    for i in (0, 5, 20):  # a row alone, at another address, gets the bits it got among others
        assert torch.equal(triton_ops.rms_norm(x[:, i:i + 1].clone(), w, 1e-5)[0, 0], got[0, i])
        assert torch.equal(triton_ops.silu(x[:, i:i + 1].clone())[0, 0], act[0, i])


# (H, Hkv, Dh, window, S): grouped heads and an odd head width over two key blocks; a window whose
# first key passes the first block (row 88 sees keys [69, 88]); one kv head and a short window
# the interpreter runs each program in Python: the two 100-row cases take 3-6 s each, so `make test` runs them
# and the unit tier only the 30-row one (grouped heads and a window crossing key blocks all the same)
ATTENTION = [pytest.param(8, 2, 13, None, 100, marks=pytest.mark.slow),
             pytest.param(4, 4, 16, 20, 100, marks=pytest.mark.slow), (4, 1, 8, 5, 30)]


@interpreted
def test_linear_gives_a_row_the_same_bits_for_any_m_and_neighbours():
    _linear_rows_are_their_own("cpu", torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        triton_ops.linear(torch.randn(3, 8), torch.randn(5, 7))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_ops.linear(torch.randn(3, 8).double(), torch.randn(5, 8).double())


@interpreted
def test_the_row_check_fails_for_a_tile_chosen_by_m():
    """The check above has teeth: the same kernel with BLOCK_K chosen by M (as a GEMM library's
    heuristics do) gives a decode row other bits than the same row in a chunk."""
    gen = torch.Generator().manual_seed(9)
    w, x = torch.randn(70, 100, generator=gen), torch.randn(8, 100, generator=gen)

    def by_m(rows):
        bk = 64 if rows.shape[0] == 1 else 32
        return triton_ops.linear(rows, w, blocks=(triton_ops.BLOCK_M, triton_ops.BLOCK_N, bk))

    chunk = by_m(x)
    assert any(not torch.equal(by_m(x[i:i + 1])[0], chunk[i]) for i in range(8))


@interpreted
@pytest.mark.parametrize("h,hkv,dh,window,s", ATTENTION)
def test_attention_rows_of_a_chunk_are_decode_steps(h, hkv, dh, window, s):
    _attention_rows_are_decode_steps("cpu", torch.float32, h, hkv, dh, window, s)


@interpreted
def test_attention_bits_follow_the_key_block_so_it_is_fixed():
    """Key blocks at fixed positions matter: 32-key blocks give a row past 32 keys other bits than
    64-key blocks, so a kernel that sized its blocks by the chunk would break decode == chunk."""
    gen = torch.Generator().manual_seed(10)
    keys, values, q = torch.randn(100, 2, 16, generator=gen), torch.randn(100, 2, 16, generator=gen), \
        torch.randn(1, 4, 16, generator=gen)
    a = triton_ops.attention(q, keys, values, 99, 0.25)
    b = triton_ops.attention(q, keys, values, 99, 0.25, key_block=32)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="shapes"):
        triton_ops.attention(q, keys[:5], values[:5], 99, 0.25)


@interpreted
def test_rms_norm_and_silu_are_each_rows_own():
    _norms_are_each_rows_own("cpu", torch.float32)
    with pytest.raises(ValueError, match="weight"):
        triton_ops.rms_norm(torch.randn(2, 40), torch.randn(39), 1e-5)


def test_where_the_triton_kernels_run():
    from swarm.model.block import pick_kernel_mode, triton_kernels_usable

    cpu = torch.device("cpu")
    if triton_ops.INTERPRETED:
        assert triton_ops.available(cpu, torch.float32) == (True, "")
        ok, why = triton_ops.available(cpu, torch.bfloat16)
        assert not ok and "float32" in why
    else:
        ok, why = triton_ops.available(cpu, torch.float32)
        assert not ok and "TRITON_INTERPRET=1" in why
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWARM_KERNELS", "rows")
        assert triton_kernels_usable(cpu, torch.float32) == (False, "SWARM_KERNELS=rows")
        assert pick_kernel_mode(cpu, torch.float32)[0] == "rows"
        mp.setenv("SWARM_KERNELS", "triton")
        assert pick_kernel_mode(cpu, torch.float32)[0] == ("triton" if triton_ops.INTERPRETED else "rows")
        mp.setenv("SWARM_KERNELS", "tritn")
        mode, why = pick_kernel_mode(cpu, torch.float32)
        assert mode == "rows" and "is not one of auto, fma, triton, rows" in why


@interpreted
@pytest.mark.slow  # a whole block in the interpreter: 3 s
def test_a_llama_block_in_the_triton_mode_proves_row_invariance(synthetic, monkeypatch):
    """SWARM_KERNELS=triton picks the mode (the CPU has it only under the interpreter); the head block
    passes check_block (chunked and packed rows against one row at a time), and its class names the
    mode and the tiles, apart from the fma and rows classes."""
    monkeypatch.setenv("SWARM_KERNELS", "triton")
    block = load_block(synthetic("llama", "float32", **SMALL), LayerRange(0, 1), dtype="float32", device="cpu")
    assert block.kernel_mode == "triton"
    report = check_block(block, 1)
    assert report.ok, report.reason
    kernel = facts.stage_class(block).facts["kernel"]
    assert kernel == {"mode": "triton", **triton_ops.describe(), "norm_tile": 16}
    assert kernel["block_m"] == triton_ops.BLOCK_M and kernel["interpreter"] is True
    triton_class = facts.stage_class(block).id
    monkeypatch.setenv("SWARM_KERNELS", "auto")
    block.set_kernel_mode("rows")
    assert facts.stage_class(block).id != triton_class


@interpreted
@pytest.mark.slow  # every family, head and tail: about a minute under the interpreter
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_family_in_the_triton_mode_proves_row_invariance_and_matches_transformers(synthetic, family,
                                                                                         monkeypatch):
    monkeypatch.setenv("SWARM_KERNELS", "triton")
    model = synthetic(family, "float32", **({"n_layer": 2} if family == "gpt2" else SMALL))
    blocks = [load_block(model, LayerRange(*part), dtype="float32", device="cpu") for part in ((0, 1), (1, 2))]
    for block in blocks:
        assert block.kernel_mode == "triton"
        report = check_block(block, 1)
        assert report.ok, report.reason
    prompt = [1, 5, 9, 3, 7, 2]
    assert chained_greedy(blocks, prompt, 6) == reference_greedy(model, prompt, 6, "float32")


@interpreted
@pytest.mark.slow  # a whole block in the interpreter: 3 s
def test_a_triton_block_that_breaks_the_contract_falls_back_to_rows(synthetic, monkeypatch, caplog):
    """With a GEMM tile chosen by M in place of the fixed one, chunked rows stop matching decode rows:
    the stage's start-up proof says where, logs kernels.fallback and serves the rows mode, proven."""
    from swarm.stage.kernel_proofs import prove_kernels

    monkeypatch.setenv("SWARM_KERNELS", "triton")
    block = load_block(synthetic("llama", "float32", **SMALL), LayerRange(1, 2), dtype="float32", device="cpu")
    fixed = triton_ops.linear

    def tile_by_m(x, w, b=None):
        return fixed(x, w, b, blocks=(triton_ops.BLOCK_M, triton_ops.BLOCK_N, 64 if x.shape[0] == 1 else 16))

    monkeypatch.setattr(triton_ops, "linear", tile_by_m)
    monkeypatch.setenv("SWARM_CACHE", str(block.model_dir.parent / "cache"))
    monkeypatch.setattr(check, "_REPORTS", {})  # proofs of the same weights by earlier tests
    with caplog.at_level("ERROR", logger="swarm.stage.scheduler"):
        kernels = prove_kernels(block)
    assert kernels["mode"] == "rows" and kernels["rows_ok"] and block.kernel_mode == "rows"
    fallback = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels.fallback")]
    assert fallback and "from=triton to=rows" in fallback[0] and "differs when chunked" in fallback[0]


@interpreted
@pytest.mark.ring
def test_a_ring_of_triton_stages_gives_transformers_tokens_and_speculation_changes_none(synthetic, tmp_path,
                                                                                        monkeypatch):
    """Two in-process stages over libp2p in the triton mode (each proves it at start-up and reports it in
    its kernels info): greedy == transformers' greedy, and n-gram speculation (verify chunks of 4
    rows, two in flight, rollbacks) == greedy."""
    import trio

    from swarm.config import SpecConfig
    from swarm.coordinator.drafters import NgramDrafter
    from tests.support.ring import ring_generate, start_ring

    monkeypatch.setenv("SWARM_KERNELS", "triton")
    model = synthetic("llama", "float32", **SMALL)
    prompt = [1, 5, 9, 3, 7, 2, 1, 5, 9]
    want = reference_greedy(model, prompt, 8, "float32")

    async def main():
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model, [(0, 1), (1, 2)], tmp_path, "float32")
                greedy = await ring_generate(spec, model, 2, prompt, 8, tmp_path)
                fast = await ring_generate(spec, model, 2, prompt, 8, tmp_path, drafter=NgramDrafter(),
                                           spec_config=SpecConfig(draft="ngram", k=3, depth=2))
                nursery.cancel_scope.cancel()
        return greedy, fast, [(s.kernels["mode"], s.kernels["rows_ok"]) for s in servers]

    greedy, fast, kernels = trio.run(main)
    assert kernels == [("triton", True), ("triton", True)]
    assert greedy == want and fast == greedy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_kernels_give_a_row_the_same_bits_in_any_call(dtype):
    """The kernel checks above, compiled for the GPU: rows alone == rows among others, chunk == decode."""
    _cuda()
    _linear_rows_are_their_own("cuda", dtype)
    for case in ATTENTION + [(9, 3, 64, None, 150)]:  # and SmolLM2's heads
        _attention_rows_are_decode_steps("cuda", dtype, *case)
    _norms_are_each_rows_own("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_blocks_pick_triton_and_prove_row_invariance(synthetic, family, dtype, monkeypatch):
    """On a GPU a block starts in the triton mode and passes check_block (head and tail, every family);
    the same block in the rows mode passes too."""
    _cuda()
    monkeypatch.delenv("SWARM_KERNELS", raising=False)
    model = synthetic(family, "float32")
    for part in ((0, 2), (2, 4)):
        block = load_block(model, LayerRange(*part), dtype=dtype, device="cuda")
        assert block.kernel_mode == "triton"
        report = check_block(block, 1)
        assert report.ok, report.reason
        assert facts.stage_class(block).facts["kernel"]["interpreter"] is False
        block.set_kernel_mode("rows")
        assert check_block(block, 1).ok

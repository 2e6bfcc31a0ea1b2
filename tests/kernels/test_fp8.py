"""FP8 weights held as published (``swarm.kernels.fp8``, ``fp8.c``): the product is, bit for bit, swarm's
float32 or bfloat16 GEMM over the weight transformers' dequantization gives (each value times its block's
scale in float32, rounded to bfloat16 for a bfloat16 stage), for any rows, blocks cut short, every float8
value, NaN bytes, scales the vector decoder does not take, and every ISA; bad input is refused."""

from __future__ import annotations

import pytest
import torch

from swarm.kernels import fma, fp8
from swarm.kernels.fp8 import Fp8Weight
from swarm.model import qcheckpoint

FMA_OK, FMA_WHY = fma.available()
pytestmark = pytest.mark.skipif(not FMA_OK, reason=f"the fma kernels cannot run here: {FMA_WHY}")


def _weight(n: int, k: int, block: tuple[int, int], seed: int, scale: float = 1e-2, spread: float = 100) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * spread).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * scale + scale / 10
    return Fp8Weight.of(w, s, block)


# a decode step (one row, float32) decodes in registers where the scale block is a multiple of 8 along K
@pytest.mark.parametrize("n,k,block", [(37, 70, (16, 16)), (300, 576, (128, 128)), (64, 33, (128, 128)),
                                       (97, 200, (32, 48)), (7, 90, (4, 20)), (130, 2051, (128, 128))])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_the_product_is_the_float_gemm_over_the_dequantized_weight(n, k, block, m):
    fw = _weight(n, k, block, seed=n + k)
    raw = fw.data.view(torch.float8_e4m3fn)
    assert torch.equal(fw.dequantize(), qcheckpoint.dequantize(raw, fw.scale, block))  # what a stage loaded before
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    assert torch.equal(fp8.linear(x, fw, bias), fma.linear(x, fw.dequantize(torch.float32), bias))
    assert torch.equal(fp8.linear(x, fw, bias, bf16=True), fma.linear(x, fw.dequantize(torch.bfloat16), bias))


def test_every_float8_value_decodes_exactly_and_a_nan_byte_gives_nan():
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = values[(values & 0x7F) != 0x7F]  # 254 values: 0x7F and 0xFF are e4m3fn's NaNs
    w = torch.cat([finite, finite[:2]]).reshape(2, 128)
    fw = Fp8Weight.of(w.view(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))
    got = fp8.linear(torch.eye(128), fw).t()  # row n, column k: 1 * w[n, k] plus zeros
    assert torch.equal(got, w.view(torch.float8_e4m3fn).float())
    nan = w.clone()
    nan[1, 5] = 0xFF
    held = Fp8Weight.of(nan.view(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))
    for m in (3, 1):
        out = fp8.linear(torch.ones(m, 128), held)
        assert not out[:, 0].isnan().any() and out[:, 1].isnan().all()


@pytest.mark.parametrize("scale", [1e-40, 2e36, 1.0])  # subnormal, and * 2^8 overflowing: the plain decoder
def test_scales_the_vector_decoder_does_not_take_give_the_same_bits(scale):
    fw = _weight(24, 68, (8, 32), seed=3, scale=scale, spread=0.01)
    assert fw.dequantize().isfinite().all()
    for x in (torch.randn(4, 68), torch.randn(1, 68)):  # one row: a decode step decodes in registers
        assert torch.equal(fp8.linear(x, fw), fma.linear(x, fw.dequantize()))
        assert torch.equal(fp8.linear(x, fw, bf16=True), fma.linear(x, fw.dequantize(torch.bfloat16)))


def test_every_isa_and_thread_count_gives_the_same_bits():
    fw = _weight(200, 320, (128, 128), seed=5)
    x = torch.randn(6, 320)
    before, threads = fma.isa(), fma.threads()
    outs = []
    try:
        for name in fma.describe().isas:
            fma.use_isa(name)
            for t in (1, 2, 3):
                fma.set_threads(t)
                outs.append((fp8.linear(x, fw), fp8.linear(x, fw, bf16=True), fp8.linear(x[2:3], fw)))
    finally:
        fma.use_isa(before)
        fma.set_threads(threads)
    for a, b, row in outs:
        assert torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) and torch.equal(row[0], a[2])


def test_bad_input_is_refused():
    fw = _weight(16, 32, (16, 16), seed=1)
    with pytest.raises(ValueError, match="float32 CPU rows"):
        fp8.linear(torch.randn(2, 31), fw)
    with pytest.raises(ValueError, match="bias must be"):
        fp8.linear(torch.randn(2, 32), fw, torch.randn(15))
    with pytest.raises(ValueError, match="float32 scales per"):
        Fp8Weight(fw.data, fw.scale[:, :1], (16, 16))


@pytest.mark.parametrize("bk", [32, 20])  # 20: each block's last 4 values go through the plain decoder
def test_bfloat16_rounding_ties_go_to_even(bk):
    """Scales of 1 + 2^-8 and 1 + 3 * 2^-8 (times a power of two) put many products exactly half-way between
    two bfloat16 values, below an even and an odd one: they round to even, as torch rounds."""
    n, k = 16, 80
    w = torch.randint(0, 256, (n, k), generator=torch.Generator().manual_seed(7), dtype=torch.int32).to(torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0x38  # no NaN bytes
    grid = (-(-n // 8), -(-k // bk))
    at = torch.arange(grid[0] * grid[1])
    scale = ((1 + 2.0 ** -8 + (at % 2) * 2.0 ** -7) * torch.pow(2.0, at % 5 - 2)).reshape(grid)  # even, odd
    fw = Fp8Weight.of(w.view(torch.float8_e4m3fn), scale, (8, bk))
    exact = fw.dequantize(torch.float32)
    rounded = fw.dequantize(torch.bfloat16)
    ties = (exact.view(torch.int32) & 0xFFFF) == 0x8000
    assert ties.sum() > 100  # the test has ties to round
    got = fp8.linear(torch.eye(k), fw, bf16=True).t()  # 1 * w[n, k] in the bfloat16 GEMM: the rounded weight
    assert torch.equal(got, rounded.float())


def _mxfp4(n: int, k: int, seed: int) -> fp8.Mxfp4Weight:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 135, (n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return fp8.Mxfp4Weight(blocks, scales)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits where finite, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("n,k", [(37, 64), (300, 576), (64, 2880)])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_mxfp4_is_the_float_gemm_over_the_values_transformers_decodes(n, k, m):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = _mxfp4(n, k, seed=n + k)
    if n == 37:  # the scales' ends: 2^-127 (subnormal), 2^-126, 2^127, 2^128 (infinite: 0 * inf is NaN)
        w.scales[0, 0], w.scales[1, 0], w.scales[2, 1], w.scales[3, 1] = 0, 1, 254, 255
    reference = convert_moe_packed_tensors(w.blocks[None], w.scales[None], dtype=torch.float32)[0].t()
    assert _same(w.dequantize(), reference)
    if n == 37:  # each value itself (1 * w[n, k] plus zeros), subnormal ones too (rows 2 and 3 hold infinities)
        decoded, finite = fp8.mxfp4_linear(torch.eye(k), w).t(), [0, 1, *range(4, n)]
        assert torch.equal(decoded[finite], reference[finite])
        assert (decoded[0, :32].abs() < 1e-37).all() and decoded[0, :32].any()  # 2^-127's: subnormal, not zero
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    assert _same(fp8.mxfp4_linear(x, w, bias), fma.linear(x, w.dequantize(), bias))
    assert _same(fp8.mxfp4_linear(x, w, bias, bf16=True), fma.linear(x, w.dequantize(torch.bfloat16), bias))


def test_mxfp4_every_isa_and_thread_count_gives_the_same_bits():
    w = _mxfp4(70, 320, seed=9)
    x = torch.randn(6, 320)
    before, threads = fma.isa(), fma.threads()
    outs = []
    try:
        for name in fma.describe().isas:  # the generic ISA decodes by the plain definition
            fma.use_isa(name)
            for t in (1, 3):
                fma.set_threads(t)
                outs.append((fp8.mxfp4_linear(x, w), fp8.mxfp4_linear(x, w, bf16=True)))
    finally:
        fma.use_isa(before)
        fma.set_threads(threads)
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs)


def test_mxfp4_bad_input_is_refused():
    w = _mxfp4(16, 64, seed=1)
    with pytest.raises(ValueError, match="float32 CPU rows"):
        fp8.mxfp4_linear(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="contiguous uint8"):
        fp8.Mxfp4Weight(w.blocks[:, :1], w.scales)

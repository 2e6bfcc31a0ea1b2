"""llama.cpp's block formats in swarm's arithmetic (``swarm.kernels.qblocks``): the product is, bit for
bit, ``fma.linear`` over the weights as the ``gguf`` package dequantizes them; a row's bits never depend
on the rows, threads or ISA that share its call; bad input is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.kernels import fma, qblocks
from swarm.kernels.qblocks import FORMATS, QWeight

FMA_OK, FMA_WHY = fma.available()
pytestmark = pytest.mark.skipif(not FMA_OK, reason=f"the fma kernels cannot run here: {FMA_WHY}")


def _random_blocks(fmt: str, n: int, k: int, seed: int) -> QWeight:  # also tests/model/test_qformats.py
    """Random bytes in ``fmt`` (Q4_K and Q6_K included, which the gguf package cannot write), with every
    fp16 field a finite normal number of modest size."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // f.block, f.block_bytes), dtype=np.uint8)
    halves = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q6_k": [208]}[fmt]
    for at in halves:
        raw[:, :, at + 1] = (raw[:, :, at + 1] & 0x83) | 0x1C  # |h| in [2^-8, 2^-4), either sign
    return QWeight(fmt, n, k, torch.from_numpy(raw.reshape(n, -1)))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_gives_the_bits_of_the_float_linear_over_its_dequantized_values(fmt):
    """linear() == fma.linear over gguf.quants' dequantized values, bit for bit, for a few rows (the
    in-register path) and many (dequantized into a buffer), with and without bias; and close to float64."""
    k, n = 512, 45  # two super-blocks of 256; 45 columns: whole tiles and a tail
    w = _random_blocks(fmt, n, k, seed=sum(map(ord, fmt)))
    values = qblocks.dequantize(w)
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 6, 7, 30):
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(qblocks.linear(x, w), fma.linear(x, values)), m
        assert torch.equal(qblocks.linear(x, w, b), fma.linear(x, values, b)), m
    torch.testing.assert_close(qblocks.linear(x, w).double(), x.double() @ values.double().t(), rtol=1e-4, atol=1e-3)


def test_quantize_and_dequantize_go_through_the_gguf_package():
    torch.manual_seed(2)
    w = torch.randn(40, 96)
    for fmt in ("q8_0", "q4_0", "q4_1"):
        q = qblocks.quantize(w, fmt)
        assert q.nbytes == 40 * 96 // 32 * FORMATS[fmt].block_bytes
        err = (qblocks.dequantize(q) - w).abs().max().item()
        assert err < (0.02 if fmt == "q8_0" else 0.35)
    with pytest.raises(ValueError, match="q4_k"):
        qblocks.quantize(w, "q4_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        qblocks.quantize(w[:, :40], "q8_0")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_row_gets_the_same_bits_alone_in_any_chunk_on_any_threads_and_isa(fmt):
    w = _random_blocks(fmt, 37, 256, seed=7)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(3))
    b = torch.randn(37, generator=torch.Generator().manual_seed(4))
    ref = qblocks.linear(x, w, b)
    for start, m in ((0, 1), (3, 1), (2, 5), (4, 7), (0, 11)):
        assert torch.equal(qblocks.linear(x[start:start + m].clone(), w, b), ref[start:start + m])
    before_threads, before_isa = fma.threads(), fma.isa()
    try:
        for threads in (2, 3):
            fma.set_threads(threads)
            assert torch.equal(qblocks.linear(x, w, b), ref)
        fma.set_threads(1)
        for isa in fma.describe().isas:  # generic: the steps as written, one lane at a time
            fma.use_isa(isa)
            assert torch.equal(qblocks.linear(x, w, b), ref), isa
    finally:
        fma.set_threads(before_threads)
        fma.use_isa(before_isa)


def test_bad_input_is_refused_by_name():
    w = _random_blocks("q4_1", 8, 64, seed=1)
    with pytest.raises(ValueError, match="float32"):
        qblocks.linear(torch.randn(2, 64).double(), w)
    with pytest.raises(ValueError, match=r"\(M, 64\)"):
        qblocks.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="bias"):
        qblocks.linear(torch.randn(2, 64), w, torch.randn(9))
    with pytest.raises(ValueError, match="unknown block format"):
        QWeight("q5_0", 8, 64, w.data)
    with pytest.raises(ValueError, match="multiple of 256"):
        QWeight("q4_k", 8, 64, w.data)
    with pytest.raises(ValueError, match="uint8"):
        QWeight("q4_1", 8, 64, w.data[:, :-1])
    assert qblocks.linear(torch.randn(0, 64), w).shape == (0, 8)

"""llama.cpp's block formats in swarm's arithmetic (``swarm.kernels.qblocks``, ``qblocks_kernels.h``): the
product is, bit for bit, the arithmetic the header states (computed here again in Python, exactly), close
to the float64 product over the ``gguf`` package's dequantized values; a row's bits never depend on the
rows, threads, ISA or integer instruction (VNNI or not) that share its call; bad input is refused by name."""

from __future__ import annotations

import ctypes
from fractions import Fraction

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


def _f32(exact: Fraction) -> np.float32:
    """``exact`` rounded to the nearest float32, ties to even (no double rounding)."""
    near = np.float32(float(exact))
    cands = (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf)))
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array(c).view(np.int32)) & 1))


def _fma(a, b, c) -> np.float32:
    return _f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _half(raw: bytes) -> np.float32:
    return np.frombuffer(raw, np.float16)[0].astype(np.float32)


def _block(fmt: str, row: bytes, b: int):
    """Block b of 32 weights: integers w (offsets applied), scales (k < 16, k >= 16) and minimum (or None),
    as the header states them."""
    if fmt in ("q8_0", "q4_0", "q4_1"):
        size = FORMATS[fmt].block_bytes
        p = row[size * b:size * (b + 1)]
        d = _half(p[0:2])
        if fmt == "q8_0":
            return [int(v) for v in np.frombuffer(p[2:], np.int8)], (d, d), None
        qs, off = (p[2:], 8) if fmt == "q4_0" else (p[4:], 0)
        w = [(v & 15) - off for v in qs] + [(v >> 4) - off for v in qs]
        return w, (d, d), (_half(p[2:4]) if fmt == "q4_1" else None)
    j = b % 8
    if fmt == "q4_k":
        p = row[144 * (b // 8):144 * (b // 8 + 1)]
        sc = p[4:16]
        if j < 4:
            scale, mn = sc[j] & 63, sc[j + 4] & 63
        else:
            scale, mn = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
        q = p[16 + 32 * (j // 2):48 + 32 * (j // 2)]
        c = np.float32(_half(p[0:2]) * np.float32(scale))
        return [(v >> (4 * (j % 2))) & 15 for v in q], (c, c), np.float32(-(_half(p[2:4]) * np.float32(mn)))
    p = row[210 * (b // 8):210 * (b // 8 + 1)]
    half, g = j // 4, j % 4
    ql, qh = p[64 * half + 32 * (g % 2):][:32], p[128 + 32 * half:][:32]
    w = [((((ql[i] if g < 2 else ql[i] >> 4) & 15) | (((qh[i] >> (2 * g)) & 3) << 4)) - 32) for i in range(32)]
    scales, d = np.frombuffer(p[192:208], np.int8), _half(p[208:210])
    return w, (np.float32(d * np.float32(scales[8 * half + 2 * g])), np.float32(d * np.float32(scales[8 * half + 2 * g + 1]))), None


def _reference(fmt: str, x: torch.Tensor, w: QWeight, bias: torch.Tensor | None) -> np.ndarray:
    """qblocks_kernels.h's arithmetic as its comment states it, in numpy float32 and exact integers."""
    m_rows, k = x.shape
    out = np.zeros((m_rows, w.n), np.float32)
    rows = []
    for xr in x.numpy():
        blocks = []
        for b in range(k // 32):
            xb = xr[32 * b:32 * b + 32]
            a = np.float32(0)
            for v in np.abs(xb):
                a = v if v > a else a
            d = np.float32(a / np.float32(32767))
            inv = np.float32(np.float32(1) / d) if d != 0 else np.float32(0)
            q = [0 if np.isnan(v * inv) else int(np.rint(min(max(np.float32(v * inv), np.float32(-32767)),
                                                             np.float32(32767)))) for v in xb]
            blocks.append((d, q, [q[2 * l] + q[2 * l + 1] + q[16 + 2 * l] + q[17 + 2 * l] for l in range(8)]))
        rows.append(blocks)
    for n in range(w.n):
        row = bytes(w.data[n].numpy())
        for m in range(m_rows):
            acc = [np.float32(0)] * 8
            for b, (d, q, s) in enumerate(rows[m]):
                wi, (ca, cb), mn = _block(fmt, row, b)
                for l in range(8):
                    pa = wi[2 * l] * q[2 * l] + wi[2 * l + 1] * q[2 * l + 1]
                    pb = wi[16 + 2 * l] * q[16 + 2 * l] + wi[17 + 2 * l] * q[17 + 2 * l]
                    if fmt == "q6_k":
                        acc[l] = _fma(np.float32(ca * d), pa, acc[l])
                        acc[l] = _fma(np.float32(cb * d), pb, acc[l])
                    else:
                        acc[l] = _fma(np.float32(ca * d), pa + pb, acc[l])
                    if mn is not None:
                        acc[l] = _fma(mn, np.float32(d * np.float32(s[l])), acc[l])
            t = [np.float32(acc[2 * i] + acc[2 * i + 1]) for i in range(4)]
            total = np.float32(np.float32(t[0] + t[1]) + np.float32(t[2] + t[3]))
            out[m, n] = total if bias is None else np.float32(total + bias[n].item())
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_computes_the_stated_arithmetic_bit_for_bit(fmt):
    """linear() == the header's arithmetic redone in Python (exact integers, float32 steps, exact fma), with a
    zero block and a NaN (rounded to 0) in x, with and without bias; and within 1e-4 of the float64 product
    over the gguf package's dequantized values (16-bit activations)."""
    k = 256 if fmt in ("q4_k", "q6_k") else 64
    w = _random_blocks(fmt, 3, k, seed=sum(map(ord, fmt)))
    gen = torch.Generator().manual_seed(5)
    x, b = torch.randn(2, k, generator=gen) * 3, torch.randn(3, generator=gen)
    x[1, :32], x[0, 7] = 0.0, float("nan")
    assert np.array_equal(qblocks.linear(x, w, b).numpy().view(np.int32), _reference(fmt, x, w, b).view(np.int32))
    assert np.array_equal(qblocks.linear(x, w).numpy().view(np.int32), _reference(fmt, x, w, None).view(np.int32))
    values = qblocks.dequantize(_random_blocks(fmt, 45, 512, seed=9)).double()
    xs = torch.randn(30, 512, generator=gen)
    got = qblocks.linear(xs, _random_blocks(fmt, 45, 512, seed=9)).double()
    exact = xs.double() @ values.t()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-4


def test_the_arithmetic_receipts_name_is_the_librarys():
    import ctypes

    lib = fma._library()
    lib.swarm_qblocks_arithmetic.restype = ctypes.c_char_p
    assert lib.swarm_qblocks_arithmetic().decode() == qblocks.ARITHMETIC


def test_quantize_and_dequantize_keep_every_format_close_and_refuse_what_it_cannot_hold():
    torch.manual_seed(2)
    w = torch.randn(40, 512)
    for fmt, bound in (("q8_0", 0.02), ("q4_0", 0.35), ("q4_1", 0.35), ("q4_k", 0.35), ("q6_k", 0.08)):
        q = qblocks.quantize(w, fmt)
        assert q.nbytes == 40 * 512 // FORMATS[fmt].block * FORMATS[fmt].block_bytes
        err = (qblocks.dequantize(q) - w).abs().max().item()
        assert err < bound, (fmt, err)
    with pytest.raises(ValueError, match="multiple of 256"):
        qblocks.quantize(w[:, :96], "q4_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        qblocks.quantize(w[:, :40], "q8_0")
    with pytest.raises(ValueError, match="NaN or infinity"):
        qblocks.quantize(torch.full((2, 256), float("inf")), "q6_k")
    assert [qblocks.format_for("q4_k", k) for k in (512, 576, 40)] == ["q4_k", "q4_1", None]
    assert [qblocks.format_for("q6_k", k) for k in (256, 96)] == ["q6_k", "q8_0"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_row_gets_the_same_bits_alone_in_any_chunk_on_any_threads_and_isa(fmt):
    w = _random_blocks(fmt, 37, 256, seed=7)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(3))
    b = torch.randn(37, generator=torch.Generator().manual_seed(4))
    ref = qblocks.linear(x, w, b)
    for start, m in ((0, 1), (3, 1), (2, 2), (2, 5), (4, 7), (0, 11)):
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
            with pytest.MonkeyPatch.context() as mp:  # the integer sums by madd where vpdpwssd would run
                mp.setenv("SWARM_VNNI", "0")
                assert torch.equal(qblocks.linear(x, w, b), ref), (isa, "no vnni")
    finally:
        fma.set_threads(before_threads)
        fma.use_isa(before_isa)


class _QPart(ctypes.Structure):  # fma_common.h's swarm_qpart
    _fields_ = [("fmt", ctypes.c_int32), ("w", ctypes.c_void_p), ("N", ctypes.c_int64), ("ldw", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("out", ctypes.c_void_p), ("ldo", ctypes.c_int64)]


def _linear_many(x: torch.Tensor, weights: list[QWeight], biases: list, threads: int) -> tuple[int, list]:
    """swarm_qlinear_many over ``weights`` (one x): its return code and each part's out."""
    outs = [torch.full((x.shape[0], w.n), float("nan")) for w in weights]
    parts = (_QPart * max(1, len(weights)))(*[
        _QPart(list(FORMATS).index(w.fmt), w.data.data_ptr(), w.n, w.data.shape[1],
               b.data_ptr() if b is not None else None, o.data_ptr(), w.n) for w, b, o in zip(weights, biases, outs)])
    rc = fma._library().swarm_qlinear_many(parts, len(weights), x.data_ptr(), x.shape[0], x.shape[1], x.shape[1],
                                           threads)
    return rc, outs


@pytest.mark.parametrize("rows", [1, 3, 11])
def test_projections_of_one_input_in_one_call_get_each_ones_own_bits(rows):
    """A layer's q, k and v (gate and up) in one swarm_qlinear_many call, formats mixed as a GGUF mixes them:
    each part's out is what it gets alone, on 1 to 3 threads; more parts than it takes, or a K a part's
    format cannot hold, is refused (-1) with every out untouched."""
    ws = [_random_blocks(f, n, 256, seed=i) for i, (f, n) in enumerate((("q4_k", 40), ("q6_k", 24), ("q8_0", 9)))]
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen)
    biases = [None, torch.randn(24, generator=gen), None]
    alone = [qblocks.linear(x, w, b) for w, b in zip(ws, biases)]
    for threads in (1, 2, 3):
        rc, outs = _linear_many(x, ws, biases, threads)
        assert rc == 0 and all(torch.equal(a, o) for a, o in zip(alone, outs)), threads
    assert _linear_many(x, ws * 2, biases * 2, 1)[0] == -1
    assert _linear_many(x, [], [], 1)[0] == -1
    rc, outs = _linear_many(x[:, :96].contiguous(), [_random_blocks("q8_0", 5, 96, 1), _random_blocks("q4_k", 5, 256, 2)],
                            [None, None], 1)
    assert rc == -1 and all(o.isnan().all() for o in outs)


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

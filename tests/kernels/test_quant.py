"""Weight-only quantized GEMMs (``swarm.kernels.quant``): error bounds, held bytes, fixed-shape calls."""

from __future__ import annotations

import pytest
import torch

from swarm.kernels import quant

pytestmark = pytest.mark.skipif(not quant.usable()[0], reason=quant.usable()[1] or "usable")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.linspace(0.1, 2.0, n)[:, None]


@pytest.mark.parametrize("scheme", quant.SCHEMES)
@pytest.mark.parametrize("n,k", [(48, 64), (192, 576), (33, 96), (172, 64)])
def test_dequantized_weight_within_half_a_step(scheme, n, k) -> None:
    w = _weight(n, k)
    q = quant.quantize(w, scheme)
    if scheme == "int4" and n % 16:  # torch packs int4 rows in 16s: such a weight stays unquantized
        assert q is None and quant.scheme_bytes(scheme, n, k) is None
        return
    assert q.nbytes == quant.scheme_bytes(scheme, n, k)
    d = quant.dequantize(q)
    if scheme == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
        # half a step, plus the bfloat16 scale's rounding (2^-8 relative) times up to 127 steps
        assert ((d - w).abs() <= step * (0.5 + 127 * 2**-8) + 1e-7).all()
    else:
        g = q.group
        wg = w.reshape(n, k // g, g)
        step = ((wg.amax(-1, keepdim=True) - wg.amin(-1, keepdim=True)) / 15).expand_as(wg).reshape(n, k)
        # half a step, plus bfloat16's rounding of scale and zero (2^-8 relative)
        assert ((d - w).abs() <= step / 2 + w.abs().amax() * 2**-7).all()


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_rows_are_the_dequantized_product(scheme) -> None:
    w, b = _weight(64, 128), torch.randn(64).to(torch.bfloat16)
    x = torch.randn(7, 128).to(torch.bfloat16)
    q = quant.quantize(w, scheme)
    y = quant.linear_rows(x, q, b, 1)
    ref = x.float() @ quant.dequantize(q).t() + b.float()
    assert y.dtype == torch.bfloat16 and y.shape == (7, 64)
    assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_a_row_has_its_bits_alone_and_among_others_in_one_row_calls(scheme) -> None:
    q = quant.quantize(_weight(96, 64, seed=1), scheme)
    rows = torch.randn(37, 64).to(torch.bfloat16)
    alone = [quant.linear_rows(rows[i:i + 1].clone(), q, None, 1) for i in range(37)]
    assert torch.equal(torch.cat(alone), quant.linear_rows(rows, q, None, 1))
    other = torch.cat([torch.randn(5, 64).to(torch.bfloat16), rows[3:4]])
    assert torch.equal(quant.linear_rows(other, q, None, 1)[5], alone[3][0])


def test_int4_needs_a_group_that_divides_k_and_bad_input_is_refused() -> None:
    assert quant.quantize(_weight(8, 40), "int4") is None and quant.scheme_bytes("int4", 8, 40) is None
    assert quant.int4_group(576) == quant.int4_group(96) == 32
    with pytest.raises(ValueError, match="unknown quantization"):
        quant.quantize(_weight(8, 64), "int3")
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize(torch.zeros(4), "int8")
    with pytest.raises(ValueError, match="bfloat16"):
        quant.linear_rows(torch.zeros(2, 64), quant.quantize(_weight(8, 64), "int8"), None, 1)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_no_call_reads_past_its_row(scheme) -> None:
    """Every shape a scheme takes reads only its row: rows that end where NaN begins give no NaN (torch
    2.13's int8 kernel read past rows of 8 mod 16 inputs, which the scheme therefore does not take)."""
    taken = 0
    for k in range(16, 272, 8):
        q = quant.quantize(_weight(48, k), scheme)
        assert (q is None) == (not quant.takes(scheme, 48, k))
        if q is None:
            continue
        taken += 1
        buf = torch.full((k + 256,), float("nan"), dtype=torch.bfloat16)
        buf[:k] = torch.randn(k)
        y = quant._mm(buf[:k].view(1, k), q)
        assert not torch.isnan(y).any(), k
    assert taken >= 8
    assert quant.quantize(_weight(48, 168), "int8") is None and quant.scheme_bytes("int8", 48, 168) is None


def test_held_bytes_are_a_fraction_of_float32() -> None:
    n, k = 1536, 576
    dense = n * k * 4
    assert quant.scheme_bytes("int8", n, k) / dense < 0.26
    assert quant.scheme_bytes("int4", n, k) / dense < 0.16  # half a byte a weight, 4 bytes of scale and zero per 32

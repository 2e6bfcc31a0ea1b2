"""Weight-only quantized GEMMs held quantized: int8 per output channel, int4 in groups, through torch's own ops.

Owns: :func:`quantize` (a float ``(N, K)`` weight to a :class:`QuantWeight`), :func:`dequantize` (for references),
:func:`linear_rows` (``x @ W^T + b`` in fixed ``tile``-row bfloat16 calls), :func:`usable`, and the bytes each scheme
holds (:func:`scheme_bytes`). The schemes' arithmetic and measured costs: docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("int8", "int4")
# Measured 2026-12-03 (bench/quantized.py, SmolLM2 from its Q4_K_M GGUF, 488 tokens of
# tests/data/quality.txt): perplexity 33.96 at groups of 32 (float32: 34.05), 43.2 at 64 (32 where 64
# does not divide K), 47.1 at 128/64; groups of 32 cost 4% more bytes than 128/64
INT4_GROUP = 32
INT4_INNER_K_TILES = 2
COMPUTE_DTYPE = torch.bfloat16


INT4_ROWS = 16  # torch's int4 CPU packing takes N a multiple of this


def int4_group(k: int) -> int | None:
    """The int4 group size for rows of ``k`` inputs (``INT4_GROUP``), or None where it does not divide
    ``k`` (the weight stays unquantized)."""
    return INT4_GROUP if k % INT4_GROUP == 0 else None


INT8_K = 16  # torch 2.13's int8 CPU kernel reads a row's inputs in 16s: at other K it reads past the row


def takes(scheme: str, n: int, k: int) -> bool:
    """Whether ``scheme`` holds an ``(n, k)`` weight (int8: ``k`` a multiple of 16; int4: ``k`` of 32,
    ``n`` of 16); a weight it does not take stays in the compute dtype. Measured 2026-12-03 (torch
    2.13, AMD EPYC): ``_weight_int8pack_mm`` on a row of 8 mod 16 inputs read past it (NaN from the
    memory after the row, a different garbage each run)."""
    if scheme == "int8":
        return k % INT8_K == 0
    return int4_group(k) is not None and n % INT4_ROWS == 0


def scheme_bytes(scheme: str, n: int, k: int) -> int | None:
    """Bytes of an ``(n, k)`` weight held in ``scheme``; None where the scheme does not take it
    (:func:`takes`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r} (known: {', '.join(SCHEMES)})")
    if not takes(scheme, n, k):
        return None
    if scheme == "int8":
        return n * k + n * 2
    return n * k // 2 + (k // int4_group(k)) * n * 2 * 2
    raise ValueError(f"unknown quantization {scheme!r} (known: {', '.join(SCHEMES)})")


@dataclass
class QuantWeight:
    """A weight held quantized. ``data``: int8 ``(N, K)`` (int8) or the packed int4 tensor (int4);
    ``scales``: bfloat16 ``(N,)`` (int8) or ``(K / group, N, 2)`` scales and zeros (int4)."""

    scheme: str
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor
    group: int = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def usable() -> tuple[bool, str]:
    """Whether this torch has the CPU ops (True, "") or why not (False, reason)."""
    ops = ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    missing = [op for op in ops if not hasattr(torch, op)]
    if missing:
        return False, f"torch {torch.__version__} has no {', '.join(missing)}"
    return True, ""


def quantize(weight: torch.Tensor, scheme: str) -> QuantWeight | None:
    """``weight`` (N, K), any float dtype, on the CPU, quantized to ``scheme``; None where the scheme
    does not take it (:func:`takes`).

    Raises:
        ValueError: an unknown scheme or a weight that is not 2-D.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r} (known: {', '.join(SCHEMES)})")
    if weight.dim() != 2:
        raise ValueError(f"a quantized weight is 2-D (N, K), got {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if not takes(scheme, n, k):
        return None
    if scheme == "int8":
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return QuantWeight("int8", n, k, q, scale.to(COMPUTE_DTYPE).contiguous())
    g = int4_group(k)
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), INT4_INNER_K_TILES)
    scales = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1)
    return QuantWeight("int4", n, k, packed, scales.to(COMPUTE_DTYPE).contiguous(), g)


def dequantize(q: QuantWeight) -> torch.Tensor:
    """The float32 ``(N, K)`` weight ``q`` stands for: what :func:`linear_rows` multiplies by, up to its
    rounding of products to bfloat16."""
    if q.scheme == "int8":
        return q.data.to(torch.float32) * q.scales.to(torch.float32)[:, None]
    eye = torch.eye(q.k, dtype=COMPUTE_DTYPE)
    return _mm(eye, q).to(torch.float32).t().contiguous()


def _mm(a: torch.Tensor, q: QuantWeight) -> torch.Tensor:
    if q.scheme == "int8":
        return torch._weight_int8pack_mm(a, q.data, q.scales)
    return torch._weight_int4pack_mm_for_cpu(a, q.data, q.group, q.scales)


def linear_rows(x: torch.Tensor, q: QuantWeight, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    """``x @ W^T + bias`` for (M, K) bfloat16 rows as fixed ``(tile, K)`` calls on fresh copies (the last
    zero-padded), so a row's bits never depend on its neighbours' count or values.

    Args:
        x: (M, K) rows, bfloat16, on the CPU. q: the quantized (N, K) weight. bias: (N,) or None.
        tile: rows per call, >= 1.
    Returns:
        (M, N) bfloat16, a new tensor.
    Raises:
        ValueError: ``x`` is not bfloat16 (2-D) or its width is not ``q.k``.
    """
    if x.dim() != 2 or x.shape[1] != q.k or x.dtype != COMPUTE_DTYPE:
        raise ValueError(f"quantized rows are ({q.k},) {COMPUTE_DTYPE}; got {tuple(x.shape)} {x.dtype}")
    m = x.shape[0]
    outs = []
    for i in range(0, m, tile):
        part = x[i:i + tile]
        a = x.new_zeros((tile, q.k))
        a[:part.shape[0]] = part
        y = _mm(a, q)[:part.shape[0]]
        outs.append(y if bias is None else y + bias)
    if not outs:
        return x.new_empty((0, q.n))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


"""Weights held in llama.cpp's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), multiplied exactly by construction.

Owns: :class:`QWeight` (a matrix's bytes as a GGUF file stores them), :data:`FORMATS`, :data:`ARITHMETIC` (the name
receipts carry; ``qblocks_kernels.h`` states it), :func:`linear` (the C kernels through ctypes), :func:`quantize` and
:func:`dequantize`. Why 16-bit activations, and the measured figures: docs/kernels.md, "Weight formats".
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    """One of llama.cpp's block formats.

    Attributes:
        name: ``q8_0``, ``q4_0``, ``q4_1``, ``q4_k`` or ``q6_k`` (GGML's type name, lower case).
        block: weights per block along K.
        block_bytes: bytes one block takes.
        ggml_type: the GGML type id (``gguf.GGMLQuantizationType``).
    """

    name: str
    block: int
    block_bytes: int
    ggml_type: int


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("q8_0", 32, 34, 8),  # the order is fma.c's format index
    BlockFormat("q4_0", 32, 18, 2),
    BlockFormat("q4_1", 32, 20, 3),
    BlockFormat("q4_k", 256, 144, 12),
    BlockFormat("q6_k", 256, 210, 14),
)}


@dataclass(frozen=True)
class QWeight:
    """A (N, K) weight matrix held in a block format.

    Attributes:
        fmt: the format's name (a key of :data:`FORMATS`).
        n: output features (rows of an ``nn.Linear`` weight).
        k: input features; a multiple of the format's block.
        data: uint8 (N, K // block * block_bytes) on the CPU: row n holds the blocks of weight row n in
            k order, each laid out as GGML lays it out (a GGUF tensor's bytes, rows in the Linear's order).
    """

    fmt: str
    n: int
    k: int
    data: torch.Tensor

    def __post_init__(self):
        f = FORMATS.get(self.fmt)
        if f is None:
            raise ValueError(f"unknown block format {self.fmt!r}: one of {', '.join(FORMATS)}")
        if self.k % f.block:
            raise ValueError(f"{self.fmt} needs K a multiple of {f.block}, got {self.k}")
        want = (self.n, self.k // f.block * f.block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{self.fmt} data for ({self.n}, {self.k}) must be uint8 {want}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()


# A weight whose K is not a multiple of 256 cannot be a K-quant: like llama-quantize, it takes another
# format (llama.cpp takes q5_0 for q4_K, which swarm does not hold; q4_1 is its size) and, when K is not
# a multiple of 32 either, stays float32.
FALLBACK = {"q4_k": "q4_1", "q6_k": "q8_0"}
K_QUANTS = ("q4_k", "q6_k")  # written by the kernel library (the gguf package reads them, not writes)


def format_for(scheme: str, k: int) -> str | None:
    """The block format a weight of ``k`` inputs is held in under ``scheme`` (a key of :data:`FORMATS`):
    ``scheme`` itself, its :data:`FALLBACK`, or None (not a multiple of any: it stays float32)."""
    for fmt in (scheme, FALLBACK.get(scheme)):
        if fmt is not None and k % FORMATS[fmt].block == 0:
            return fmt
    return None


_INDEX = {name: i for i, name in enumerate(FORMATS)}
# fma.c's QBLOCKS_ARITHMETIC (swarm_qblocks_arithmetic() in the library: a test holds them equal)
ARITHMETIC = ("swarm-q16dot-1: x in 16-bit blocks of 32 (float32 scale, half-even), integer pair sums, fma lanes, "
              "pairwise tree")  # the format's number in swarm_qlinear


def linear(x: torch.Tensor, weight: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` in :data:`ARITHMETIC` (``qblocks_kernels.h``): a row's bits depend
    on its own data only (any number of rows, threads, ISA); within about 1e-4 of the float64 product.

    Args:
        x: (M, K) float32 on the CPU. weight: a :class:`QWeight` of K columns. bias: (N,) float32 or None.
    Returns:
        (M, N) float32, a new tensor.
    Raises:
        ValueError: shapes or dtypes that do not fit. RuntimeError: kernels unavailable. MemoryError.
    """
    from swarm.kernels import fma

    lib = fma._library()
    x, out, b = fma.held_operands(x, weight.k, weight.n, bias, "qblocks.linear")
    m = x.shape[0]
    if m and weight.n:
        data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
        rc = lib.swarm_qlinear(_INDEX[weight.fmt], x.data_ptr(), m, weight.k, x.stride(0), data.data_ptr(), weight.n,
                               data.stride(0), None if b is None else b.data_ptr(), out.data_ptr(), weight.n,
                               fma.threads())
        if rc == -2:
            raise MemoryError(f"no memory for {m} rows of activations in 16-bit blocks")
        if rc:
            raise ValueError(f"{weight.fmt} cannot hold K = {weight.k}")
    return out


def quantize(weight: torch.Tensor, fmt: str) -> QWeight:
    """A float (N, K) weight in block format ``fmt`` with llama.cpp's rounding: q8_0, q4_0 and q4_1 by the
    ``gguf`` package's reference quantizer, q4_k and q6_k by the kernel library's port of llama.cpp's
    reference (``qquantize.c``: the bytes ``llama-quantize`` writes without an importance matrix).

    Raises:
        ValueError: an unknown format, K that the format cannot hold, or a weight with NaN or infinity.
        RuntimeError: q4_k / q6_k where the kernel library does not load.
    """
    import numpy as np

    f = FORMATS.get(fmt)
    if f is None:
        raise ValueError(f"unknown block format {fmt!r}: one of {', '.join(FORMATS)}")
    n, k = weight.shape
    if k % f.block:
        raise ValueError(f"{fmt} needs K a multiple of {f.block}, got {k}")
    x = weight.detach().float().cpu().contiguous()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"cannot quantize a ({n}, {k}) weight holding NaN or infinity to {fmt}")
    if fmt in K_QUANTS:
        return QWeight(fmt, n, k, _quantize_k(x, fmt))
    import gguf.quants

    raw = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType(f.ggml_type))
    return QWeight(fmt, n, k, torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(n, -1))


def _quantize_k(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 (N, K // 256 * block_bytes): ``x`` (contiguous float32 (N, K)) in Q4_K / Q6_K, rows split over
    the kernel threads (ctypes lets go of the GIL)."""
    from swarm.kernels import fma

    lib = fma._library()
    n, k = x.shape
    out = torch.empty((n, k // FORMATS[fmt].block * FORMATS[fmt].block_bytes), dtype=torch.uint8)
    step = max(1, -(-n // max(1, fma.threads())))

    def part(r0: int) -> int:
        rows = min(step, n - r0)
        return lib.swarm_quantize_kquant(_INDEX[fmt], x[r0].data_ptr(), rows, k, k, out[r0].data_ptr(), out.shape[1])

    with ThreadPoolExecutor(max_workers=max(1, -(-n // step))) as pool:
        if any(rc != 0 for rc in pool.map(part, range(0, n, step))):
            raise ValueError(f"{fmt} cannot hold K = {k}")
    return out


def dequantize(weight: QWeight) -> torch.Tensor:
    """The float32 (N, K) values of ``weight`` by the ``gguf`` package's reference dequantizer."""
    import gguf.quants

    raw = weight.data.contiguous().numpy()
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(FORMATS[weight.fmt].ggml_type))
    return torch.from_numpy(values.reshape(weight.n, weight.k).astype("float32", copy=False))

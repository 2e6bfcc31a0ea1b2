"""Weights held as published: FP8 (:class:`Fp8Weight`, e4m3fn bytes and float32 block scales) and MXFP4
(:class:`Mxfp4Weight`), multiplied by :func:`linear` and :func:`mxfp4_linear` with the bits of the float32 or
bfloat16 GEMM over the dequantized weight (``fp8.c``; docs/kernels.md, "FP8 and MXFP4 checkpoints")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarm.kernels import fma

FP8_DTYPES = (torch.float8_e4m3fn,)  # the float8 type published FP8 checkpoints hold (DeepSeek, Qwen3, GLM)


@dataclass(frozen=True)
class Fp8Weight:
    """A (N, K) weight in float8 e4m3fn with one float32 scale per (bn, bk) block.

    Attributes:
        data: uint8 (N, K) on the CPU, the float8 bytes as the checkpoint stores them.
        scale: float32 (ceil(N / bn), ceil(K / bk)): ``weight_scale_inv`` (a multiplier, despite the name).
        block: (bn, bk) rows and columns per scale.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self):
        n, k = self.data.shape if self.data.dim() == 2 else (-1, -1)
        bn, bk = self.block
        want = (math.ceil(n / bn), math.ceil(k / bk)) if n >= 0 and bn > 0 and bk > 0 else None
        if self.data.dtype != torch.uint8 or want is None or self.scale.dtype != torch.float32 \
                or tuple(self.scale.shape) != want or not self.data.is_contiguous() or not self.scale.is_contiguous():
            raise ValueError(f"an FP8 weight is contiguous uint8 (N, K) bytes and float32 scales per {self.block} "
                             f"block, got "
                             f"{self.data.dtype} {tuple(self.data.shape)} and {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def k(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4

    @classmethod
    def of(cls, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
        """From a checkpoint's float8 (N, K) weight and its ``weight_scale_inv`` (any float dtype)."""
        return cls(weight.contiguous().view(torch.uint8), scale_inv.to(torch.float32).contiguous(), tuple(block))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight in ``dtype``: each value times its block's scale in float32, then rounded to
        ``dtype`` (transformers' dequantization, and the values :func:`linear` multiplies by)."""
        bn, bk = self.block
        scale = self.scale.repeat_interleave(bn, 0)[: self.n].repeat_interleave(bk, 1)[:, : self.k]
        return (self.data.view(torch.float8_e4m3fn).to(torch.float32) * scale).to(dtype)


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
           bf16: bool = False) -> torch.Tensor:
    """``x @ weight.dequantize(d).T + bias`` with the bits of ``swarm.kernels.fma.linear`` over that
    dequantized weight, ``d`` float32 (``bf16`` False) or bfloat16.

    Args:
        x: (M, K) float32 on the CPU. bias: (N,) float32 or None.
    Returns:
        (M, N) float32, a new tensor.
    Raises:
        ValueError: shapes or dtypes that do not fit. RuntimeError: kernels unavailable. MemoryError.
    """
    lib = fma._library()
    x, out, b = fma.held_operands(x, weight.k, weight.n, bias, "fp8.linear")
    data, scale = weight.data, weight.scale
    rc = lib.swarm_fp8_linear(x.data_ptr(), x.shape[0], weight.k, x.stride(0), data.data_ptr(), weight.n,
                              data.stride(0), scale.data_ptr(), scale.stride(0), weight.block[0], weight.block[1],
                              None if b is None else b.data_ptr(), out.data_ptr(), weight.n, int(bf16), fma.threads())
    if rc == -2:
        raise MemoryError(f"no memory for a panel of the ({weight.n}, {weight.k}) FP8 weight")
    if rc:
        raise ValueError(f"the FP8 kernel refused a ({weight.n}, {weight.k}) weight with {weight.block} blocks")
    return out


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1
MXFP4_GROUP = 32  # values per e8m0 scale


@dataclass(frozen=True)
class Mxfp4Weight:
    """A (N, K) weight in MXFP4: e2m1 values, two a byte (the low nibble first), and an e8m0 scale (2^(s - 127))
    per group of 32 along K, as gpt-oss publishes its experts.

    Attributes:
        blocks: uint8 (N, K / 32, 16) on the CPU. scales: uint8 (N, K / 32).
    """

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        b, s = self.blocks, self.scales
        if b.dtype != torch.uint8 or s.dtype != torch.uint8 or b.dim() != 3 or b.shape[-1] != MXFP4_GROUP // 2 \
                or tuple(b.shape[:2]) != tuple(s.shape) or not b.is_contiguous() or not s.is_contiguous():
            raise ValueError(f"MXFP4 blocks and scales are contiguous uint8 (N, K / 32, 16) and (N, K / 32), got "
                             f"{b.dtype} {tuple(b.shape)} and {s.dtype} {tuple(s.shape)}")

    @property
    def n(self) -> int:
        return self.blocks.shape[0]

    @property
    def k(self) -> int:
        return self.blocks.shape[1] * MXFP4_GROUP

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight in ``dtype``: each e2m1 value times 2^(s - 127) in float32 (exact), then ``dtype``."""
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        values = torch.stack([lut[(self.blocks & 0x0F).long()], lut[(self.blocks >> 4).long()]], dim=-1)
        values = torch.ldexp(values.reshape(self.n, -1, MXFP4_GROUP), self.scales.to(torch.int32)[..., None] - 127)
        return values.reshape(self.n, self.k).to(dtype)


def mxfp4_linear(x: torch.Tensor, weight: Mxfp4Weight, bias: torch.Tensor | None = None,
                 bf16: bool = False) -> torch.Tensor:
    """``x @ weight.dequantize(d).T + bias`` with the bits of ``swarm.kernels.fma.linear`` over that dequantized
    weight, ``d`` float32 (``bf16`` False) or bfloat16 (``fp8.c`` decodes a panel of rows, then that GEMM).

    Args:
        x: (M, K) float32 on the CPU. bias: (N,) float32 or None.
    Returns:
        (M, N) float32, a new tensor.
    Raises:
        ValueError: shapes or dtypes that do not fit. RuntimeError: kernels unavailable. MemoryError.
    """
    lib = fma._library()
    x, out, b = fma.held_operands(x, weight.k, weight.n, bias, "mxfp4_linear")
    rc = lib.swarm_mxfp4_linear(x.data_ptr(), x.shape[0], weight.k, x.stride(0), weight.blocks.data_ptr(),
                                weight.k // 2, weight.scales.data_ptr(), weight.k // MXFP4_GROUP, weight.n,
                                None if b is None else b.data_ptr(), out.data_ptr(), weight.n, int(bf16),
                                fma.threads())
    if rc == -2:
        raise MemoryError(f"no memory for a panel of the ({weight.n}, {weight.k}) MXFP4 weight")
    if rc:
        raise ValueError(f"the MXFP4 kernel refused a ({weight.n}, {weight.k}) weight")
    return out

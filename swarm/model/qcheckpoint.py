"""Quantized checkpoints as published: which a stage takes (``quantization_config`` ``fp8`` and ``mxfp4``,
others refused by name), their dequantization to the bits transformers holds on a CPU, and FP8 Linear
weights and FP8 / MXFP4 experts held as stored (:func:`hold_fp8`, :func:`hold_experts`; multiplied by
:mod:`swarm.kernels.fp8`). docs/kernels.md,
"FP8 and MXFP4 checkpoints", gives the arithmetic and what is not held in its format yet."""

from __future__ import annotations

import math

import torch

from swarm.errors import ModelError
from swarm.kernels.fp8 import MXFP4_GROUP, Fp8Weight, Mxfp4Weight
from swarm.model import qformats

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_ATTR = "swarm_fp8"  # the Fp8Weight a Linear module holds, in its __dict__ (its weight parameter is emptied)


METHODS = ("fp8", "mxfp4")


def block_size(config) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a checkpoint quantized as ``fp8`` (None: none named, an ``mxfp4``
    checkpoint, or a float one).

    Raises:
        ModelError: a ``quantization_config`` of another method (bitsandbytes, GPTQ, AWQ, ...): not
            supported yet.
    """
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method not in METHODS:
        raise ModelError(f"the checkpoint is quantized with {method!r} (config.json quantization_config); a stage "
                         "loads float checkpoints, GGUF files, FP8 with block scales and MXFP4 experts, not this "
                         "method yet")
    if method == "mxfp4":
        return None
    block = q.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ModelError(f"quantization_config weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def scale_name(weight_name: str) -> str:
    """The checkpoint name of a weight's block scales: ``...proj.weight`` -> ``...proj.weight_scale_inv``."""
    return weight_name + "_scale_inv"


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``weight`` (..., N, K) in float8 times its block's scale from ``scale_inv`` (..., ceil(N / bn),
    ceil(K / bk)), as float32: the product transformers forms (each a float32 multiply, so the same bits).

    Args:
        block: (bn, bk) rows and columns per scale; None: from the shapes (N and K divided evenly).
    Raises:
        ModelError: a scale grid that does not match the weight's shape.
    """
    block = scale_block(tuple(weight.shape), tuple(scale_inv.shape), block)
    rows, cols = weight.shape[-2:]
    grid = scale_inv.shape[-2:] if scale_inv.dim() >= 2 else (1, 1)
    scale = scale_inv.to(torch.float32).reshape(*scale_inv.shape[:-2], *grid)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32) * scale


def scale_block(shape: tuple[int, ...], scale_shape: tuple[int, ...],
                block: tuple[int, int] | None) -> tuple[int, int]:
    """The (bn, bk) block of each scale of a (..., N, K) FP8 weight with scales of ``scale_shape``: ``block``
    (``weight_block_size``) checked against the grid, or, when None, N and K divided evenly by the grid.

    Raises:
        ModelError: a scale grid that does not match the weight's shape.
    """
    rows, cols = shape[-2:]
    grid = scale_shape[-2:] if len(scale_shape) >= 2 else (1, 1)
    if block is None:
        if rows % grid[0] or cols % grid[1]:
            raise ModelError(f"an FP8 weight of shape {shape} does not divide into its {tuple(grid)} scale blocks")
        block = (rows // grid[0], cols // grid[1])
    if tuple(grid) != (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        raise ModelError(f"an FP8 weight of shape {shape} has scales of shape {scale_shape}, not one per "
                         f"{block[0]}x{block[1]} block")
    return block


def fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> Fp8Weight:
    """A checkpoint's float8 e4m3 (N, K) weight and its scales (a (gn, gk) grid, or one scalar) as held.

    Raises:
        ModelError: scales that do not fit the weight.
    """
    grid = tuple(scale_inv.shape) if scale_inv.dim() == 2 else (1, 1)  # a scalar: one scale for the tensor
    return Fp8Weight.of(weight, scale_inv.reshape(grid), scale_block(tuple(weight.shape), grid, block))


class HeldExpert:
    """Expert e's matrix of a fused experts parameter, held as published: FP8 or MXFP4 row parts ((N, K) each,
    the rows of a fused ``gate_up`` the gate's then the up's). ``F.linear(x, experts[e])`` (``transposed``
    False: DeepSeek's, Qwen's) or ``x @ experts[e]`` (True: gpt-oss's, whose W[e] is (K, N)) runs
    :mod:`swarm.kernels.fp8` on each part in x's dtype's arithmetic and returns x's dtype; any other use raises
    TypeError (through ``__torch_function__``)."""

    def __init__(self, parts: list[Fp8Weight | Mxfp4Weight], transposed: bool = False):
        if len({p.k for p in parts}) != 1:
            raise ModelError(f"an expert's parts take different inputs: {[p.k for p in parts]}")
        self.parts, self.transposed = parts, transposed
        self.n, self.k = sum(p.n for p in parts), parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2 and isinstance(args[1], cls) \
                and not args[1].transposed and (args[2] if len(args) > 2 else kwargs.get("bias")) is None:
            x, w = args[0], args[1]
        elif func in qformats.MATMULS and len(args) == 2 and isinstance(args[1], cls) and args[1].transposed:
            x, w = args
        else:
            return NotImplemented
        from swarm.kernels import fp8

        flat, bf16 = x.reshape(-1, w.k).float(), x.dtype is torch.bfloat16
        out = torch.cat([(fp8.linear if isinstance(p, Fp8Weight) else fp8.mxfp4_linear)(flat, p, bf16=bf16)
                         for p in w.parts], dim=1)
        return out.reshape(*x.shape[:-1], w.n).to(x.dtype)


def hold_experts(owner: torch.nn.Module, leaf: str, experts: qformats.QExperts) -> int:
    """Put ``experts`` in place of ``owner``'s fused parameter ``leaf`` (``gate_up_proj`` / ``down_proj``: (E, N,
    K), or (E, K, N) for transposed experts; on the meta device until loaded); returns the bytes held.

    Raises:
        ModelError: the experts' count or shapes are not the parameter's.
    """
    want = tuple(owner._parameters[leaf].shape)
    first = experts.experts[0]
    shape = (first.k, first.n) if first.transposed else (first.n, first.k)
    if (len(experts.experts), *shape) != want or any((x.n, x.k) != (first.n, first.k) for x in experts.experts):
        raise ModelError(f"experts held as published of {(len(experts.experts), *shape)} do not fit {leaf} of {want}")
    del owner._parameters[leaf]
    owner.__dict__[leaf] = experts
    return experts.nbytes


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor) -> qformats.QExperts:
    """gpt-oss's MXFP4 experts as published, ``blocks`` (E, R, G, 16) and ``scales`` (E, R, G) uint8, held as E
    transposed :class:`HeldExpert` (W[e] = the dequantized (R, G * 32) rows, transposed).

    Raises:
        ModelError: shapes or dtypes that are not MXFP4's.
    """
    _check_mxfp4(blocks, scales)
    return qformats.QExperts([HeldExpert([Mxfp4Weight(blocks[e].contiguous(), scales[e].contiguous())], transposed=True)
                        for e in range(blocks.shape[0])])


def hold_fp8(linear: torch.nn.Linear, weight: torch.Tensor, scale_inv: torch.Tensor,
             block: tuple[int, int] | None) -> int:
    """Hold ``weight`` (float8 e4m3fn, (N, K)) and its scales in ``linear`` as stored (``FP8_ATTR``; the
    float weight parameter emptied); returns the bytes held.

    Raises:
        ModelError: a weight of another shape than the Linear's, or scales that do not fit it.
    """
    if weight.dtype is not torch.float8_e4m3fn or tuple(weight.shape) != (linear.out_features, linear.in_features):
        raise ModelError(f"an FP8 weight {weight.dtype} {tuple(weight.shape)} does not fit the Linear of "
                         f"({linear.out_features}, {linear.in_features})")
    held = fp8_weight(weight, scale_inv, block)
    linear.__dict__[FP8_ATTR] = held
    linear.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    return held.nbytes


def weight_of(linear: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight ``linear`` multiplies by in a block of ``dtype``: its FP8 weight dequantized
    (float32, or rounded to bfloat16 for a bfloat16 block), else its weight parameter."""
    held = linear.__dict__.get(FP8_ATTR)
    return linear.weight if held is None else held.dequantize(torch.bfloat16 if dtype is torch.bfloat16 else
                                                               torch.float32)


def mxfp4_sources(name: str, index) -> tuple[str, tuple[str, str]] | None:
    """``("mxfp4", (blocks, scales))`` when the checkpoint holds parameter ``name`` (gpt-oss's
    ``mlp.experts.gate_up_proj`` / ``down_proj``) as MXFP4 ``name_blocks`` and ``name_scales``; else None."""
    blocks, scales = name + "_blocks", name + "_scales"
    return ("mxfp4", (blocks, scales)) if blocks in index and scales in index else None


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 experts as transformers' gpt-oss holds them, float32: ``blocks`` (E, R, G, 16) uint8 (two
    e2m1 values a byte, the low nibble first) and ``scales`` (E, R, G) uint8 (2^(s - 127) for each group
    of 32) -> (E, G * 32, R), every value an e2m1 value times a power of two (exact).

    Raises:
        ModelError: shapes or dtypes that are not MXFP4's.
    """
    _check_mxfp4(blocks, scales)
    return torch.stack([Mxfp4Weight(blocks[e].contiguous(), scales[e].contiguous()).dequantize().t()
                        for e in range(blocks.shape[0])])


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 \
            or blocks.shape[-1] != MXFP4_GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} are not (E, R, G, 16) and (E, R, G) bytes")

"""FP8 checkpoints with block scales (DeepSeek-V3/R1, Qwen3 FP8, GLM-4.5 FP8, as published).

Owns: which quantized checkpoints a stage takes (``quantization_config``: ``fp8`` only; any other
method is refused by name, never loaded as garbage) and the dequantization of an FP8 weight with its
``weight_scale_inv`` blocks, as transformers' FineGrainedFP8 does on a CPU (``dequantize``): the
float8 value and its block's scale as float32, one float32 multiply, then the block's dtype. Not yet
(issue 47): holding the weights in FP8 and decoding them in the kernels.
"""

from __future__ import annotations

import math

import torch

from swarm.errors import ModelError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(config) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a checkpoint quantized as ``fp8`` (None: none named, or a float
    checkpoint).

    Raises:
        ModelError: a ``quantization_config`` of another method (gpt-oss's ``mxfp4``, bitsandbytes,
            GPTQ, AWQ, ...): not supported yet.
    """
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelError(f"the checkpoint is quantized with {method!r} (config.json quantization_config); a stage "
                         "loads float checkpoints, GGUF files and FP8 with block scales, not this method yet")
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
    rows, cols = weight.shape[-2:]
    grid = scale_inv.shape[-2:] if scale_inv.dim() >= 2 else (1, 1)
    if block is None:
        if rows % grid[0] or cols % grid[1]:
            raise ModelError(f"an FP8 weight of shape {tuple(weight.shape)} does not divide into its "
                             f"{tuple(grid)} scale blocks")
        block = (rows // grid[0], cols // grid[1])
    if tuple(grid) != (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        raise ModelError(f"an FP8 weight of shape {tuple(weight.shape)} has scales of shape {tuple(scale_inv.shape)}, "
                         f"not one per {block[0]}x{block[1]} block")
    scale = scale_inv.to(torch.float32).reshape(*scale_inv.shape[:-2], *grid)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32) * scale

"""Batch-invariant GEMM, attention, RMSNorm and SiLU in Triton: the ``triton`` kernel mode of CUDA stages.

Owns: the Triton kernels (fixed tiles without split-K, attention per query row in fixed 64-key blocks) and their torch
wrappers :func:`linear`, :func:`attention`, :func:`rms_norm`, :func:`silu`; :func:`available` and :func:`describe`.
Importing it imports triton; on the CPU it runs only under ``TRITON_INTERPRET=1`` (docs/kernels.md).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch
import triton
import triton.language as tl

# Tile constants: a row's bits may depend on them, so they are fixed, never chosen by M, and named
# in the stage's reproducibility class (swarm.kernels.facts).
BLOCK_M = 32  # rows per GEMM tile
BLOCK_N = 64  # output columns per GEMM tile
BLOCK_K = 64  # reduction depth per step of a GEMM tile's K loop
KEY_BLOCK = 64  # keys per attention block (the fma kernels' block too)
NUM_WARPS = 4  # fixed launch configuration: one compiled kernel for every M
NUM_STAGES = 2

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["m"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, m, n, k, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EXPLICIT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    depth = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k, BK):  # one fixed order, one accumulator: no split-K
        kk = k0 + depth
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < m) & (kk[None, :] < k),
                    other=0.0)  # (BM, BK)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None], mask=(cols[None, :] < n) & (kk[:, None] < k),
                    other=0.0)  # (BK, BN): W^T's tile
        if EXPLICIT:  # the interpreter's tl.dot is numpy's matmul: see _EXPLICIT_TILE_PRODUCT
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < m) & (cols[None, :] < n))


@triton.jit(do_not_specialize=["pos"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, pos, window, scale, stride_qt, stride_qh, stride_ks, stride_kh,
                      stride_vs, stride_vh, stride_ot, stride_oh, group, head_dim,
                      IEEE: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BKEYS: tl.constexpr):
    t = tl.program_id(0)  # query row: absolute position pos + t
    g = tl.program_id(1)  # kv head; its query heads are g * group + [0, group)
    p = pos + t
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)  # first key the row sees
    heads = g * group + tl.arange(0, BG)
    dims = tl.arange(0, BD)
    hmask = tl.arange(0, BG) < group
    dmask = dims < head_dim
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)  # (BG, BD)
    m_i = tl.full((BG,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BG,), dtype=tl.float32)
    acc = tl.zeros((BG, BD), dtype=tl.float32)
    for s0 in range((lo // BKEYS) * BKEYS, p + 1, BKEYS):  # key blocks at fixed positions, in order
        keys = s0 + tl.arange(0, BKEYS)
        valid = (keys >= lo) & (keys <= p)
        kt = tl.load(k_ptr + keys[None, :] * stride_ks + g * stride_kh + dims[:, None],
                     mask=valid[None, :] & dmask[:, None], other=0.0)  # (BD, BKEYS)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # (BG, BKEYS)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block has a valid key
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, 1)
        v = tl.load(v_ptr + keys[:, None] * stride_vs + g * stride_vh + dims[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0)  # (BKEYS, BD)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(w, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, d, eps, BD: tl.constexpr):
    row = tl.program_id(0)
    dims = tl.arange(0, BD)
    mask = dims < d
    x = tl.load(x_ptr + row * d + dims, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / d  # one reduction over the row's fixed padded width
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)  # transformers: weight * hidden.to(input_dtype)
    w = tl.load(w_ptr + dims, mask=mask, other=0.0)
    tl.store(out_ptr + row * d + dims, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    tl.store(out_ptr + i, (xf * tl.sigmoid(xf)).to(out_ptr.dtype.element_ty), mask=mask)


INTERPRETED = type(_linear_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET was set at import
# triton.language's own helpers (tl.sum, tl.sigmoid...) are decorated when triton.language is first
# imported (transformers imports it): set after that, TRITON_INTERPRET gives interpreted kernels that
# call compiled helpers, which fails at the first call
_HELPERS_INTERPRETED = type(getattr(getattr(tl, "standard", None), "sum", None)).__name__ == "InterpretedFunction"

# Under the interpreter tl.dot is numpy's matmul (OpenBLAS), which gives a row other bits in another
# row slot of the same tile (measured 2026-12-04 on the AMD EPYC, OpenBLAS 0.3.31: 22 of 32 rows of a
# 32 x 64 x 64 product), so a decode row (slot 0) and the same row inside a chunk would differ for a
# reason no GPU has: an MMA instruction computes every slot with the same steps. There the GEMM tile
# product is written out as a sum over K of products, the same steps for every slot, so the
# interpreted kernel still tests the tiling, the K loop's order, the masks and the bias; that tl.dot
# keeps a slot's bits on a GPU is what the gpu tests and a stage's check_block prove there.
_EXPLICIT_TILE_PRODUCT = INTERPRETED


def available(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether these kernels run for a block on ``device`` in ``dtype``, and why not when they do not."""
    name = str(dtype).removeprefix("torch.")
    if INTERPRETED != _HELPERS_INTERPRETED:
        return False, ("TRITON_INTERPRET changed after triton.language was imported (transformers imports it): "
                       "set it before the process starts")
    if device.type == "cuda":
        if dtype not in DTYPES:
            return False, f"they take float32, bfloat16 or float16, this block is {name}"
        return True, ""
    if device.type != "cpu":
        return False, f"Triton runs on CUDA (and its interpreter on the CPU), this block is on {device}"
    if not INTERPRETED:
        return False, ("Triton has no CPU backend; TRITON_INTERPRET=1 (set before the stage starts) runs its "
                       "interpreter, slowly, for tests")
    if dtype != torch.float32:
        return False, f"Triton's interpreter multiplies float32 tiles only (numpy has no bfloat16), not {name}"
    return True, ""


def describe() -> dict:
    """The facts these kernels' bits rest on besides the device: their source, tiles, Triton version."""
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return {"source": source, "block_m": BLOCK_M, "block_n": BLOCK_N, "block_k": BLOCK_K, "key_block": KEY_BLOCK,
            "num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "triton": triton.__version__,
            "interpreter": INTERPRETED}


def _check(*tensors: torch.Tensor) -> None:
    first = tensors[0]
    for x in tensors:
        if x.dtype not in DTYPES or x.device != first.device:
            raise ValueError(f"the triton kernels take float32, bfloat16 or float16 tensors on one device, got "
                             f"{', '.join(f'{t.dtype} on {t.device}' for t in tensors)}")


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit last stride, starting on a 16-byte boundary: Triton compiles a kernel apart for
    pointers that are not (a slice of a packed chunk), and a row must take the same compiled code as
    a decode step, whose tensors are fresh allocations."""
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


# The interpreter patches triton.language's functions for the length of a launch, so two threads
# launching at once (two stages of one process, each computing in its worker thread) break each
# other's kernels: interpreted launches take turns. Compiled launches need no lock.
_INTERPRETER_LOCK = threading.Lock()


def _launch(kernel, grid, *args, **kwargs):
    if INTERPRETED:  # the interpreter takes no launch options
        with _INTERPRETER_LOCK:
            return kernel[grid](*args, **kwargs)
    return kernel[grid](*args, **kwargs, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, each output element one fixed K loop over its own row: its bits never
    depend on M or on the other rows.

    Args:
        x: (M, K) with a unit last stride, M >= 0; float32, bfloat16 or float16.
        weight: (N, K) with a unit last stride (an ``nn.Linear`` weight), x's dtype and device.
        bias: (N,) or None.
        blocks: (BLOCK_M, BLOCK_N, BLOCK_K) in place of the module's constants; for tests that show a
            tile chosen by M would change bits. Never pass it in a stage.
    Returns:
        (M, N) in x's dtype, a new tensor.
    Raises:
        ValueError: mismatched shapes, other dtypes, tensors on different devices.
    """
    _check(x, weight, *([] if bias is None else [bias]))
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or (
            bias is not None and tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"linear shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    x, weight = _aligned(x), _aligned(weight)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bm, bn, bk = blocks or (BLOCK_M, BLOCK_N, BLOCK_K)
    b = bias.contiguous() if bias is not None else x  # a dummy pointer when there is no bias
    _launch(_linear_kernel, (triton.cdiv(m, bm), triton.cdiv(n, bn)), x, weight, b, out, m, n, k, x.stride(0),
            weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
            EXPLICIT=_EXPLICIT_TILE_PRODUCT, BM=bm, BN=bn, BK=bk)
    return out


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float,
              window: int | None = None, *, key_block: int = KEY_BLOCK) -> torch.Tensor:
    """Causal attention of one session's T query rows at positions ``[pos, pos + T)`` over its cache,
    each row over its own keys only, in fixed key blocks: a row's bits are a decode step's at its position.

    Args:
        query: (T, H, Dh), heads and dims with unit strides within a row.
        keys, values: (S, Hkv, Dh) position-major cache views with S >= pos + T and a unit last stride
            (a ``KVCache`` buffer); H must be a multiple of Hkv (grouped-query attention).
        pos: absolute position of query row 0.
        scale: the score scale (1 / sqrt(Dh) usually).
        window: sliding window in positions (a row at p sees keys ``[p - window + 1, p]``), or None.
        key_block: keys per block; for tests only (a row's bits depend on it).
    Returns:
        (T, H, Dh) in query's dtype.
    Raises:
        ValueError: shapes that do not fit, other dtypes, tensors on different devices.
    """
    _check(query, keys, values)
    if query.dim() != 3 or keys.dim() != 3 or values.shape != keys.shape:
        raise ValueError(f"attention shapes do not fit: query {tuple(query.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}")
    t, h, dh = query.shape
    s, hkv, dh_k = keys.shape
    if dh_k != dh or h % hkv or s < pos + t or pos < 0:
        raise ValueError(f"attention shapes do not fit: query {tuple(query.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}, pos {pos}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError(f"keys and values need a unit last stride, got {keys.stride()} and {values.stride()}")
    query = _aligned(query)
    out = torch.empty((t, h, dh), dtype=query.dtype, device=query.device)
    if t == 0:
        return out
    group = h // hkv
    bg = max(16, triton.next_power_of_2(group))  # tl.dot wants every side >= 16
    bd = max(16, triton.next_power_of_2(dh))
    _launch(_attention_kernel, (t, hkv), query, keys, values, out, pos, int(window or 0), float(scale),
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
            out.stride(0), out.stride(1), group, dh, IEEE=query.dtype == torch.float32, BG=bg, BD=bd,
            BKEYS=key_block)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, each row alone, in float32 (transformers' ``LlamaRMSNorm``).

    Args:
        x: (..., D) float32, bfloat16 or float16. weight: (D,) on x's device. eps: the module's epsilon.
    Returns:
        A new tensor shaped like ``x``, in the dtype of ``weight * x`` (x's when they agree).
    Raises:
        ValueError: a weight of another width, other dtypes, tensors on different devices.
    """
    _check(x, weight)
    d = x.shape[-1]
    if tuple(weight.shape) != (d,):
        raise ValueError(f"rms_norm weight {tuple(weight.shape)} does not fit rows of {d}")
    x = _aligned(x.contiguous())
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = x.numel() // d if d else 0
    if rows:
        _launch(_rms_norm_kernel, (rows,), x, weight.contiguous(), out, d, float(eps),
                BD=triton.next_power_of_2(d))
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of every element, each alone, in float32. x: float32, bfloat16 or float16; returns a new tensor."""
    _check(x)
    x = _aligned(x.contiguous())
    out = torch.empty_like(x)
    if x.numel():
        _launch(_silu_kernel, (triton.cdiv(x.numel(), 1024),), x, out, x.numel(), BLOCK=1024)
    return out

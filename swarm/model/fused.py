"""Llama-structured decoder layers run as one ``fma_layer.c`` call each (the fma kernel mode's fused path).

Owns: which decoder layers the fused path takes (Llama, Mistral, Qwen2, Qwen3: RMSNorms, q/k/v/o and
gate/up/down Linears of float32, bfloat16, FP8 or llama.cpp block-format weights, SiLU; the others stay on the
module path), their :class:`swarm.kernels.fma.LayerPlan` built once from the modules' weights, and a packed
step's rows for the C call: h, the rotary rows and each session's KV buffers (grown first, here, as the
module path's ``KVCache.update`` would grow them). The C call performs the module path's operations in
its order through the same kernels, so the hidden states and caches are the module path's bit for bit
(``tests/model/test_fused_layer.py``).
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from swarm.kernels import fma, qblocks
from swarm.model import qcheckpoint, qformats
from swarm.model.cache import KVCache

LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
SILUS = ("SiLUActivation", "SiLU")
FORMAT_NUMBERS = {name: i for i, name in enumerate(qblocks.FORMATS)}  # swarm_qlinear's numbering


def layer_plan(layer: torch.nn.Module, dtype: torch.dtype, window: int | None) -> fma.LayerPlan | None:
    """``layer``'s plan for :func:`swarm.kernels.fma.decoder_layer`, or None where the fused path does not
    take it (another structure, an activation other than SiLU, weights held in torch's int8/int4).

    Args:
        layer: a decoder layer of the block, its weights loaded. dtype: the block dtype.
        window: its attention's sliding window in positions (``LayerBlock._window``), or None.
    """
    if type(layer).__name__ not in LAYERS or dtype not in (torch.float32, torch.bfloat16):
        return None
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    qk_norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if qk_norms == [None, None]:
        qk_norms = []
    if attn is None or mlp is None or getattr(attn, "sinks", None) is not None \
            or type(getattr(mlp, "act_fn", None)).__name__ not in SILUS \
            or any(type(n).__name__ not in RMS_NORMS or not hasattr(n, "variance_epsilon") for n in norms + qk_norms):
        return None
    linears = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj, "gate": mlp.gate_proj,
               "up": mlp.up_proj, "down": mlp.down_proj}
    projections = {}
    for name, lin in linears.items():
        if not isinstance(lin, torch.nn.Linear) or "swarm_quant" in lin.__dict__:
            return None
        q, fp8 = lin.__dict__.get(qformats.ATTR), lin.__dict__.get(qcheckpoint.FP8_ATTR)
        weight = fp8 if fp8 is not None else lin.weight if q is None else fma.Blocks(q.data, FORMAT_NUMBERS[q.fmt], q.k)
        projections[name] = (weight, lin.bias)
    config = attn.config
    try:
        return fma.layer_plan(
            dtype=dtype, heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=attn.head_dim, norm_in=norms[0].weight, norm_post=norms[1].weight,
            eps_in=norms[0].variance_epsilon, eps_post=norms[1].variance_epsilon, projections=projections,
            scale=attn.scaling, window=window,
            q_norm=qk_norms[0].weight if qk_norms else None, k_norm=qk_norms[1].weight if qk_norms else None,
            eps_qk=qk_norms[0].variance_epsilon if qk_norms else 0.0)
    except ValueError:  # shapes the C layer does not take: the module path runs it
        return None


_buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KVCache -> _Buffers of its last forward


class _Buffers:
    """A cache's buffer addresses for a span's layers, valid while ``cache.version`` stays ``version``."""

    def __init__(self, cache: KVCache, first: int, last: int, needed: int, heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        pairs = cache.reserve(range(first, last), needed, heads, head_dim, dtype, device)
        self.key = (cache.version, first, last, heads, head_dim, dtype)
        self.capacity = min(k.shape[1] for k, _ in pairs)
        self.keys = (ctypes.c_void_p * len(pairs))(*(k.data_ptr() for k, _ in pairs))
        self.values = (ctypes.c_void_p * len(pairs))(*(v.data_ptr() for _, v in pairs))


def step_rows(h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segs: list, first: int, last: int,
              heads: int, head_dim: int) -> fma.LayerRows | None:
    """A packed step's rows for layers ``[first, last)``, each session's caches grown to hold its new positions.

    Args:
        h: (1, N, D) block dtype, the rows entering layer ``first`` (a tensor the forward owns: updated in place).
        rope: cos, sin (1, N, Dh) of the block dtype. segs: the forward's segments (cache, pos, t, off),
            each cache begun at pos.
        heads, head_dim: the layers' Hkv and Dh (their KV rows).
    Returns:
        The rows, or None where the rotary rows are not Dh wide (partial rotary: the module path's).
    """
    cos, sin = rope
    if cos.shape[-1] != head_dim:
        return None
    segments = []
    for s in segs:
        bufs = _buffers.get(s.cache)
        key = (s.cache.version, first, last, heads, head_dim, h.dtype)
        if bufs is None or bufs.key != key or bufs.capacity < s.pos + s.t:
            bufs = _buffers[s.cache] = _Buffers(s.cache, first, last, s.pos + s.t, heads, head_dim, h.dtype,
                                                h.device)
        segments.append((s.pos, s.t, s.off, bufs.keys, bufs.values))
    return fma.layer_rows(h[0], cos[0].contiguous(), sin[0].contiguous(), segments)

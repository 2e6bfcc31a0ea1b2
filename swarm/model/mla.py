"""Multi-head latent attention (DeepSeek-V3's MLA) over a session's KV cache, one query row at a time.

Owns: :func:`is_mla`, :func:`defer_expansion` (a packed forward hands its latents to the attention function unexpanded)
and :func:`attention` (each session's cached latents expanded by the module's own ``expand_kv``, then SDPA per query
row over exactly what a decode step at that position sees). The cache's layout and sources: docs/architecture.md.
"""

from __future__ import annotations

import torch

from swarm.kernels.invariant import fresh


def is_mla(module: torch.nn.Module) -> bool:
    """True for a multi-head latent attention module (transformers' ``DeepseekV3Attention``)."""
    return hasattr(module, "kv_b_proj") and hasattr(module, "expand_kv")


def defer_expansion(module: torch.nn.Module, deferred) -> None:
    """Make ``module.expand_kv`` return the latents unchanged while ``deferred()`` is true (inside a
    packed forward, where :func:`attention` expands each session's cache); the module's own method
    stays reachable as ``module.swarm_expand_kv``."""
    plain = module.expand_kv
    module.swarm_expand_kv = plain

    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor):
        if deferred():
            return kv_nope, k_rot
        return plain(kv_nope, k_rot)

    module.expand_kv = expand_kv


def attention(sdpa, module, query: torch.Tensor, latents: torch.Tensor, rope_keys: torch.Tensor, pos: int,
              mask_of, **kwargs) -> torch.Tensor:
    """One session's MLA attention, one query row at a time, each as a one-token decode step runs it.

    Args:
        sdpa: transformers' ``sdpa_attention_forward`` (or a function with its signature).
        module: the ``DeepseekV3Attention`` module (``swarm_expand_kv`` set by :func:`defer_expansion`).
        query: (1, H, T, qk_nope_head_dim + qk_rope_head_dim) this session's queries at positions
            ``[pos, pos + T)``, after rotary.
        latents: (1, 1, pos + T, kv_lora_rank) the session's cached latents. rope_keys: (1, 1, pos + T,
            qk_rope_head_dim) its cached rotary keys.
        pos: absolute position of the first query row.
        mask_of: ``mask_of(module, position, 1)`` -> boolean mask or None for a one-row query.
        kwargs: passed on to ``sdpa`` (scaling, dropout).
    Returns:
        (1, T, H, v_head_dim), token-major as transformers' attention functions return it.
    """
    keys, values = module.swarm_expand_kv(latents, rope_keys)  # (1, H, S, Dk), (1, H, S, Dv)
    outs = []
    for i in range(query.shape[2]):
        end = pos + i + 1  # a decode step at position pos + i expands and sees rows [0, pos + i]
        out, _ = sdpa(module, fresh(query[:, :, i:i + 1]), fresh(keys[:, :, :end]), fresh(values[:, :, :end]),
                      mask_of(module, pos + i, 1), **kwargs)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

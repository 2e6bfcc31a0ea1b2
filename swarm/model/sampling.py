"""Keyed sampling: a token for absolute position n drawn with noise keyed by (seed, n).

Owns: :func:`sample` (Gumbel-max over the tempered, top-k / top-p filtered logits, its noise from a CPU generator seeded
by :func:`position_key`), so a run replays and a position's token does not depend on chunking. Why speculation stays
lossless with it, and the sources: docs/architecture.md, "Sampling".
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

from swarm.config import SamplingParams


def position_key(seed: int, position: int) -> int:
    """A 63-bit generator seed for (seed, absolute position); blake2b, so keys do not collide in practice."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, position), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tempered log-weights with tokens outside top-k / top-p set to -inf.

    Args:
        logits: (V,) float tensor. Returns: (V,) float64 on CPU.
    """
    x = logits.detach().to("cpu", torch.float64) / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= params.top_p  # mass before this token already reached p
        drop[0] = False
        x = x.clone()
        x[order[drop]] = -math.inf
    return x


def sample(logits: torch.Tensor, position: int, params: SamplingParams) -> int:
    """The token for absolute ``position`` given its (V,) logits: argmax when greedy, else Gumbel-max
    over ``filter_logits`` with noise keyed by (params.seed, position)."""
    if params.greedy:
        return int(logits.argmax())
    x = filter_logits(logits, params)
    gen = torch.Generator().manual_seed(position_key(params.seed, position))
    u = torch.rand(x.numel(), generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    gumbel = -torch.log(-torch.log(u))
    return int((x + gumbel).argmax())


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(V,) float64 probabilities the sampler draws from (for tests and diagnostics)."""
    return torch.softmax(filter_logits(logits, params), dim=-1)

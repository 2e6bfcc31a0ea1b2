"""Keyed sampling: a token for absolute position n drawn with noise keyed by (seed, n).

Owns: ``sample`` (the settings are ``swarm.config.SamplingParams``) — the
Gumbel-max trick over the filtered, tempered logits, with Gumbel noise generated from a CPU
generator seeded by a hash of (seed, position). A run is therefore replayable, and the token at a
position does not depend on how positions were grouped into chunks.

Speculation with sampling (``swarm.coordinator.spec``) verifies drafts by exact match against this keyed
sample, as in the greedy case. That is lossless: the committed token at every position is exactly
a sample of the target distribution (Gumbel-max), and it is the *same* token a non-speculative run
draws, for any drafter, K and depth. For a one-hot draft (n-gram) the acceptance probability is
p(x), the same as the rejection rule of Leviathan et al. 2023 (arXiv 2211.17192); a model drafter
that samples its drafts with the same keyed noise (coupled sampling) accepts with high probability
when its distribution is close to the target's. The draft distribution is therefore never sent.

References: Gumbel-max trick (Gumbel 1954; Maddison et al. 2014, "A* Sampling"); top-k (Fan et
al. 2018) and nucleus / top-p sampling (Holtzman et al. 2019), applied after temperature in that
order, as transformers' logits processors do.
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

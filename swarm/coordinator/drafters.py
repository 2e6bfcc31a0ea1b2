"""Drafters: propose tokens for speculative verify chunks.

Owns: ``NgramDrafter`` (prompt lookup over prompt + committed output; standard library only), ``ModelDrafter`` (a
small causal LM sharing the target's tokenizer, with its own KV cache; torch lazily) and ``make_drafter`` (the
``--draft`` flag). What each does, and the sources: docs/architecture.md, "Speculative decoding".
"""

from __future__ import annotations

from typing import Sequence

from swarm.errors import ConfigError
from swarm.coordinator.spec import NoDrafter
from swarm.ranges import LayerRange


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n-gram and propose
    what followed it. Tries ``max_ngram`` down to ``min_ngram``; proposes nothing without a match."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"bad n-gram sizes {min_ngram}..{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        """Up to ``n`` ids continuing ``context`` (list of ids), or [] when no n-gram recurs."""
        ctx = list(context)
        for size in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            pattern = ctx[-size:]
            for i in range(len(ctx) - size - 1, -1, -1):  # latest earlier occurrence first
                if ctx[i:i + size] == pattern:
                    follow = ctx[i + size:i + size + n]
                    if follow:
                        return follow
        return []


class ModelDrafter:
    """Drafts from a small causal LM with its own KV cache (greedy, or sampled with the run's keyed noise).

    The cache follows the context by common prefix: positions where the context changed (a
    rejection) are rolled back by ``kv_len``, so no separate accept/reject notice is needed.

    Args:
        model_dir: a local HF directory (or anything ``resolve_model`` accepts) of the draft model.
        target_vocab: the target model's vocabulary size; the draft's must match.
        dtype, device: as for stages; float32 on CPU by default.
        sampling: the run's SamplingParams; drafts use the same keyed noise (greedy by default).
    Raises:
        ConfigError / ModelError: the draft model is missing, unsupported, or its vocabulary differs.
    """

    name = "model"

    def __init__(self, model_dir, target_vocab: int, dtype: str = "auto", device: str = "auto",
                 sampling=None) -> None:
        import torch

        from swarm.config import SamplingParams
        from swarm.model.sampling import sample

        from swarm.model.block import load_block, model_num_layers
        from swarm.model.resolve import resolve_model

        self._torch = torch
        self._sample = sample
        # drafts are drawn with the target's keyed noise (coupled sampling): when the two models
        # agree, the draft equals the tail's sample and is accepted
        self.sampling = sampling or SamplingParams()
        path = resolve_model(str(model_dir)).path
        self.block = load_block(path, LayerRange(0, model_num_layers(path)), dtype=dtype, device=device)
        if self.block.vocab_size != target_vocab:
            raise ConfigError(f"draft model {model_dir} has a vocabulary of {self.block.vocab_size}, "
                              f"the target's is {target_vocab}: they must share the tokenizer")
        self.cache = self.block.new_cache()
        self.cached: list[int] = []  # tokens whose KV rows the cache holds, in order

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        """Up to ``n`` greedy draft ids continuing ``context`` (fewer at the draft's context limit)."""
        ctx = list(context)
        n = min(n, self.block.max_ctx - len(ctx))
        if n <= 0:
            return []
        common = 0
        for a, b in zip(self.cached, ctx[:-1]):
            if a != b:
                break
            common += 1
        feed = ctx[common:]
        out: list[int] = []
        pos = common
        for _ in range(n):
            logits = self.block.forward(self.cache, pos, token_ids=self._torch.tensor([feed]))
            pos += len(feed)
            nxt = self._sample(logits[0, -1], len(ctx) + len(out), self.sampling)
            out.append(nxt)
            feed = [nxt]
        self.cached = ctx + out[:-1]
        return out


def make_drafter(spec: str, target_vocab: int | None = None, sampling=None, **kwargs):
    """Build a drafter from a ``--draft`` value: ``none``, ``ngram`` or ``model:PATH``.

    Raises:
        ConfigError: on an unknown spec or a model drafter without ``target_vocab``.
    """
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter()
    if spec.startswith("model:") and len(spec) > len("model:"):
        if target_vocab is None:
            raise ConfigError("a model drafter needs the target's vocabulary size")
        return ModelDrafter(spec[len("model:"):], target_vocab, sampling=sampling, **kwargs)
    raise ConfigError(f"unknown drafter {spec!r}: use none, ngram or model:PATH")

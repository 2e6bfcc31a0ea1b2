"""Cheating stages, as test doubles: a stage's block whose ``forward_batch`` (and ``forward_steps``, the
pausable form a stage computes a long prompt's slice with) lies in one of the ways an
audit must catch (issue 29, item 6). Never a flag of the product: a test (or tests/support/cheat_stage.py)
wraps a loaded block with :func:`cheat` before or after the StageServer starts serving it.

Kinds (``KINDS``):

- ``garbage``: every output replaced by seeded noise of the same shape;
- ``bf16``: the block run in a lower precision than announced: the inputs and outputs rounded through
  bfloat16 (the KV cache then holds bf16-rounded keys and values as well);
- ``skip``: one layer of the block skipped (its residual stream passes through; the output stays
  plausible);
- ``replay``: another session's output at the same positions and shape sent instead of this one's (the
  first output of each position and shape is computed honestly and remembered);
- ``ulp``: one value of one position of one session moved by one unit in the last place (``session=None``:
  of every session, as a benchmark's per-session cheat of the smallest size);
- ``intermittent``: honest for its first ``honest_first`` (20) sessions, then garbage in 1 of
  ``one_in`` (20) sessions, picked by a seeded RNG.

Sessions are told apart by their KV cache (one per session at a stage) and numbered in order of
first forward.
"""

from __future__ import annotations

import random

import torch

KINDS = ("garbage", "bf16", "skip", "replay", "ulp", "intermittent")


class Cheat:
    """A block's ``forward_batch`` that cheats (see the module docstring). ``cheated`` counts the
    sessions it altered; ``sessions`` the sessions it saw."""

    def __init__(self, block, kind: str, *, seed: int = 0, layer: int = 0, session: int | None = 0, position: int = 3,
                 honest_first: int = 20, one_in: int = 20) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown cheat {kind!r}; one of {KINDS}")
        self.block, self.kind, self.layer, self.session, self.position = block, kind, layer, session, position
        self.honest_first, self.one_in = honest_first, one_in
        self._honest = block.forward_batch
        self._gen = torch.Generator().manual_seed(seed)
        self._rng = random.Random(seed)
        self._numbers: dict[int, tuple] = {}  # id(cache) -> (session number, cache kept alive)
        self._plan: dict[int, bool] = {}  # session number -> cheats in it (intermittent)
        self._seen: dict[tuple, torch.Tensor] = {}  # (pos, shape) -> an output (replay)
        self.cheated: set[int] = set()

    @property
    def sessions(self) -> int:
        return len(self._numbers)

    def unseen(self) -> bool:
        """Count a session this stage served that nobody computes here (a benchmark that re-runs only the
        sessions an auditor picks); returns whether the double would have cheated in it."""
        marker = object()
        return self.cheats_in(self._number(marker))

    def _number(self, cache) -> int:
        if id(cache) not in self._numbers:
            self._numbers[id(cache)] = (len(self._numbers), cache)
        return self._numbers[id(cache)][0]

    def cheats_in(self, n: int) -> bool:
        """Whether session ``n`` (0-based) is one this double cheats in."""
        if self.kind == "ulp":
            return self.session is None or n == self.session
        if self.kind == "replay":
            return n > 0
        if self.kind == "intermittent":
            if n not in self._plan:
                self._plan[n] = n >= self.honest_first and self._rng.randrange(self.one_in) == 0
            return self._plan[n]
        return True

    def forward_batch(self, rows: list, tile: int = 1, logits_rows=None, span=None) -> list:
        numbers = [self._number(cache) for cache, _, _ in rows]
        lying = [self.cheats_in(n) for n in numbers]
        if self.kind in ("bf16", "skip") and any(lying):
            ys = self._altered_run(rows, tile, logits_rows, span)
        else:
            ys = self._honest(rows, tile=tile, logits_rows=logits_rows, span=span)
        out = []
        for (cache, pos, x), y, n, lie in zip(rows, ys, numbers, lying):
            key = (pos, tuple(y.shape))
            if self.kind == "replay" and key not in self._seen:
                self._seen[key], lie = y.clone(), False  # nothing to replay yet: remember this one
            if lie:
                altered = self._alter(y, pos, key)
                if self.kind in ("bf16", "skip") or not torch.equal(altered, y):  # those two lied in the run
                    self.cheated.add(n)
                y = altered
            out.append(y)
        return out

    def forward_steps(self, rows: list, tile: int = 1, logits_rows=None, span=None):
        """The pausable form: the same lies, computed in one go (it never pauses)."""
        return self._steps(rows, tile, logits_rows, span)

    def _steps(self, rows, tile, logits_rows, span):
        yield from ()  # a generator, as LayerBlock.forward_steps returns, with no pause
        return self.forward_batch(rows, tile, logits_rows, span)

    def _altered_run(self, rows, tile, logits_rows, span) -> list:
        if self.kind == "bf16":
            rows = [(c, p, x if x.dtype == torch.long else x.to(torch.bfloat16).to(x.dtype)) for c, p, x in rows]
            return self._honest(rows, tile=tile, logits_rows=logits_rows, span=span)
        layer = self.block.layers[self.layer]
        layer.forward = lambda h, *a, **k: h  # the skipped layer: its input is its output
        try:
            return self._honest(rows, tile=tile, logits_rows=logits_rows, span=span)
        finally:
            del layer.forward

    def _alter(self, y: torch.Tensor, pos: int, key: tuple) -> torch.Tensor:
        if self.kind in ("garbage", "intermittent"):
            return torch.randn(y.shape, generator=self._gen, dtype=torch.float64).to(y.dtype) * 3
        if self.kind == "bf16":
            return y.to(torch.bfloat16).to(y.dtype)
        if self.kind == "replay":
            return self._seen.get(key, y)
        if self.kind == "ulp":
            i = self.position - pos
            if 0 <= i < y.shape[1]:
                y = y.clone()
                y[0, i, 0] = torch.nextafter(y[0, i, 0], torch.tensor(float("inf"), dtype=y.dtype))
            return y
        return y


def cheat(block, kind: str, **kw) -> Cheat:
    """Make ``block`` cheat: its ``forward_batch`` and ``forward_steps`` become a :class:`Cheat`'s (returned)."""
    double = Cheat(block, kind, **kw)
    block.forward_batch, block.forward_steps = double.forward_batch, double.forward_steps
    return double

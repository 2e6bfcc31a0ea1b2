"""Speculative decoding around the ring: chunk scheduling and the greedy accept rule. Pure.

Owns: ``SpecLoop``: which chunks to send (up to ``depth`` verify chunks in flight, each drafted as if the previous
one fully accepts) and the tail's ids turned into committed tokens (the longest matching prefix plus one; a
rejection bumps the epoch). Standard library only; the drafter is injected. Sources: docs/architecture.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from swarm.errors import ConfigError, ProtocolError


class Drafter(Protocol):
    """Proposes draft tokens. ``propose(context, n)`` returns up to ``n`` ids that continue
    ``context`` (prompt + committed + earlier drafts); it may return fewer, or none."""

    name: str

    def propose(self, context: Sequence[int], n: int) -> list[int]: ...


class NoDrafter:
    """Plain decoding: never proposes anything (one token per round trip)."""

    name = "none"

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        return []


def rotary_switch(config: dict) -> int | None:
    """LongRoPE's switch of a model's ``config.json`` (as a dict): ``original_max_position_embeddings``
    where the rotary is LongRoPE (``rope_parameters`` or the older ``rope_scaling``, type ``longrope``
    or its first name ``su``), else None."""
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if isinstance(params, dict) and (params.get("rope_type") or params.get("type")) in ("longrope", "su"):
            switch = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
            return int(switch) if switch else None
    return None


@dataclass(frozen=True)
class Chunk:
    """One verify (or prefill) chunk: ``tokens`` fed at positions ``[pos, pos + len(tokens))``.

    ``logits_from``: the tail computes the LM head and returns a token only for the rows at
    ``[logits_from, pos + len(tokens))``: every row of a verify chunk, the last prompt (or replay)
    position of a prefill chunk, none (``pos + len(tokens)``) of an earlier prefill chunk.
    """

    epoch: int
    chunk_id: int
    pos: int
    tokens: tuple[int, ...]
    logits_from: int | None = None  # None: pos (every row)

    @property
    def first_result(self) -> int:
        """Absolute position of the first row the tail answers for."""
        return self.pos if self.logits_from is None else self.logits_from


@dataclass
class SpecStats:
    """Counters of one generation.

    ``rounds`` counts decode chunks whose result committed tokens (one ring round trip each);
    ``tokens_per_round_trip`` is decode-committed tokens per such round; ``accept_rate`` is
    accepted / drafted over drafts that got a verdict.
    """

    chunks_sent: int = 0
    prefill_chunks: int = 0
    stale_results: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    decode_committed: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["accept_rate"] = round(self.accepted / self.drafted, 4) if self.drafted else 0.0
        d["tokens_per_round_trip"] = round(self.decode_committed / self.rounds, 4) if self.rounds else 0.0
        d["mean_accepted_per_round"] = round(self.accepted / self.rounds, 4) if self.rounds else 0.0
        return d


@dataclass
class SpecLoop:
    """The state machine of one speculative generation (greedy).

    Args:
        prompt_ids: the prompt (non-empty).
        max_new_tokens: stop after this many new tokens (already capped by the context).
        stop_ids: stop after committing one of these (it is part of the output).
        drafter: proposes drafts (NoDrafter for plain decoding).
        k: draft tokens per chunk (0 = plain decoding); chunks carry up to k + 1 tokens.
        depth: decode chunks in flight at once (>= 1).
        prefill_chunk: positions per prefill chunk.
        prefill_depth: prefill chunks in flight at once.
        rotary_switch: LongRoPE's ``original_max_position_embeddings`` (:func:`rotary_switch`), or None.
            A sequence longer than it takes the long factors at every position, so the stages'
            rows of a shorter one no longer fit: the first chunk that carries the session past it is
            sent from position 0 (a prompt past it: the first prefill chunk reaches past it), as
            transformers' generate drops its KV cache there and recomputes the whole sequence. A
            verify chunk never straddles the switch (rows before it are answered with the short
            factors, as greedy decoding answers them), and a chunk sent from 0 that is cancelled
            (a rejection before it) leaves the stages unsure, so the next chunk starts at 0 too.
    Use: send every chunk of ``next_chunks()``; feed each result to ``on_result``; stop when
    ``done``. ``output`` holds the committed new tokens.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    stop_ids: frozenset = frozenset()
    drafter: Drafter = field(default_factory=NoDrafter)
    k: int = 0
    depth: int = 1
    prefill_chunk: int = 128
    prefill_depth: int = 4
    rotary_switch: int | None = None
    epoch: int = 0
    done: bool = False
    stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ConfigError("the prompt is empty")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.k < 0 or self.depth < 1 or self.prefill_chunk < 1 or self.prefill_depth < 1:
            raise ConfigError(f"bad speculation settings: k={self.k} depth={self.depth} "
                              f"prefill_chunk={self.prefill_chunk}")
        self.prompt_len = len(self.prompt_ids)
        self.seq: list[int] = list(self.prompt_ids)
        self.committed_len = self.prompt_len  # seq[:committed_len] is final
        self.sent_len = 0  # positions [0, sent_len) are fed by chunks done or in flight
        self.inflight: deque[Chunk] = deque()
        self._next_id = 0
        self.prefill_end = self.prompt_len  # positions [0, prefill_end) go round as prefill chunks
        self.replay_token: int | None = None  # after restart(): the ring's token at the driver position
        # the last output token is never fed: positions to feed end at prompt + max_new - 1
        self.feed_end = self.prompt_len + self.max_new_tokens - 1
        # LongRoPE: the factor set the stages' rows hold once the chunks sent so far are computed:
        # "short", "long", or None (unknown: a chunk from position 0 that was cancelled)
        self.rotary = "short"
        self._long_chunk: int | None = None  # id of the chunk that took the session past the switch

    @property
    def output(self) -> list[int]:
        return self.seq[self.prompt_len:self.committed_len]

    def next_chunks(self) -> list[Chunk]:
        """Chunks to send now, in order (possibly none while waiting for results)."""
        out: list[Chunk] = []
        while not self.done:
            start = self.sent_len
            if start < self.prefill_end:
                if len(self.inflight) >= self.prefill_depth:
                    break
                end = min(self.prefill_end, start + self.prefill_chunk)
            else:
                if len(self.inflight) >= self.depth:
                    break
                limit = min(self.feed_end, start + self.k + 1)
                if start >= limit:
                    break
                if len(self.seq) < limit:  # draft on top of everything speculated so far
                    drafts = self.drafter.propose(self.seq, limit - len(self.seq))
                    self.seq.extend(int(t) for t in drafts[: limit - len(self.seq)])
                end = min(limit, len(self.seq))
                if end <= start:
                    break
            # a prefill row's token is known already, except after the prompt's (or replay's) last row
            logits_from = None if start >= self.prefill_end else (end - 1 if end == self.prefill_end else end)
            send_from, end = self._rotary_chunk(start, end)
            if end <= start:
                break
            if start < self.prefill_end:
                logits_from = end - 1 if end == self.prefill_end else end
            if send_from < start:
                logits_from = start if logits_from is None else logits_from
            chunk = Chunk(self.epoch, self._next_id, send_from, tuple(self.seq[send_from:end]), logits_from)
            if self.rotary_switch is not None and send_from == 0:
                self.rotary, self._long_chunk = ("long", chunk.chunk_id) if end > self.rotary_switch else ("short", None)
            self._next_id += 1
            self.sent_len = end
            self.inflight.append(chunk)
            self.stats.chunks_sent += 1
            self.stats.prefill_chunks += start < self.prefill_end
            out.append(chunk)
        return out

    @property
    def rotary_long(self) -> bool:
        """LongRoPE: whether the session went past the switch (its stages' rows hold the long factors)."""
        return self.rotary == "long"

    def _rotary_chunk(self, start: int, end: int) -> tuple[int, int]:
        """Where the chunk of rows ``[start, end)`` is sent from, and where it ends, under LongRoPE.

        Returns:
            ``(send_from, end)``: ``send_from`` 0 where the stages' rows must be recomputed (the
            chunk's factor set differs from theirs, or is unknown), else ``start``; ``end`` cut back to
            the switch where rows before it still want answers with the short factors (the result of
            a prefill row before the prompt's last is never read, so a prefill is not cut).
        """
        switch = self.rotary_switch
        if switch is None:
            return start, end
        if self.rotary == "long":
            return start, end
        first_answer = max(start, self.prefill_end - 1)  # the first row whose result is read
        if start < self.prefill_end and self.prefill_end > switch:  # a prompt (or replay) past the switch
            return 0, max(end, min(self.prefill_end, switch + 1))
        if end > switch and first_answer < switch:
            end = switch  # answer the short rows first
        if end > switch or self.rotary is None:
            return 0, end
        return start, end

    def on_result(self, chunk_id: int, epoch: int, argmax_ids: Sequence[int]) -> list[int]:
        """Apply the tail's argmax ids for one chunk; return the newly committed tokens.

        Results of an older epoch are ignored (stale speculation). On a rejection the epoch is
        bumped, in-flight chunks are forgotten, and the next chunk restarts at the correction.

        Raises:
            ProtocolError: a current-epoch result for a chunk that is not the oldest in flight,
                or with the wrong number of ids.
        """
        if epoch != self.epoch or self.done:
            self.stats.stale_results += 1
            return []
        if not self.inflight or self.inflight[0].chunk_id != chunk_id:
            raise ProtocolError(f"result for chunk {chunk_id} arrived out of order")
        chunk = self.inflight.popleft()
        first = chunk.first_result
        if len(argmax_ids) != chunk.pos + len(chunk.tokens) - first:
            raise ProtocolError(f"chunk {chunk_id} asked for {chunk.pos + len(chunk.tokens) - first} ids of "
                                f"{len(chunk.tokens)} rows and got {len(argmax_ids)}")
        new: list[int] = []
        for i, q in enumerate(range(first, chunk.pos + len(chunk.tokens))):
            if q + 1 < self.committed_len:
                if q + 1 == self.committed_len - 1 and q + 1 >= self.prompt_len:
                    self.replay_token = int(argmax_ids[i])  # a replay reached the driver position
                continue  # prefill or replay: the next token is already known
            pred = int(argmax_ids[i])
            rejected = False
            if q + 1 < len(self.seq):  # a draft sits at q + 1: verify it
                self.stats.drafted += 1
                if self.seq[q + 1] == pred:
                    self.stats.accepted += 1
                else:
                    rejected = True
                    del self.seq[q + 1:]
                    self.seq.append(pred)
            else:  # the frontier: a bonus token
                self.seq.append(pred)
            self.committed_len = q + 2
            new.append(pred)
            if pred in self.stop_ids or self.committed_len - self.prompt_len >= self.max_new_tokens:
                self.done = True
                del self.seq[self.committed_len:]
                break
            if rejected:
                self.stats.rejections += 1
                self.epoch += 1
                if self._long_chunk is not None and any(c.chunk_id == self._long_chunk for c in self.inflight):
                    self.rotary, self._long_chunk = None, None  # a stage may or may not have computed it
                self.inflight.clear()
                self.sent_len = q + 1  # the correction is fed next, rolling every stage's KV back
                break
        if new and chunk.pos >= self.prompt_len:
            self.stats.rounds += 1
            self.stats.decode_committed += len(new)
        return new

    def skip_prefix(self, reused: int) -> int:
        """Start the prefill at position ``reused``: every stage already holds the KV of positions
        ``[0, reused)`` (its prefix cache, issue 17), so those rows are not sent. Only before the first
        chunk, and never the prompt's last position (its row gives the first new token). A prompt past
        LongRoPE's switch reuses nothing: a prefix cache's rows hold the short factors.

        Returns:
            The positions skipped: ``reused``, or 0 for a prompt past the switch.

        Raises:
            ConfigError: chunks were sent already, or ``reused`` is not in ``[0, prompt_len)``.
        """
        if self._next_id or self.sent_len:
            raise ConfigError("internal: a prefix can only be skipped before the first chunk")
        if not 0 <= reused < self.prompt_len:
            raise ConfigError(f"internal: cannot reuse {reused} positions of a {self.prompt_len}-token prompt")
        if self.rotary_switch is not None and self.prompt_len > self.rotary_switch:
            reused = 0
        self.sent_len = reused
        return reused

    def restart(self) -> None:
        """Start over on a fresh session (after a heal): forget speculation and in-flight chunks,
        bump the epoch, and re-feed prompt + committed output except the last committed token
        (the driver) as prefill chunks. The result at the driver's position lands in
        ``replay_token``; the driver itself is then fed as the next decode chunk, as usual.
        """
        self.epoch += 1
        self.inflight.clear()
        del self.seq[self.committed_len:]
        self.sent_len = 0
        self.prefill_end = max(self.prompt_len, self.committed_len - 1)
        self.replay_token = None
        self.rotary, self._long_chunk = "short", None  # a fresh session: nothing held yet

    def resume(self) -> int:
        """Go on over the same session after a heal that kept the survivors' KV caches: forget
        speculation and in-flight chunks, bump the epoch, and re-feed only the last position of
        prompt + committed output except the driver, as a one-row chunk whose result lands in
        ``replay_token`` (it must reproduce the driver). Every earlier position is already in every
        stage's KV cache (the replacement's was refilled); that chunk rolls the others back to it.

        Returns:
            The number of positions kept (the chunk's position). Raises ConfigError when nothing was
            committed yet (there is no driver to check: replay the prompt instead).
        """
        if self.committed_len - 1 < self.prompt_len:
            raise ConfigError("internal: resume() needs a committed token (a driver to check)")
        self.epoch += 1
        self.inflight.clear()
        del self.seq[self.committed_len:]
        self.prefill_end = self.committed_len - 1
        self.sent_len = self.prefill_end - 1
        self.replay_token = None
        return self.sent_len

    @property
    def sent_chunk(self) -> int:
        """Highest chunk id handed out so far (-1: none)."""
        return self._next_id - 1

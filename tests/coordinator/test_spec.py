"""SpecLoop (pure): speculative greedy == plain greedy on a toy target, for every K, depth, drafter."""

from __future__ import annotations

import random

import pytest

from swarm.coordinator.drafters import NgramDrafter
from swarm.errors import ConfigError, ProtocolError
from swarm.coordinator.spec import NoDrafter, SpecLoop

V = 13


def toy_next(seq: list[int]) -> int:
    """A deterministic 'target model': next token from the last three tokens (repeats often)."""
    a, b, c = ([0, 0] + list(seq))[-3:]
    return (c * 3 + b * 5 + a) % V


def plain_greedy(prompt, n, stop=frozenset()):
    seq, out = list(prompt), []
    while len(out) < n:
        t = toy_next(seq)
        out.append(t)
        seq.append(t)
        if t in stop:
            break
    return out


class ScriptedDrafter:
    """Proposes from a fixed oracle with a given error pattern: right, wrong, or mixed."""

    name = "scripted"

    def __init__(self, mode: str, seed: int = 0):
        self.mode, self.rng = mode, random.Random(seed)

    def propose(self, context, n):
        seq, out = list(context), []
        for _ in range(n):
            t = toy_next(seq)
            if self.mode == "wrong" or (self.mode == "mixed" and self.rng.random() < 0.3):
                t = (t + 1) % V
            out.append(t)
            seq.append(t)
        return out


def run_loop(loop: SpecLoop, shuffle_stale: bool = False) -> list[int]:
    """Drive a SpecLoop against the toy target as a ring would: FIFO results, stale ones included."""
    inflight = []
    kv: list[int] = []  # tokens the 'ring' has absorbed at each position (to check rollback use)
    steps = 0
    while not loop.done:
        inflight.extend(loop.next_chunks())
        assert inflight, "the loop stalled with nothing in flight"
        chunk = inflight.pop(0)
        del kv[chunk.pos:]  # the stage rolls back to pos
        assert len(kv) == chunk.pos, "chunk positions must be contiguous with kv_len"
        kv.extend(chunk.tokens)
        ids = [toy_next(kv[: q + 1]) for q in range(chunk.first_result, chunk.pos + len(chunk.tokens))]
        loop.on_result(chunk.chunk_id, chunk.epoch, ids)
        if chunk.epoch != loop.epoch:
            inflight = [c for c in inflight if c.epoch == loop.epoch]  # stages drop stale frames
        steps += 1
        assert steps < 10_000
    return loop.output


PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


@pytest.mark.parametrize("k", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("mode", ["right", "wrong", "mixed", "ngram", "none"])
def test_speculative_equals_plain_greedy(k, depth, mode):
    drafter = {"ngram": NgramDrafter(), "none": NoDrafter()}.get(mode) or ScriptedDrafter(mode)
    loop = SpecLoop(PROMPT, 40, drafter=drafter, k=k, depth=depth, prefill_chunk=3)
    assert run_loop(loop) == plain_greedy(PROMPT, 40)


@pytest.mark.parametrize("k,depth", [(4, 1), (4, 3), (8, 2)])
def test_eos_inside_a_chunk_stops_there(k, depth):
    ref = plain_greedy(PROMPT, 40)
    stop = frozenset({ref[6]})
    expected = plain_greedy(PROMPT, 40, stop)
    loop = SpecLoop(PROMPT, 40, stop_ids=stop, drafter=ScriptedDrafter("right"), k=k, depth=depth)
    assert run_loop(loop) == expected and expected[-1] in stop


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9])
def test_limit_inside_a_chunk(n):
    loop = SpecLoop(PROMPT, n, drafter=ScriptedDrafter("right"), k=8, depth=2)
    assert run_loop(loop) == plain_greedy(PROMPT, n)
    # no chunk feeds a position whose output is never needed
    assert loop.sent_len <= len(PROMPT) + n - 1 or n == 1


def test_fully_accepted_chunks_commit_k_plus_one_per_round():
    loop = SpecLoop(PROMPT, 41, drafter=ScriptedDrafter("right"), k=4, depth=1)
    run_loop(loop)
    s = loop.stats
    assert s.rejections == 0 and s.as_dict()["accept_rate"] == 1.0
    assert s.as_dict()["tokens_per_round_trip"] == 5.0


def test_fully_rejected_chunks_commit_one_per_round():
    loop = SpecLoop(PROMPT, 20, drafter=ScriptedDrafter("wrong"), k=4, depth=3)
    assert run_loop(loop) == plain_greedy(PROMPT, 20)
    d = loop.stats.as_dict()
    assert d["accepted"] == 0 and d["tokens_per_round_trip"] == 1.0 and d["rejections"] >= 18


def test_depth_keeps_chunks_in_flight():
    loop = SpecLoop(PROMPT, 30, drafter=ScriptedDrafter("right"), k=2, depth=4, prefill_chunk=100)
    first = loop.next_chunks()
    # the prefill, and already the first decode chunks, drafted as if everything before accepts
    assert first[0].tokens == tuple(PROMPT) and [c.pos for c in first] == [0, 10, 13, 16]
    assert all(len(c.tokens) == 3 for c in first[1:])
    assert first[0].first_result == len(PROMPT) - 1  # a prefill chunk asks for its last row's token only
    assert all(c.first_result == c.pos for c in first[1:])  # a verify chunk for every row's
    loop.on_result(first[0].chunk_id, 0, [toy_next(PROMPT)])
    assert [c.pos for c in loop.next_chunks()] == [19]


def test_stale_results_are_ignored_and_out_of_order_refused():
    loop = SpecLoop(PROMPT, 10, drafter=ScriptedDrafter("wrong"), k=2, depth=3, prefill_chunk=100)
    pre, a, b = loop.next_chunks()
    with pytest.raises(ProtocolError, match="asked for 1 ids of 10 rows and got 10"):
        loop.on_result(pre.chunk_id, 0, [a.tokens[0]] * len(PROMPT))
    loop.inflight.appendleft(pre)
    loop.on_result(pre.chunk_id, 0, [a.tokens[0]])  # the drafted first token is right
    with pytest.raises(ProtocolError, match="out of order"):
        loop.on_result(b.chunk_id, b.epoch, [0] * len(b.tokens))
    loop.on_result(a.chunk_id, a.epoch, [(t + 5) % V for t in a.tokens])  # first draft rejected
    assert loop.epoch == 1
    assert loop.on_result(b.chunk_id, b.epoch, [0] * len(b.tokens)) == []
    assert loop.stats.stale_results == 1


def test_bad_settings():
    with pytest.raises(ConfigError):
        SpecLoop([], 5)
    with pytest.raises(ConfigError):
        SpecLoop([1], 0)
    with pytest.raises(ConfigError):
        SpecLoop([1], 5, depth=0)


@pytest.mark.parametrize("context,n,expected", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),   # trigram match
    ([5, 6, 7, 8, 6, 7], 2, [8, 6]),         # bigram
    ([4, 1, 2, 3, 1], 4, [2, 3, 1]),         # unigram, continuation shorter than n
    ([1, 2, 3, 4], 3, []),                   # nothing recurs
    ([7], 2, []),
])
def test_ngram_drafter(context, n, expected):
    assert NgramDrafter().propose(context, n) == expected


@pytest.mark.parametrize("fail_after", [0, 1, 3, 7])
@pytest.mark.parametrize("k,depth", [(0, 1), (4, 1), (4, 3)])
def test_restart_mid_generation_equals_uninterrupted(fail_after, k, depth):
    """Drop everything in flight after some results, restart (a heal), and finish: same output,
    and the replay reproduces the driver token."""
    loop = SpecLoop(PROMPT, 30, drafter=ScriptedDrafter("mixed"), k=k, depth=depth, prefill_chunk=4)
    inflight, kv, results = [], [], 0
    restarted = False
    while not loop.done:
        inflight.extend(loop.next_chunks())
        chunk = inflight.pop(0)
        del kv[chunk.pos:]
        kv.extend(chunk.tokens)
        ids = [toy_next(kv[: q + 1]) for q in range(chunk.first_result, chunk.pos + len(chunk.tokens))]
        loop.on_result(chunk.chunk_id, chunk.epoch, ids)
        inflight = [c for c in inflight if c.epoch == loop.epoch]
        results += 1
        if results == fail_after + 1 and not restarted:
            committed = list(loop.output)
            loop.restart()
            restarted, inflight, kv = True, [], []  # the new ring has empty caches
            driver_pos = len(PROMPT) + len(committed) - 1
    assert loop.output == plain_greedy(PROMPT, 30)
    if committed:
        assert loop.replay_token == loop.seq[driver_pos]


# LongRoPE (issue 45 item 11): the first chunk past the switch goes from position 0


def _shapes(loop: SpecLoop, answers) -> list[tuple[int, int, int]]:
    """(pos, rows, first_result) of every chunk sent, each answered by ``answers(q)`` for row q, in order."""
    shapes = []
    while not loop.done:
        for c in loop.next_chunks():
            shapes.append((c.pos, len(c.tokens), c.first_result))
        c = loop.inflight[0]
        loop.on_result(c.chunk_id, c.epoch, [answers(q) for q in range(c.first_result, c.pos + len(c.tokens))])
    return shapes


def test_a_generation_crossing_the_rotary_switch_recomputes_from_position_0():
    loop = SpecLoop(list(range(1, 10)), 10, prefill_chunk=4, rotary_switch=16)
    shapes = _shapes(loop, lambda q: 50 + q)
    # prefill, decode rows up to 15 with the short factors, then [0, 17) answering row 16 only
    assert shapes == [(0, 4, 4), (4, 4, 8), (8, 1, 8), *[(q, 1, q) for q in range(9, 16)], (0, 17, 16),
                      (17, 1, 17)]
    assert loop.rotary_long and loop.output == [50 + q for q in range(8, 18)]


def test_a_prompt_past_the_rotary_switch_goes_long_in_its_first_chunk_and_reuses_no_prefix():
    loop = SpecLoop(list(range(1, 22)), 2, prefill_chunk=4, rotary_switch=16)
    assert loop.skip_prefix(8) == 0  # cached rows hold the short factors
    assert _shapes(loop, lambda q: 7) == [(0, 17, 17), (17, 4, 20), (21, 1, 21)]
    short = SpecLoop(list(range(1, 12)), 2, prefill_chunk=4, rotary_switch=16)
    assert short.skip_prefix(8) == 8 and not short.rotary_long


def test_verify_chunks_never_straddle_the_rotary_switch():
    """Rows before the switch are answered with the short factors (as greedy decoding answers them),
    so a verify chunk is cut at the switch; the next one goes from 0 with its drafts."""
    full = list(range(1, 40))
    loop = SpecLoop(full[:12], 8, drafter=_Script(full), k=3, depth=1, prefill_chunk=16, rotary_switch=16)
    shapes = _shapes(loop, lambda q: full[q + 1])
    # rows 12-15 (driver + 3 drafts) end at the switch; then row 16 and its drafts up to the budget, from 0
    assert shapes == [(0, 12, 11), (12, 4, 12), (0, 19, 16)] and loop.output == full[12:20]


def test_a_cancelled_chunk_from_position_0_makes_the_next_one_start_there_too():
    """A rejection before the chunk that took the session past the switch cancels it: a stage may or
    may not have computed it, so the next chunk recomputes from 0 (short again here)."""
    full = list(range(1, 40))
    wrong = {14}  # the draft at position 14 is wrong: the chunk holding it is rejected there
    drafter = _Script([t if q not in wrong else 99 for q, t in enumerate(full)])
    loop = SpecLoop(full[:12], 8, drafter=drafter, k=3, depth=2, prefill_chunk=16, rotary_switch=16)
    shapes = _shapes(loop, lambda q: full[q + 1])
    # depth 2: the long chunk flies behind the one rejected at row 13; then row 14 on, from 0, short, up
    # to the switch, and the crossing again
    assert shapes == [(0, 12, 11), (12, 4, 12), (0, 19, 16), (0, 16, 14), (0, 19, 16)]
    assert loop.output == full[12:20] and loop.rotary_long


class _Script:
    name = "script"

    def __init__(self, full):
        self.full = full

    def propose(self, context, n):
        return self.full[len(context):len(context) + n]

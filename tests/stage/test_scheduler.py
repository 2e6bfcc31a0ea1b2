"""swarm.stage.scheduler, pure: which chunks one step computes (pick_rows) and its whole plan
(plan_step), whether a long prompt's slice is the small shared one (long_chunk_shares) and the checks
of a chunk before it is queued (chunk_input), as plain tables of cases. The step itself runs in
tests/stage/test_batching.py."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from swarm.config import SchedulingSection
from swarm.errors import ProtocolError
from swarm.frames import Forward, Receipt, Refill
from swarm.ranges import LayerRange
from swarm.stage.scheduler import (ACTIVE_S, BATCH_CHUNK_MAX, DUE_GAPS, DUE_MIN_S, DUE_SLACK_S, FIRST_GAP_S,
                                   MAX_QUEUED, SHADOW_QUEUE_FACTOR, Costs, Slice, StepPlan, StepRows, chunk_input,
                                   decoder_due, greedy_ids, long_chunk_shares, overtakes, pick_rows, plan_step,
                                   prompt_ends, ride_rows, stale_needed)
from swarm.stage.session import Job

S = BATCH_CHUNK_MAX  # the longest chunk that is a decode/verify row


@pytest.mark.parametrize("chunks, max_batch_rows, picked", [
    ([], 64, StepRows((), None)),
    ([(1, 0), (3, 0), (2, 0)], 64, StepRows((0, 1, 2), None)),  # short chunks share the step in queue order
    ([(10, 0), (10, 0), (5, 0)], 16, StepRows((0, 2), None)),  # the second would pass the rows: skipped
    ([(10, 0), (6, 0), (1, 0)], 16, StepRows((0, 1), None)),  # exactly max_batch_rows
    ([(S, 0), (1, 0)], 1, StepRows((0,), None)),  # the first short chunk always goes, even past the rows
    ([(S, 0)], 64, StepRows((0,), None)),  # BATCH_CHUNK_MAX positions: still short
    ([(S + 1, 0)], 64, StepRows((), 0)),  # one more: long, a slice per step
    ([(100, 0), (50, 0), (100, 90)], 64, StepRows((), 2)),  # the long chunk with the least left goes
    ([(40, 0), (40, 0)], 64, StepRows((), 0)),  # a tie: the first in the queue (round robin)
    ([(40, 10), (30, 0)], 64, StepRows((), 0)),  # 30 left vs 30 left: the first still
    ([(40, 11), (30, 0)], 64, StepRows((), 0)),  # 29 left vs 30
    ([(40, 9), (30, 0)], 64, StepRows((), 1)),  # 31 left vs 30
    ([(1, 0), (100, 0), (2, 0), (50, 0)], 64, StepRows((0, 2), 3)),  # short rows and one long slice together
])
def test_pick_rows(chunks, max_batch_rows, picked):
    assert pick_rows(chunks, max_batch_rows) == picked


NOW = 100.0


@pytest.mark.parametrize("short_picked, others, shared", [
    (True, [], True),  # short rows in this very step
    (False, [], False),  # alone: full slices
    (False, [(NOW - 0.5, 1)], True),  # another session decoded just now
    (False, [(NOW - 0.5, S)], True),  # ... or verified a draft
    (False, [(NOW - 0.5, S + 1)], False),  # another prompt does not throttle it
    (False, [(NOW - ACTIVE_S, 1)], False),  # idle for ACTIVE_S: no longer generating
    (False, [(NOW - 10, 1), (NOW - 10, 2), (NOW - 0.1, 3)], True),
])
def test_long_chunk_shares(short_picked, others, shared):
    assert long_chunk_shares(short_picked, others, NOW) is shared


@pytest.mark.parametrize("others, due", [
    ([], None),  # nobody else: the slice goes now
    ([(0.0, 0.0)], None),  # a session that has not decoded yet (a prompt)
    ([(NOW - 0.05, 0.2)], NOW - 0.05 + DUE_GAPS * 0.2 + DUE_SLACK_S),  # its next row is due: wait for it
    ([(NOW - 0.05, 0.03)], NOW - 0.05 + DUE_MIN_S + DUE_SLACK_S),  # a short gap: still due for DUE_MIN_S
    ([(NOW - 0.5, 0.1)], None),  # five gaps late (and past DUE_MIN_S): it went quiet, the slice goes
    ([(NOW - 0.1, 0.0)], NOW - 0.1 + DUE_GAPS * FIRST_GAP_S + DUE_SLACK_S),  # one row so far: the first gap
    ([(NOW - 1.0, 60.0)], NOW - 1.0 + DUE_GAPS * ACTIVE_S + DUE_SLACK_S),  # a gap past ACTIVE_S counts as ACTIVE_S
    ([(NOW - 0.01, 0.2), (NOW - 0.2, 0.3)], NOW - 0.2 + DUE_GAPS * 0.3 + DUE_SLACK_S),  # the latest due of all
])
def test_decoder_due(others, due):
    got = decoder_due(others, NOW)
    assert got == (None if due is None else pytest.approx(due))


def _ride(**kw):
    return ride_rows(**{**dict(row_s=0.004, short_step_s=0.008, shared_rows=2, starving=False), **kw})


def test_ride_rows_fit_the_budget_of_half_a_decode_step():
    assert _ride() == 1  # half a decode step (8 ms) buys one 4 ms row
    assert _ride(row_s=0.001) == 2  # cheap rows: up to --prefill-slice-shared
    assert _ride(row_s=0.02) == 0  # a late, costly row would slow the decode step 3x
    assert _ride(row_s=0.02, starving=True) == 1  # ... unless the prompt starves
    assert _ride(row_s=None) == 2 and _ride(short_step_s=None) == 2  # not measured yet


@pytest.mark.parametrize("rows, left, pauses", [
    (1, 128, True), (S, 2, True),  # a decode/verify chunk pauses any slice
    (31, 128, True),  # a short prompt overtakes a long chunk with more left
    (S + 1, S + 1, False), (200, 128, False),  # ... not one with as many or fewer left
])
def test_overtakes(rows, left, pauses):
    assert overtakes(rows, left) is pauses


@pytest.mark.parametrize("msg, rows, ends", [
    (Forward("s", 0, 0, 1, logits_from=99), 100, True),  # the prompt's last chunk: decoding follows
    (Forward("s", 0, 0, 1), 100, True),  # every row's token wanted
    (Forward("s", 0, 0, 1, logits_from=100), 100, False),  # a chunk in the middle of a prompt
    (Refill("s", 0, 0, 30), 100, False),  # a heal's refill: no token from it
    (Forward("s", 0, 5, 1, logits_from=5), S, False),  # a verify chunk is short: not a prompt
])
def test_prompt_ends(msg, rows, ends):
    assert prompt_ends(msg, rows) is ends


def _jobs(*chunks):
    """Queued jobs from (epoch, pos) pairs; None: a receipt request."""
    return [Job(Receipt("s")) if c is None else Job(Refill("s", epoch=c[0], pos=c[1], until=30), x=1)
            for c in chunks]


@pytest.mark.parametrize("queue, epoch, kv_len, needed", [
    # a ring stage after a cancel or a rejected draft: the new epoch's chunk starts within the cache
    (_jobs((0, 15), (1, 13)), 1, 15, False),
    (_jobs((0, 15), (0, 18), (1, 15)), 1, 15, False),  # exactly at the cache's end: not needed either
    (_jobs((0, 15)), 1, 15, False),  # a cancel ran ahead of the new epoch's chunk: dropped
    # a lagging shadow: its stage computed [15, 18) before the draft after it was rejected at 16
    (_jobs((0, 15), (1, 16)), 1, 15, True),
    (_jobs((0, 12), (0, 15), (1, 16)), 1, 12, True),  # two stale chunks, both needed in turn
    (_jobs((0, 15), None, (2, 18)), 2, 15, True),  # receipt requests in between are skipped over
    # a promoted shadow: the heal's epoch starts at 18, where the mirrored frames queued end
    (_jobs((3, 15), (4, 18)), 4, 15, True),
    (_jobs((3, 15), (4, 18)), 4, 18, False),
])
def test_stale_needed(queue, epoch, kv_len, needed):
    assert stale_needed(deque(queue), epoch, kv_len) is needed


def _sess(queued: int = 0, shadow: bool = False, span=LayerRange(0, 2)):
    return SimpleNamespace(span=span, heal=SimpleNamespace(shadow=shadow),
                           scheduling=SimpleNamespace(queue=deque([None] * queued)))


@pytest.mark.parametrize("msg, sess, reason", [
    (Refill("s", 0, 0, until=1), _sess(), "reached stage"),  # layers past its until
    (Forward("s", 0, 0, 1), _sess(MAX_QUEUED), f"more than {MAX_QUEUED} chunks"),
    (Forward("s", 0, 0, 1), _sess(MAX_QUEUED * SHADOW_QUEUE_FACTOR, shadow=True),
     f"more than {MAX_QUEUED * SHADOW_QUEUE_FACTOR} chunks"),  # a shadow may lag further, not forever
])
def test_chunk_input_refuses_before_decoding(msg, sess, reason):
    with pytest.raises(ProtocolError, match=reason):
        chunk_input(msg, sess, block=None)


def test_greedy_ids_pick_what_torch_argmax_picks():
    # ties (the first), NaN (counts as the largest: the first NaN), +-inf, rows all -inf, float64,
    # one row and a verify chunk's several, inference tensors
    import torch

    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        rows = 1 + trial % 5
        x = torch.randn(1, rows, 257, generator=g, dtype=torch.float64 if trial % 3 == 0 else torch.float32)
        if trial % 4 == 0:
            x[0, :, 7] = x[0, :, 200] = x.max() + 1  # a tie
        if trial % 6 == 0:
            x[0, 0, 90] = x[0, 0, 30] = float("nan")
        if trial % 9 == 0:
            x[0, -1] = float("-inf")
        if trial % 10 == 0:
            x[0, 0, 3] = x[0, 0, 250] = float("inf")
        with torch.inference_mode():
            got = greedy_ids(x * 1)
        want = x[0].argmax(dim=-1).tolist()
        assert got == want and all(type(i) is int for i in got), (trial, got, want)
    assert greedy_ids(torch.tensor([[[0.0, 2.0, 1.0]]], dtype=torch.bfloat16)) == [1]  # other dtypes: torch's


# plan_step: sessions by what planning reads of them; a chunk by its positions and what is done
def _planned(name: str, last_short: float = 0.0, gap: float = 0.0, active: float = 0.0, rows: int = 1):
    return SimpleNamespace(name=name, scheduling=SimpleNamespace(last_short=last_short, short_gap=gap,
                                                                 last_active=active, last_rows=rows))


def _chunk(positions: int, done: int = 0):
    return SimpleNamespace(x=SimpleNamespace(shape=(1, positions)), done=done)


DECODING = dict(last_short=NOW - 0.05, gap=0.1)  # its next row is due soon
ROW_DUE = decoder_due([(DECODING["last_short"], DECODING["gap"])], NOW)
ROW_S, SHORT_S = 0.004, 0.008  # measured: ride_rows then gives int(0.5 * 0.008 / 0.004) = 1 row


@pytest.mark.parametrize("chunks, others, piggyback, costs, expected", [
    ([], [], True, Costs(), ((), None, None)),  # nothing ready
    ([("a", 1), ("b", 4)], [], True, Costs(), (("a", "b"), None, None)),  # decode rows only
    ([("p", 300)], [], True, Costs(), ((), ("p", 128), None)),  # nobody decodes: a full --prefill-slice
    ([("p", 300)], [_planned("d", **DECODING)], True, Costs(), ((), None, ROW_DUE)),  # wait for the due row
    ([("p", 300), ("d", 1)], [_planned("d", **DECODING)], True, Costs(), (("d",), ("p", 2), None)),  # unmeasured
    ([("p", 300), ("d", 1)], [_planned("d", **DECODING)], True, Costs(SHORT_S, ROW_S, NOW), (("d",), ("p", 1), None)),
    ([("p", 300), ("d", 1)], [_planned("d", **DECODING)], True, Costs(SHORT_S, 1.0, NOW), (("d",), None, None)),
    ([("p", 300), ("d", 1)], [_planned("d", **DECODING)], True, Costs(SHORT_S, 1.0, NOW - 1.0),
     (("d",), ("p", 1), None)),  # too costly to ride along, but starving: one row goes
    ([("p", 300), ("d", 1)], [_planned("d")], False, Costs(), (("d",), ("p", 2), None)),  # shares: rows waiting
    ([("p", 300)], [_planned("d", active=NOW - 10.0)], False, Costs(), ((), ("p", 128), None)),  # idle others
    ([("p", 300)], [_planned("d", active=NOW - 0.5, rows=1)], False, Costs(), ((), ("p", 2), None)),  # generating
], ids=["empty", "short", "long-alone", "wait", "ride-unmeasured", "ride-measured", "ride-none", "ride-starving",
        "fixed-shared", "fixed-full", "fixed-beside-a-decoder"])
def test_plan_step(chunks, others, piggyback, costs, expected):
    sessions = {name: _planned(name) for name, _ in chunks}
    sessions.update({o.name: o for o in others})
    ready = [(sessions[name], _chunk(n)) for name, n in chunks]
    settings = SchedulingSection(prefill_slice=128, prefill_slice_shared=2, prefill_piggyback=piggyback)
    plan = plan_step(ready, list(sessions.values()), settings, costs, NOW)
    short, long, wait = expected
    assert tuple(s.name for s, _ in plan.short) == short
    assert (None if plan.long is None else (plan.long.session.name, plan.long.rows)) == long
    assert plan.wait_until == wait
    assert plan.empty == (not chunks)
    assert plan.alone == (long is not None and not short)


def test_a_plan_is_a_value():
    s, j = _planned("a"), _chunk(40)
    assert StepPlan((), Slice(s, j, 8)) == StepPlan((), Slice(s, j, 8))
    with pytest.raises(AttributeError):
        StepPlan().wait_until = 1.0  # type: ignore[misc]

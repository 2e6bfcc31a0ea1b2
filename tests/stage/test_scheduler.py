"""swarm.stage.scheduler, pure: which chunks one step computes (pick_rows), whether a long
prompt's slice is the small shared one (long_chunk_shares) and the checks of a chunk before it is
queued (chunk_input), as plain tables of cases. The step itself runs in tests/stage/test_batching.py."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from swarm.errors import ProtocolError
from swarm.ranges import LayerRange
from swarm.stage.scheduler import (ACTIVE_S, BATCH_CHUNK_MAX, DUE_GAPS, DUE_SLACK_S, FIRST_GAP_S, MAX_QUEUED,
                                   GAP_MARGIN_S, ROW_SAFETY, SHADOW_QUEUE_FACTOR, StepRows, chunk_input, decoder_due,
                                   long_chunk_shares, next_row_in, pick_rows, prefill_rows)

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
    ([(NOW - 0.05, 0.1)], NOW - 0.05 + DUE_GAPS * 0.1 + DUE_SLACK_S),  # its next row is due: wait for it
    ([(NOW - 0.5, 0.1)], None),  # five gaps late: it went quiet, the slice goes
    ([(NOW - 0.1, 0.0)], NOW - 0.1 + DUE_GAPS * FIRST_GAP_S + DUE_SLACK_S),  # one row so far: the first gap
    ([(NOW - 1.0, 60.0)], NOW - 1.0 + DUE_GAPS * ACTIVE_S + DUE_SLACK_S),  # a gap past ACTIVE_S counts as ACTIVE_S
    ([(NOW - 0.01, 0.1), (NOW - 0.2, 0.2)], NOW - 0.2 + DUE_GAPS * 0.2 + DUE_SLACK_S),  # the latest due of all
])
def test_decoder_due(others, due):
    got = decoder_due(others, NOW)
    assert got == (None if due is None else pytest.approx(due))


@pytest.mark.parametrize("others, expect", [
    ([], None),
    ([(NOW - 0.01, 0.03)], 0.02),  # its last row 10 ms ago, one every 30 ms: back in 20 ms
    ([(NOW - 0.05, 0.03)], 0.0),  # late, but still due (within two gaps and the slack)
    ([(NOW - 0.5, 0.03)], None),  # gone quiet: nobody is due
    ([(NOW - 0.01, 0.03), (NOW - 0.001, 0.005)], 0.004),  # the soonest of two
])
def test_next_row_in(others, expect):
    got = next_row_in(others, NOW)
    assert got == (None if expect is None else pytest.approx(expect))


def _rows(**kw):
    args = dict(with_rows=False, gap_s=0.0, row_s=0.004, short_step_s=0.008, shared_rows=2, full_rows=128,
                starving=False)
    return prefill_rows(**{**args, **kw})


def test_prefill_rows_ride_along_within_the_budget_and_fill_gaps_that_fit():
    assert _rows(with_rows=True) == 1  # half a decode step (8 ms) buys one 4 ms row
    assert _rows(with_rows=True, row_s=0.001) == 2  # cheap rows: up to --prefill-slice-shared
    assert _rows(with_rows=True, row_s=0.02) == 0  # a late, costly row would slow the decode step 3x
    assert _rows(with_rows=True, row_s=0.02, starving=True) == 1  # ... unless the prompt starves
    assert _rows(with_rows=True, row_s=None) == 2  # not measured yet
    gap = GAP_MARGIN_S + 0.008 + 3 * ROW_SAFETY * 0.004 + 1e-6
    assert _rows(gap_s=gap) == 3  # the weights' read and three rows end before the row is back
    assert _rows(gap_s=0.005) == 0  # nothing fits: wait for the row
    assert _rows(gap_s=10.0) == 128  # at most --prefill-slice
    assert _rows(row_s=None) == 1  # one row, to measure


def _sess(queued: int = 0, shadow: bool = False, span=LayerRange(0, 2)):
    return SimpleNamespace(span=span, shadow=shadow, queue=deque([None] * queued))


@pytest.mark.parametrize("msg, sess, reason", [
    ({"type": "refill", "until": 1, "pos": 0}, _sess(), "reached stage"),  # layers past its until
    ({"type": "forward", "pos": 0}, _sess(MAX_QUEUED), f"more than {MAX_QUEUED} chunks"),
    ({"type": "forward", "pos": 0}, _sess(MAX_QUEUED * SHADOW_QUEUE_FACTOR, shadow=True),
     f"more than {MAX_QUEUED * SHADOW_QUEUE_FACTOR} chunks"),  # a shadow may lag further, not forever
])
def test_chunk_input_refuses_before_decoding(msg, sess, reason):
    with pytest.raises(ProtocolError, match=reason):
        chunk_input(msg, sess, block=None)

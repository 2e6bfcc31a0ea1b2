"""``swarm.coordinator.generation``: the decode options object and the typed result (pure; no ring)."""

import dataclasses

import pytest

from swarm.config import SamplingParams, SpecConfig
from swarm.coordinator.generation import DecodeOptions, DecodeResult
from swarm.errors import ConfigError

# the keys (in order) of the record ``swarm coordinate --json`` prints after its own fields
RECORD_KEYS = ["tokens_per_s", "ttft_s", "cached_tokens", "total_s", "context_limited", "stopped", "sampling",
               "wire_dtype", "wire_lossy", "kernels_proven", "heal_events", "spec"]


def _result(**kw) -> DecodeResult:
    base = dict(output_ids=[5, 6], tokens_per_s=10.0, ttft_s=0.5, cached_tokens=0, total_s=1.0,
                context_limited=False, stopped=False, sampling={"temperature": 0.0}, wire_dtype="stage",
                wire_lossy=False, kernels_proven=True, heal_events=[], spec={"draft": "none", "k": 0})
    return DecodeResult(**{**base, **kw})


def test_options_default_to_plain_greedy_decoding_and_freeze_the_stop_ids():
    opts = DecodeOptions(8, stop_ids={2, 3})
    assert opts.spec == SpecConfig() and opts.sampling == SamplingParams() and opts.drafter is None
    assert opts.stop_ids == frozenset({2, 3}) and isinstance(opts.stop_ids, frozenset)
    assert opts.heal and not opts.shadow and not opts.prefix_cache and opts.job is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.max_new_tokens = 9


def test_options_refuse_a_negative_token_budget():
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 0, got -1"):
        DecodeOptions(-1)


def test_the_record_keeps_the_json_keys_and_their_order():
    assert list(_result().as_record()) == RECORD_KEYS
    parts = {"stage_receipts": [], "problems": []}
    rec = _result(receipt_parts=parts).as_record()
    assert list(rec) == RECORD_KEYS + ["receipt_parts"] and rec["receipt_parts"] is parts


def test_an_open_met_by_a_pause_is_closed_and_opened_again_under_a_fresh_id():
    """Issue 31's chaos soak: a stage SIGSTOPped during the open made it StageLost, the heal's re-check
    found every stage answering again (a pause: nothing replaced) and the request failed with a 503.
    Now the session is closed where it was opened and opened once more under a fresh id."""
    import trio

    from swarm.coordinator.generation import OPEN_ATTEMPTS, _open_session
    from swarm.errors import StageLost

    class Ring:
        def __init__(self, fails):
            self.fails, self.opened, self.closed = fails, [], []

        async def open_session(self, session, *args, **kwargs):
            self.opened.append(session)
            if len(self.opened) <= self.fails:
                raise StageLost("stage 0 stopped answering heartbeats (2.0 s) while opening the session")
            return 0  # positions reused from the prefix cache

        async def close_session(self, session, timeout_s=5.0):
            self.closed.append(session)

    class Loop:
        def skip_prefix(self, n):
            self.skipped = n
            return n

    async def never_replaced(exc):  # the heal's re-check: every stage answers, nothing replaced
        return False

    def run_open(fails):
        ring, state = Ring(fails), {"session": "s0", "max_len": 64, "sampling": None}
        trio.run(_open_session, ring, Loop(), state, [1, 2, 3], DecodeOptions(4), False, never_replaced)
        return ring, state

    ring, state = run_open(1)
    assert ring.opened[0] == "s0" and ring.closed == ["s0"] and state["session"] == ring.opened[1] != "s0"
    with pytest.raises(StageLost, match="while opening the session"):  # paused at every try: it says so
        run_open(OPEN_ATTEMPTS)

"""``swarm.coordinator.generation``: the decode options object and the typed result (pure; no ring)."""

import dataclasses

import pytest

from swarm.config import SamplingParams, SpecConfig
from swarm.coordinator.decoding import DecodeOptions, DecodeResult
from swarm.errors import ConfigError
from swarm.frames import Result

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

    from swarm.coordinator.books import Generation
    from swarm.coordinator.decoding import OPEN_ATTEMPTS, _open_session
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
        ring, gen = Ring(fails), Generation("s0", 64)
        trio.run(_open_session, ring, Loop(), gen, [1, 2, 3], DecodeOptions(4), False, never_replaced)
        return ring, gen

    ring, gen = run_open(1)
    assert ring.opened[0] == "s0" and ring.closed == ["s0"] and gen.session == ring.opened[1] != "s0"
    with pytest.raises(StageLost, match="while opening the session"):  # paused at every try: it says so
        run_open(OPEN_ATTEMPTS)


def test_ids_committed_past_the_answer_leave_the_output_and_the_kept_prefix():
    """Issue 45 item 7: a verify chunk accepted whole commits drafts past the id that completed a stop
    string; ``answer_len`` cuts them from the output (usage, receipts) and from what the stages keep."""
    from types import SimpleNamespace

    import trio

    from swarm.config import SpecConfig
    from swarm.coordinator.decoding import decode

    prompt, target = [1, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    script = prompt + target  # the tail's greedy token after every position

    class Ring:  # the tail answers each chunk from the script; every stage is one object
        infos = [SimpleNamespace(index=0, max_ctx=64, rows_proven=True, dtype="float32")]
        rotary_switch = None

        def __init__(self):
            self.results, self.kept = [], None

        async def open_session(self, *args, **kwargs):
            return 0

        async def send_chunk(self, session, chunk):
            first = chunk.first_result
            self.results.append(Result(session, chunk.epoch, chunk.pos, chunk.chunk_id,
                                       [script[q + 1] for q in range(first, chunk.pos + len(chunk.tokens))]))

        async def next_result(self, session):
            return self.results.pop(0)

        async def cancel(self, session, epoch):
            pass

        async def close_session(self, session, timeout_s=5.0, keep=None):
            self.kept = keep

    class Oracle:  # drafts exactly what the tail will say: every draft is accepted
        name = "oracle"

        def propose(self, context, n):
            return script[len(context):len(context) + n]

    def run(answer_len):
        ring, seen = Ring(), []
        options = DecodeOptions(len(target), spec=SpecConfig(draft="ngram", k=4), drafter=Oracle(), prefix_cache=True)
        result = trio.run(lambda: decode(ring, prompt, options, on_ids=lambda ids: seen.append(list(ids)),
                                         should_stop=lambda ids: len(ids) >= 2, answer_len=answer_len))
        return result, ring.kept, seen

    result, kept, seen = run(answer_len=lambda ids: 2)
    assert len(seen[-1]) > 2  # one chunk committed past the answer
    assert result.output_ids == target[:2] and kept == prompt + target[:2]
    result, kept, seen = run(answer_len=None)  # without it: everything committed, as before
    assert result.output_ids == seen[-1] == target[:len(seen[-1])] and kept == prompt + seen[-1]

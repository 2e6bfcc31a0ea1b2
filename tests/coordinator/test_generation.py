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

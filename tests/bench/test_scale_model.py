"""bench/scale_model.py, the paper model of docs/scale.md: its formula's special cases, and its
predictions against the speculation bench's measured grid (shipped in bench/results)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from scale_model import Ring, tokens_per_s, validate  # noqa: E402


def _ring(hop_s=0.01, step=0.02, stages=3):
    return Ring(stages, hop_s, lambda rows: step * (1 + 0.1 * (rows - 1)))


def test_greedy_is_one_token_per_round_trip():
    ring = _ring()
    assert tokens_per_s(ring, 0, 1, 0.0) == pytest.approx(1 / (4 * 0.01 + 3 * 0.02))


@pytest.mark.parametrize("k, accept", [(1, 0.5), (4, 0.6), (8, 0.9)])
def test_depth_one_commits_the_expected_accepted_prefix_per_round_trip(k, accept):
    ring = _ring()
    expected = sum(accept ** i for i in range(k + 1)) / ring.round_trip_s(k + 1)
    assert tokens_per_s(ring, k, 1, accept) == pytest.approx(expected)


def test_depth_helps_only_as_far_as_whole_chunks_accept_and_never_past_the_slowest_stage():
    far = _ring(hop_s=0.1)
    assert tokens_per_s(far, 4, 4, 0.95) > 1.5 * tokens_per_s(far, 4, 1, 0.95)  # long hops, drafts that hold
    assert tokens_per_s(far, 4, 4, 0.3) < 1.05 * tokens_per_s(far, 4, 1, 0.3)  # drafts that rarely hold
    near = Ring(3, 0.0, lambda rows: 0.02)
    assert tokens_per_s(near, 4, 64, 0.999) <= 5 / 0.02 * 1.001  # at most a chunk per stage step


def test_longer_hops_are_slower():
    assert tokens_per_s(_ring(0.05), 4, 2, 0.7) < tokens_per_s(_ring(0.01), 4, 2, 0.7)


def test_the_model_predicts_the_measured_speculation_grid():
    out = validate(ROOT / "bench" / "results" / "spec_ring-2026-11-30.jsonl")
    assert out["cells"] >= 50
    assert out["median_abs_error"] < 0.12, out["median_abs_error_by"]

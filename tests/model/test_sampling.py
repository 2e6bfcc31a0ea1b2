"""Keyed sampling: replayable, exact samples of the filtered distribution (stated tolerances)."""

import math

import pytest
import torch

from swarm.config import SamplingParams
from swarm.errors import ConfigError
from swarm.model.sampling import position_key, sample, target_distribution
from tests.support.stats import chi2_critical

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def chi_square(counts: list[int], probs: torch.Tensor) -> tuple[float, int]:
    n = sum(counts)
    keep = [i for i in range(len(counts)) if probs[i] > 0]
    stat = sum((counts[i] - n * float(probs[i])) ** 2 / (n * float(probs[i])) for i in keep)
    return stat, len(keep) - 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
])
def test_sample_frequencies_match_the_distribution(params):
    """20,000 keyed draws (positions 0..19999) against the filtered softmax: chi-square below the
    p = 0.001 critical value. Deterministic (fixed keys), so it cannot flake."""
    probs = target_distribution(LOGITS, params)
    counts = [0] * len(LOGITS)
    for pos in range(20_000):
        counts[sample(LOGITS, pos, params)] += 1
    assert all(counts[i] == 0 for i in range(len(LOGITS)) if probs[i] == 0)  # filtered tokens never drawn
    stat, dof = chi_square(counts, probs)
    assert stat < chi2_critical(dof), (stat, counts, probs.tolist())


def test_top_k_and_top_p_sets():
    assert (target_distribution(LOGITS, SamplingParams(temperature=1.0, top_k=3)) > 0).sum() == 3
    p = torch.softmax(LOGITS.double(), -1)
    kept = target_distribution(LOGITS, SamplingParams(temperature=1.0, top_p=0.8)) > 0
    # the smallest prefix of most likely tokens with mass >= 0.8
    need = next(i for i in range(1, 9) if float(p[:i].sum()) >= 0.8)
    assert int(kept.sum()) == need


def test_replayable_and_keyed():
    params = SamplingParams(temperature=1.0, seed=42)
    draws = [sample(LOGITS, pos, params) for pos in range(200)]
    assert draws == [sample(LOGITS, pos, params) for pos in range(200)]
    other = [sample(LOGITS, pos, SamplingParams(temperature=1.0, seed=43)) for pos in range(200)]
    assert draws != other
    assert position_key(1, 2) != position_key(2, 1)


def test_greedy_is_argmax():
    assert sample(LOGITS, 5, SamplingParams()) == 0


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=math.nan), dict(top_k=-1),
                                    dict(top_p=0), dict(top_p=1.5), dict(seed=-1)])
def test_bad_params(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_tiny_temperature_refused():
    with pytest.raises(ConfigError, match="use 0 for greedy"):
        SamplingParams(temperature=1e-320)

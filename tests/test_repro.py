"""swarm.repro: class ids from facts, the travelling form, and ``comparable``'s reasons."""

import pytest

from swarm import repro

FACTS = {"schema": repro.SCHEMA, "device": "cpu", "isa": "x86_64 AVX2", "blas": "mkl 2024.2", "torch": "2.13.0",
         "transformers": "5.24.0", "dtype": "float32",
         "kernel": {"mode": "fma", "source": "ab" * 8, "key_block": 64, "norm_tile": 16}, "weights": "cd" * 32}


def test_the_id_is_a_short_digest_of_the_canonical_facts():
    a = repro.make(FACTS)
    assert a.id.startswith("rc1-") and len(a.id) == 20
    reordered = dict(reversed(list(FACTS.items())))
    assert repro.make(reordered).id == a.id  # key order does not matter
    for name, value in (("torch", "2.12.0"), ("dtype", "bfloat16"), ("weights", "ef" * 32)):
        assert repro.make({**FACTS, name: value}).id != a.id
    assert repro.make({**FACTS, "kernel": {**FACTS["kernel"], "key_block": 32}}).id != a.id


def test_the_travelling_form_round_trips_and_a_forged_id_is_refused():
    a = repro.make(FACTS)
    assert repro.parse(a.as_dict()) == a
    with pytest.raises(ValueError, match="not the digest of its facts"):
        repro.parse({"id": a.id, "facts": {**FACTS, "torch": "2.12.0"}})
    with pytest.raises(ValueError, match="must be a map"):
        repro.parse([a.id])


@pytest.mark.parametrize("facts, match", [
    ({k: v for k, v in FACTS.items() if k != "blas"}, "lack blas"),
    ({**FACTS, "schema": "swarm/repro/0"}, "schema"),
    ({**FACTS, "weights": float("nan")}, "not JSON"),
    ({**FACTS, "weights": "x" * 5000}, "more than 2048"),
    ("cpu", "must be a map"),
])
def test_bad_facts_are_refused_clearly(facts, match):
    with pytest.raises(ValueError, match=match):
        repro.make(facts)


def test_comparable_names_every_difference():
    a = repro.make(FACTS)
    assert repro.comparable(a, repro.make(dict(FACTS))) and repro.comparable(a, a.as_dict()).reason == ""
    b = repro.make({**FACTS, "torch": "2.12.0", "kernel": {**FACTS["kernel"], "mode": "rows"}})
    verdict = repro.comparable(a, b)
    assert not verdict
    assert verdict.reason == "not comparable: kernel.mode fma vs rows; torch 2.13.0 vs 2.12.0"
    vendor = repro.make({**FACTS, "cpu_vendor": "GenuineIntel"})
    assert repro.comparable(a, vendor).reason == "not comparable: cpu_vendor (none) vs GenuineIntel"


def test_an_unreadable_class_is_not_comparable():
    a = repro.make(FACTS)
    verdict = repro.comparable(a, {"id": "rc1-0000000000000000", "facts": FACTS})
    assert not verdict and "not the digest" in verdict.reason

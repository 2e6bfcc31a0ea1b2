"""swarm.proofs's selection: a hash of the signed job receipt and the PeerId decides, at the stated rate."""

from __future__ import annotations

import pytest

from swarm import proofs


def _sig(i: int) -> str:
    return f"{i:0128x}"


def test_pick_is_a_function_of_the_job_signature_and_the_peer():
    a = proofs.pick(_sig(1), "peerA", 5, rate=0.5)
    assert a == proofs.pick(_sig(1), "peerA", 5, rate=0.5)
    assert a.draw != proofs.pick(_sig(1), "peerB", 5, rate=0.5).draw != proofs.pick(_sig(2), "peerA", 5).draw
    assert 0 <= a.window < 5 and proofs.pick(_sig(1), "peerA", None).window is None


def test_pick_audits_about_the_rate_and_every_session_of_a_new_identity():
    picks = [proofs.pick(_sig(i), "peer", 3, rate=0.05, seen=proofs.FIRST_SESSIONS) for i in range(4000)]
    share = sum(p.audit for p in picks) / len(picks)
    assert 0.04 < share < 0.06
    assert all(p.audit == (p.draw < 0.05) for p in picks)
    assert all(proofs.pick(_sig(i), "peer", 3, rate=0.05, seen=proofs.FIRST_SESSIONS - 1).audit for i in range(200))
    assert not any(proofs.pick(_sig(i), "peer", 3, rate=0.0, seen=10**6).audit for i in range(200))
    assert len({p.window for p in picks}) == 3


def test_bad_rates_and_signatures_are_refused():
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        proofs.pick(_sig(1), "p", 1, rate=1.5)
    with pytest.raises(ValueError):
        proofs.pick("not hex", "p", 1)

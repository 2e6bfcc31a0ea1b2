"""discovery/peers.py: what `swarm peers` says about records whose stage did not answer, and expiry."""

from __future__ import annotations

from swarm.discovery.peers import render, summarize
from swarm.discovery.records import StageRecord

MODEL = "ab" * 32
NOW = 1_000_000.0


def _rec(peer: str, layers, state="online", expires_in=100.0) -> StageRecord:
    return StageRecord(peer_id=peer, model_id=MODEL, model_name="m", num_layers=4, layers=layers,
                       addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), state=state, expires_at=NOW + expires_in)


def test_a_stage_that_did_not_answer_is_marked_and_not_counted():
    records = [_rec("peerA", (0, 2)), _rec("peerKILLED", (2, 4), expires_in=37.4), _rec("peerC", (0, 4), "draining")]
    rtts = {"peerA": 1.5, "peerC": 2.0}
    doc = summarize(records, rtts, now=NOW, probed=True, not_listed="the DHT named 5 provider(s): 2 expired")
    (m,) = doc["models"]
    assert m["coverage"] == [1, 1, 0, 0] and m["uncovered"] == [[2, 4]]  # killed: claimed, not counted
    stages = {s["peer_id"]: s for s in m["stages"]}
    assert stages["peerKILLED"]["answered"] is False and stages["peerKILLED"]["expires_in_s"] == 37.4
    assert stages["peerA"]["answered"] is True
    text = render(doc)
    assert "1 not answering" in text and "no answer" in text and "37 s" in text
    assert "not listed: the DHT named 5 provider(s): 2 expired" in text


def test_without_probes_every_online_record_counts():
    records = [_rec("peerA", (0, 2)), _rec("peerB", (2, 4))]
    (m,) = summarize(records, {})["models"]
    assert m["coverage"] == [1, 1, 1, 1] and all(s["answered"] is None for s in m["stages"])
    assert "no answer" not in render({"models": [m]})


def test_audits_per_stage_are_shown_from_the_tally_and_the_dht():
    records = [_rec("peerA", (0, 2)), _rec("peerCHEAT", (2, 4)), _rec("peerNEW", (2, 4))]
    audits = {"peerA": {"audited": 3, "passed": 3, "failed": 0, "proof": None},
              "peerCHEAT": {"audited": 2, "passed": 1, "failed": 1, "proof": "verified"}}
    doc = summarize(records, {}, audits=audits)
    stages = {s["peer_id"]: s for s in doc["models"][0]["stages"]}
    assert stages["peerCHEAT"]["audit"] == audits["peerCHEAT"] and stages["peerNEW"]["audit"] is None
    lines = {ln.split()[0]: ln for ln in render(doc).splitlines() if ln.strip().startswith("..")}
    assert lines["..peerA"].endswith("3/3/0") and lines["..peerCHEAT"].endswith("2/1/1, proof verified")
    assert lines["..peerNEW"].endswith(" -") and "audited/passed/failed" in render(doc)

"""swarm.stage.retention and the pure parts of swarm.stage.openings: the byte-bounded store, the rate limit."""

from __future__ import annotations

import pytest
import trio

from swarm import openings
from swarm.frames import Audit
from swarm.stage.openings import RateLimit
from swarm.stage.retention import RetentionStore


def commitment(rows: int, row_bytes: int = 100) -> openings.Commitment:
    log = openings.WindowLog()
    log.record(0, "float32", [bytes(row_bytes)] * rows, "float32", [bytes(row_bytes)] * rows)
    return openings.Commitment(log.snapshot(), 4)


def test_the_oldest_jobs_are_evicted_to_stay_within_the_budget():
    one = commitment(10).nbytes
    store = RetentionStore(3 * one)
    for n in range(5):
        assert store.put("s", f"job-{n}", {"n": n}, commitment(10))
        assert store.nbytes <= store.max_bytes
    assert len(store) == 3 and store.nbytes == 3 * one
    assert store.get("s", "job-0") is None and store.evicted("s", "job-0") and store.evicted("s", "job-1")
    assert store.get("s", "job-4").receipt == {"n": 4}
    assert not store.evicted("s", "job-9") and store.get("s", "job-9") is None  # never seen
    assert store.evictions == 2


def test_a_job_signed_again_replaces_its_entry():
    store = RetentionStore(10 * commitment(10).nbytes)
    store.put("s", "j", {"v": 1}, commitment(10))
    store.put("s", "j", {"v": 2}, commitment(20))
    assert len(store) == 1 and store.get("s", "j").receipt == {"v": 2}
    assert store.nbytes == commitment(20).nbytes
    assert store.get("t", "j") is None  # the key is the session and the job


def test_a_job_larger_than_the_budget_is_not_kept_and_says_evicted():
    store = RetentionStore(commitment(10).nbytes - 1)
    assert not store.put("s", "j", {}, commitment(10))
    assert len(store) == 0 and store.nbytes == 0 and store.evicted("s", "j")
    assert not RetentionStore(0).put("s", "j", {}, commitment(1))
    with pytest.raises(ValueError, match=">= 0 bytes"):
        RetentionStore(-1)


def test_the_rate_limit_is_per_requester_and_refills():
    limit = RateLimit(rate_per_s=2.0, burst=3)
    assert [limit.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limit.allow("b", 0.0)  # another PeerId has its own bucket
    assert not limit.allow("a", 0.2)  # 0.4 tokens back
    assert limit.allow("a", 0.6)  # 1.2 tokens: one request
    assert not limit.allow("a", 0.6)
    assert [limit.allow("a", 100.0) for _ in range(4)] == [True, True, True, False]  # refills to the burst only
    with pytest.raises(ValueError):
        RateLimit(0, 1)


class _Stream:
    remote_peer_id = "12D3KooWauditor"

    def __init__(self):
        self.sent = []

    async def send(self, msg, timeout_s=None):
        self.sent.append((trio.current_time(), msg.to_wire()))  # as the wire carries it


def _audits(tmp_path, busy, limit=None):
    from swarm import receipts, wire
    from swarm.stage.openings import Audits
    from swarm.transport import load_or_create_key
    from swarm.transport.identity import peer_id_of, sign

    key = load_or_create_key(tmp_path / "stage.key")
    store = RetentionStore(1 << 20)
    c = commitment(10)
    body = receipts.StageLedger("job", "n" * 32).body(
        session="s", coordinator="c", peer_id=peer_id_of(key), model="m", model_digest="d", range_digest="r",
        layers=[0, 1], num_layers=2, dtype="float32", wire_dtype="float32", positions=10, windows=c.field())
    receipt = receipts.sign_receipt(body, lambda d: sign(key, d))
    store.put("s", "job", receipt, c)
    audits = Audits(store, "[0, 1)", key=lambda: key, peer_id=lambda: peer_id_of(key), busy=busy,
                    error=lambda reason, code, session=None: wire.error_frame(reason, code, session), limit=limit)
    return audits, receipt


def test_no_retention_budget_keeps_no_rows(tmp_path):
    audits, _ = _audits(tmp_path, busy=lambda: False)
    assert audits.new_log().max_bytes == audits.store.max_bytes
    audits.store.max_bytes = 0  # --audit-retention-mb 0: receipts commit to no windows, nothing is copied
    assert audits.new_log() is None


def test_an_audit_waits_for_the_scheduler_and_answers_a_checked_opening(tmp_path):
    """Low priority: while the scheduler has work the answer waits (up to YIELD_S), then it is sent."""
    import trio.testing

    from swarm.stage import openings as stage_audit

    state = {"busy_until": 0.2}

    async def main():
        audits, receipt = _audits(tmp_path, busy=lambda: trio.current_time() < state["busy_until"])
        stream = _Stream()
        await audits.answer(stream, Audit("s", "job", 1))
        (at, msg), = stream.sent
        assert msg["type"] == "audit_ok" and at >= 0.2
        assert openings.check_opening(receipt, msg["opening"], 1).start == 4
        state["busy_until"] = 1e9  # busy for ever: answered after YIELD_S all the same
        t0 = trio.current_time()
        await audits.answer(stream, Audit("s", "job", 0))
        assert stream.sent[-1][1]["type"] == "audit_ok"
        assert stage_audit.YIELD_S <= stream.sent[-1][0] - t0 < stage_audit.YIELD_S + 0.1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_audit_refusals_are_error_frames(tmp_path):
    async def main():
        audits, _ = _audits(tmp_path, busy=lambda: False, limit=RateLimit(rate_per_s=0.001, burst=2))
        stream = _Stream()
        for window in (5, 0):
            await audits.answer(stream, Audit("s", "job", window))
        await audits.answer(stream, Audit("s", "other", 0))  # the limit is spent now
        codes = [m.get("code", m["type"]) for _, m in stream.sent]
        assert codes == ["bad_request", "audit_ok", "rate_limited"]
        assert "no window 5" in stream.sent[0][1]["reason"] and "too many audit requests" in stream.sent[2][1]["reason"]

    trio.run(main)

"""swarm.stage.retention and the pure parts of swarm.stage.audit: the byte-bounded store, the rate limit."""

from __future__ import annotations

import pytest

from swarm import audit
from swarm.stage.audit import RateLimit
from swarm.stage.retention import RetentionStore


def commitment(rows: int, row_bytes: int = 100) -> audit.Commitment:
    log = audit.WindowLog()
    log.record(0, "float32", [bytes(row_bytes)] * rows, "float32", [bytes(row_bytes)] * rows)
    return audit.Commitment(log.snapshot(), 4)


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

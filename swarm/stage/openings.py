"""The stage's side of an audit: keeping recent jobs' rows and answering ``audit`` requests.

Owns: :class:`Audits` (each signed receipt's window commitment handed to retention; an ``audit`` frame answered,
at low priority, with the window's signed opening or an error saying why) and :class:`RateLimit` (a token bucket
per requester, pure). The answers and their priority: docs/audits.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import trio

from swarm import openings
from swarm.frames import Audit, AuditOk
from swarm.stage.retention import RetentionCorrupt, RetentionStore

log = logging.getLogger(__name__)

RATE_PER_S = 20.0  # audit requests per second one PeerId may make, sustained
BURST = 64  # ... and at once (an auditor opening every window of a job up to the one it checks)
YIELD_S = 0.5  # an audit waits at most this long for the scheduler to have nothing queued
MAX_PEERS = 4096  # buckets kept; beyond, full ones (idle requesters) are forgotten


class RateLimit:
    """A token bucket per requester: ``rate_per_s`` sustained, ``burst`` at once.

    Raises:
        ValueError: a rate or burst that is not positive.
    """

    def __init__(self, rate_per_s: float = RATE_PER_S, burst: int = BURST) -> None:
        if not (rate_per_s > 0 and burst >= 1):
            raise ValueError(f"audit rate must be > 0 and burst >= 1, got {rate_per_s} and {burst}")
        self.rate_per_s, self.burst = rate_per_s, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, time of that count)

    def allow(self, peer: str, now: float) -> bool:
        """Take one token of ``peer``'s bucket at time ``now`` (seconds, any monotonic clock)."""
        tokens, then = self._buckets.get(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.rate_per_s)
        ok = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > MAX_PEERS:
            for p, (t, at) in list(self._buckets.items()):
                if t + (now - at) * self.rate_per_s >= self.burst:
                    del self._buckets[p]
        return ok


class Audits:
    """Retention and ``audit`` answers (see the module docstring).

    Args:
        store: the :class:`RetentionStore` (``--audit-retention-mb``).
        layer_range: the block's layers, for error reasons.
        key: ``key()`` the node's ed25519 KeyPair; ``peer_id``: ``peer_id()`` its PeerId.
        busy: ``busy()`` whether the scheduler has work queued or computing.
        error: ``error(reason, code, session)`` builds a counted error frame (the server's).
        limit: the per-requester :class:`RateLimit`.
        started_ms: unix milliseconds since which this stage answers for its jobs (default: now).
    """

    def __init__(self, store: RetentionStore, layer_range, *, key: Callable[[], object], peer_id: Callable[[], str],
                 busy: Callable[[], bool], error: Callable[..., dict], limit: RateLimit | None = None,
                 started_ms: int | None = None) -> None:
        self.store, self.layer_range = store, layer_range
        self._key, self._peer_id, self._busy, self._error = key, peer_id, busy, error
        self.limit = limit or RateLimit()
        self.answered = 0
        self.started_ms = int(time.time() * 1000) if started_ms is None else int(started_ms)
        self._adopted = False
        self._thread = trio.CapacityLimiter(1)  # openings are built one at a time, off the trio thread

    def new_log(self) -> openings.WindowLog | None:
        """A job session's :class:`swarm.openings.WindowLog`, bounded by the retention budget; None
        with ``--audit-retention-mb 0`` (no rows are copied, receipts commit to no windows)."""
        return openings.WindowLog(self.store.max_bytes) if self.store.max_bytes > 0 else None

    def retain(self, sess, receipt: dict, commitment: openings.Commitment) -> None:
        """Keep a signed receipt's commitment (the signer calls this) for later audits."""
        self.adopt()
        self.store.put(sess.session_id, sess.evidence.ledger.job_id, receipt, commitment)

    def adopt(self) -> None:
        """Take over the jobs an earlier run of this stage spilled (:meth:`RetentionStore.adopt`: those whose
        receipt this stage's key signed), once, when the key is known (the first receipt or audit)."""
        if self._adopted:
            return
        self._adopted = True
        from swarm.receipts import signature_ok

        me = self._peer_id()
        self.store.adopt(lambda receipt: receipt.get("peer_id") == me and signature_ok(receipt, me))

    async def answer(self, stream, msg: Audit) -> None:
        """Answer a validated ``audit`` frame on ``stream`` (see the module docstring)."""
        sid, job, k, peer = msg.session, msg.job, msg.window, stream.remote_peer_id
        if not self.limit.allow(peer, trio.current_time()):
            log.warning("audit.rate_limited peer=%s session=%s job=%s", peer, sid, job)
            await stream.send(self._error(f"stage {self.layer_range}: too many audit requests from {peer} "
                                          f"(at most {self.limit.rate_per_s:g}/s); retry later", "rate_limited", sid))
            return
        self.adopt()
        try:
            entry = self.store.get(sid, job)  # a spilled job is read back from --audit-retention-dir
        except RetentionCorrupt as exc:
            log.warning("audit.retention_corrupt peer=%s session=%s job=%s reason=%s", peer, sid, job, exc)
            await stream.send(self._error(f"stage {self.layer_range}: job {job!r} of session {sid!r} cannot be "
                                          f"opened: {exc}", "no_job", sid))
            return
        if entry is None:
            evicted = self.store.evicted(sid, job)
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_ms / 1000))
            why = ("was evicted from this stage's retention (--audit-retention-mb, --audit-retention-disk-mb)"
                   if evicted else f"is not known to this stage, which holds no record of jobs from before it "
                                   f"(re)started at {since} (since_ms {self.started_ms}) but those it spilled "
                                   f"to --audit-retention-dir")
            err = self._error(f"stage {self.layer_range}: job {job!r} of session {sid!r} {why}", "no_job", sid)
            await stream.send(err if evicted else replace(err, since_ms=self.started_ms))
            return
        leaves = len(entry.commitment.tree)
        if k >= leaves:
            await stream.send(self._error(f"stage {self.layer_range}: job {job!r} has {leaves} windows of "
                                          f"{entry.commitment.size} positions; there is no window {k}",
                                          "bad_request", sid))
            return
        with trio.move_on_after(YIELD_S):  # live sessions first: wait for a moment with nothing queued
            while self._busy():
                await trio.sleep(0.002)
        opening = await trio.to_thread.run_sync(self._opening, entry, k, limiter=self._thread)
        self.answered += 1
        log.info("audit.answered peer=%s session=%s job=%s window=%d", peer, sid, job, k)
        await stream.send(AuditOk(session=sid, job=job, window=k, opening=opening))

    def _opening(self, entry, k: int) -> dict:
        from swarm.transport.identity import sign

        key = self._key()
        return openings.sign_opening(openings.opening_body(entry.receipt, entry.commitment, k), lambda data: sign(key, data))

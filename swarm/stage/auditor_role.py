"""A stage's auditor role (``swarm stage --audit-rate S``): audit offered jobs in idle time.

Owns: :class:`AuditorRole`: :meth:`~AuditorRole.offer` answers each ``audit_offer`` (refused with the reason, or
queued in a bounded queue), :meth:`~AuditorRole.run` audits queued jobs with ``swarm.auditor.run.Auditor`` only
while the stage has no live session, and it keeps the proofs and the tally. The rules: docs/audits.md.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgpack
import trio

from swarm import receipts
from swarm.errors import ConfigError, ReceiptInvalid
from swarm.frames import AuditOffer, AuditOfferOk
from swarm.stage.openings import RateLimit

log = logging.getLogger(__name__)

OFFER_RATE_PER_S = 2.0  # offers one PeerId may make per second, sustained
OFFER_BURST = 16  # ... and at once
MAX_OFFER_BYTES = 1 << 20  # a job receipt larger than this is not taken
IDLE_POLL_S = 0.05  # how often a paused auditor looks whether the stage's sessions are gone
PROOFS_KEPT = 64
RECENT_JOBS = 1024  # job ids remembered, so an offer made twice is audited once


class AuditorRole:
    """The auditor role of one stage (see the module docstring).

    Args:
        rate: ``--audit-rate``, in (0, 1]; 0 turns the role off (offers are refused).
        layers: the stage's ``LayerRange``; a job's stage is audited when its layers lie within.
        model_digest: the stage's model manifest digest (offers of other weights are refused).
        live: ``live()`` the number of live sessions of the stage.
        error: ``error(reason, code, session)`` builds a counted error frame (the server's).
        allowed: ``--allow-coordinator`` (empty: any coordinator may offer its own jobs).
        queue_len: ``--audit-queue``; tally_path: ``--audit-tally`` (None: none).
        limit: the per-sender :class:`swarm.stage.openings.RateLimit` of offers.
    """

    def __init__(self, rate: float, layers, model_digest: str, *, live: Callable[[], int], error: Callable[..., dict],
                 allowed: tuple[str, ...] = (), queue_len: int = 64, tally_path: Path | None = None,
                 limit: RateLimit | None = None) -> None:
        self.rate, self.layers, self.model_digest = rate, layers, model_digest
        self._live, self._error, self.allowed = live, error, allowed
        self.queue: deque[dict] = deque()
        self.queue_len, self.tally_path = queue_len, tally_path
        self.limit = limit or RateLimit(OFFER_RATE_PER_S, OFFER_BURST)
        self._work = trio.Event()
        self._recent: deque[str] = deque(maxlen=RECENT_JOBS)
        self.offers = self.refused = self.dropped = self.jobs = self.pauses = 0
        self.paused = False
        self.tally: dict[str, dict] = {}
        self.unavailable: dict[str, int] = {}  # PeerId -> audits it could not answer, restarted since the job
        self.proofs: deque[dict] = deque(maxlen=PROOFS_KEPT)
        self.auditor = None  # swarm.auditor.run.Auditor, once run() started

    @property
    def on(self) -> bool:
        return self.rate > 0

    def covers(self, stage_receipt: dict, me: str | None = None) -> bool:
        """Whether this stage audits that stage of a job: its layers lie within this stage's, and it is
        not this stage itself."""
        layers = stage_receipt.get("layers")
        return (isinstance(layers, list) and len(layers) == 2 and all(type(x) is int for x in layers)
                and self.layers.start <= layers[0] < layers[1] <= self.layers.end
                and stage_receipt.get("peer_id") != me)

    def stats(self) -> dict:
        """The role's counters (``info``'s ``auditor``, the metrics)."""
        return {"rate": self.rate, "waiting": len(self.queue), "offers": self.offers, "refused": self.refused,
                "dropped": self.dropped, "jobs": self.jobs, "paused": self.paused, "pauses": self.pauses,
                "proofs": len(self.proofs), "unavailable": sum(self.unavailable.values()),
                **{k: sum(t[k] for t in self.tally.values()) for k in ("audited", "passed", "failed")},
                "tally": {p: dict(t) for p, t in self.tally.items()}}

    # ---- offers ---------------------------------------------------------------------------------

    async def offer(self, stream, msg: AuditOffer, me: str) -> None:
        """Answer a validated ``audit_offer`` frame from ``stream`` (see the module docstring). Never raises
        for what the offer holds: a bad one is refused with the reason."""
        sender = getattr(stream, "remote_peer_id", "?")
        refusal = await self._check(sender, msg.job, me)
        if refusal is not None:
            reason, code = refusal
            self.refused += 1
            log.info("audit.offer_refused peer=%s code=%s reason=%s", sender, code, reason)
            await stream.send(self._error(f"stage {self.layers}: {reason}"[:400], code))
            return
        job = msg.job
        queued = job["job_id"] not in self._recent
        if queued:
            self._recent.append(job["job_id"])
            if len(self.queue) >= self.queue_len:
                old = self.queue.popleft()
                self.dropped += 1
                log.warning("audit.offer_dropped job=%s waiting=%d (--audit-queue)", old.get("job_id"), len(self.queue))
            self.queue.append(job)
            self.offers += 1
            self._work.set()
            log.info("audit.offer_queued peer=%s job=%s waiting=%d", sender, job["job_id"], len(self.queue))
        await stream.send(AuditOfferOk(job=job["job_id"], queued=int(queued), waiting=len(self.queue)))

    async def _check(self, sender: str, job: dict, me: str) -> tuple[str, str] | None:
        """``(reason, code)`` when the offer is refused, else None."""
        if not self.on:
            return "this stage takes no audit offers (no auditor role: --audit-rate 0)", "unavailable"
        if not self.limit.allow(sender, trio.current_time()):
            return f"too many audit offers from {sender} (at most {self.limit.rate_per_s:g}/s); retry later", \
                "rate_limited"
        if self.allowed and sender not in self.allowed:
            return f"PeerId {sender} may not offer jobs to this stage (not in --allow-coordinator)", "forbidden"
        try:
            size = len(msgpack.packb(job, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as exc:
            return f"the offered job receipt does not encode: {exc}", "bad_request"
        if size > MAX_OFFER_BYTES:
            return f"the offered job receipt is {size} bytes, more than {MAX_OFFER_BYTES}", "bad_request"
        try:
            await trio.to_thread.run_sync(receipts.verify_job, job)
        except ReceiptInvalid as exc:
            return f"the offered job receipt does not verify: {exc}", "bad_request"
        if job["coordinator"] != sender:
            return (f"the job receipt is signed by {job['coordinator']}, the offer comes from {sender}: a coordinator "
                    "offers only its own jobs", "forbidden")
        if job["model_digest"] != self.model_digest:
            return f"the job ran other weights (model digest {job['model_digest'][:16]}...) than this stage's", \
                "bad_request"
        if not any(self.covers(r, me) for r in job["stage_receipts"]):
            return f"no stage of job {job['job_id'][:16]} runs layers within {self.layers}", "bad_request"
        return None

    # ---- auditing -------------------------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Return once the stage has no live session (at once when it has none)."""
        if self._live() == 0:
            return
        self.paused = True
        self.pauses += 1
        log.info("audit.paused sessions=%d", self._live())
        try:
            while self._live() > 0:
                await trio.sleep(IDLE_POLL_S)
        finally:
            self.paused = False
        log.info("audit.resumed")

    async def run(self, host, key, blocks, me: str, *, publish: Callable[[dict], Awaitable[None]] | None = None,
                  timeout_s: float = 30.0) -> None:
        """Audit queued jobs in idle time, forever (run in the server's nursery).

        Args:
            host: the stage's host (opens the audit streams); key: its KeyPair (signs proofs); me: its PeerId.
            blocks: the ``swarm.auditor.judge.Blocks`` of the stage's model directory.
            publish: ``await publish(proof)`` after a proof is kept (the DHT); a failure is logged.
        """
        from swarm.auditor.run import Auditor

        async def keep(proof: dict) -> None:
            self.proofs.append(proof)
            log.warning("audit.proof accused=%s job=%s position=%s", proof["accused"], proof["receipt"]["job_id"],
                        proof["position"])
            if publish is not None:
                try:
                    await publish(proof)
                except Exception as exc:  # a DHT that cannot take it now: the proof is still kept here
                    log.warning("audit.publish_failed accused=%s error=%s", proof["accused"], exc)

        self.auditor = Auditor(host, key, blocks, rate=self.rate, timeout_s=timeout_s, publish=keep,
                               covers=lambda r: self.covers(r, me), wait_idle=self.wait_idle)
        while True:
            while not self.queue:
                self._work = trio.Event()
                await self._work.wait()
            await self.wait_idle()
            if not self.queue:
                continue
            job = self.queue.popleft()
            try:
                await self._audit(job)
            except trio.Cancelled:
                raise
            except Exception:  # root of the role's task: one job's failure never stops the role or the stage
                log.exception("audit.job_crashed job=%s", job.get("job_id"))

    async def _audit(self, job: dict) -> None:
        import torch

        threads = torch.get_num_threads()  # a re-run in the rows mode takes the audited stage's thread count
        try:
            verdicts = await self.auditor.audit_job(job)
        except ReceiptInvalid as exc:
            log.warning("audit.job_invalid job=%s reason=%s", job.get("job_id"), exc)
            return
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        self.jobs += 1
        delta: dict[str, dict] = {}
        for v in verdicts:
            log.info("audit.verdict %s", v.line())
            if v.outcome == "unavailable":  # restarted since the job: not audited, not failed (counted apart)
                self.unavailable[v.peer_id] = self.unavailable.get(v.peer_id, 0) + 1
                delta.setdefault(v.peer_id, _zero())["unavailable"] = delta[v.peer_id].get("unavailable", 0) + 1
            if v.outcome in ("passed", "failed", "refused"):
                for t in (self.tally.setdefault(v.peer_id, _zero()), delta.setdefault(v.peer_id, _zero())):
                    t["audited"] += 1
                    t["passed" if v.outcome == "passed" else "failed"] += 1
        if delta and self.tally_path is not None:
            from swarm.auditor.tally import add_tally

            try:
                await trio.to_thread.run_sync(add_tally, self.tally_path, delta)
            except ConfigError as exc:  # the counts stay in info; the file is the operator's to fix
                log.warning("audit.tally_unwritten path=%s error=%s", self.tally_path, exc)


def _zero() -> dict:
    return {"audited": 0, "passed": 0, "failed": 0}

"""The networked auditor: pick a job's stages to audit, open their windows, judge, tally, publish proofs.

Owns: :class:`Auditor`: for a verified job receipt, the stages :func:`swarm.proofs.pick` picks, their windows
``0 .. k`` and their predecessors' on one stream each, the re-run in a worker thread, the counts per PeerId and
``publish(proof)``. How refusals, restarts and rate limits count: docs/audits.md.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from swarm import openings, proofs, receipts
from swarm.auditor.judge import Blocks, Verdict, judge
from swarm.errors import AuditFailed, HopTimeout, ProtocolError, StreamClosed, SwarmError
from swarm.frames import Audit, AuditOk, Error

log = logging.getLogger(__name__)

RATE_LIMIT_PAUSE_S = 1.0  # after a stage's rate_limited answer (its bucket refills at 20/s)
RATE_LIMIT_WAITS = 30  # ... at most this many times per stage and job, then it counts as refused
RESTART_SKEW_MS = 300_000  # a restart time claimed further ahead of this auditor's clock is not believed


class Auditor:
    """Audits stages' work on jobs (see the module docstring).

    Args:
        host: a ``swarm.transport`` host (``open_stream``, ``peer_id``); key: its ed25519 KeyPair (signs proofs).
        blocks: the :class:`Blocks` it re-runs.
        rate: ``s``, the audited share of sessions in [0, 1]; first_sessions: sessions of a new identity
            audited at 100%.
        all_windows: open every window (else the picked window and those before it, which its KV needs).
        timeout_s: per request; publish: ``await publish(proof)`` for each fraud proof.
        covers: ``covers(stage receipt)`` whether this auditor audits that stage (a stage's auditor role:
            the stages whose layers lie within its own); None: every stage. Others are ``skipped`` and not
            counted as seen.
        wait_idle: awaited before each stage's audit, each window request and each re-run (a stage's
            auditor role pauses there while it has live sessions of its own); None: never waits.
    """

    def __init__(self, host, key, blocks: Blocks, *, rate: float = proofs.DEFAULT_RATE,
                 first_sessions: int = proofs.FIRST_SESSIONS, all_windows: bool = False, timeout_s: float = 30.0,
                 publish: Callable[[dict], Awaitable[None]] | None = None,
                 covers: Callable[[dict], bool] | None = None,
                 wait_idle: Callable[[], Awaitable[None]] | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the audit rate must be in [0, 1], got {rate}")
        self.host, self.key, self.blocks = host, key, blocks
        self.rate, self.first_sessions, self.all_windows, self.timeout_s = rate, first_sessions, all_windows, timeout_s
        self.publish, self.covers, self._wait_idle = publish, covers, wait_idle
        self.seen: dict[str, int] = {}  # sessions of each PeerId this auditor has seen (audited or not)
        self.tally: dict[str, dict] = {}  # PeerId -> {"audited", "passed", "failed"}
        self.unavailable: dict[str, int] = {}  # PeerId -> audits it could not answer, restarted since the job
        self.proofs: list[dict] = []
        self._limiter = trio.CapacityLimiter(1)  # one re-run at a time, off the trio thread

    async def audit_job(self, job: dict) -> list[Verdict]:
        """Audit the stages of one job the hash picks.

        Args:
            job: a signed job receipt (its ``ring`` gives each stage's address).
        Returns:
            One :class:`Verdict` per stage (``skipped`` where not picked).
        Raises:
            ReceiptInvalid: the job receipt does not verify (nothing is audited on a broken chain).
        """
        receipts.verify_job(job)
        out = []
        stage_receipts, ring = job["stage_receipts"], job["ring"]
        for i, r in enumerate(stage_receipts):
            peer = r["peer_id"]
            if self.covers is not None and not self.covers(r):
                out.append(Verdict(peer, tuple(r["layers"]), r["job_id"], "skipped",
                                   "not within this auditor's layers"))
                continue
            leaves = (r.get("windows") or {}).get("leaves")
            choice = proofs.pick(job["sig"], peer, leaves, rate=self.rate, seen=self.seen.get(peer, 0),
                                first_sessions=self.first_sessions)
            self.seen[peer] = self.seen.get(peer, 0) + 1
            if not choice.audit:
                out.append(Verdict(peer, tuple(r["layers"]), r["job_id"], "skipped",
                                   f"not picked (draw {choice.draw:.3f} >= rate {choice.rate:g})"))
                continue
            last = leaves - 1 if self.all_windows and leaves else choice.window
            pred = (stage_receipts[i - 1], ring[i - 1]["addr"]) if i > 0 else None
            await self.wait_idle()
            verdict = await self.audit_stage(r, ring[i]["addr"], last, pred, sampled=_sampled(job))
            self._count(verdict)
            if verdict.proof is not None and self.publish is not None:
                await self.publish(verdict.proof)
            out.append(verdict)
        return out

    async def audit_stage(self, receipt: dict, addr: str, last: int | None, pred: tuple | None, *,
                          sampled: bool = False) -> Verdict:
        """Open windows ``0 .. last`` of one stage (and of its predecessor ``(receipt, addr)``), re-run, judge."""
        base = (receipt["peer_id"], tuple(receipt["layers"]), receipt["job_id"])
        if last is None:
            return Verdict(*base, "unauditable", "the receipt commits to no windows (--audit-retention-mb 0, or the "
                                                 "job outgrew it)")
        try:
            raw = await self._open(addr, receipt, last)
        except (AuditFailed, HopTimeout, StreamClosed, SwarmError, OSError) as exc:
            since = restarted_since(receipt, getattr(exc, "since_ms", None), receipts.now_ms())
            if since is not None:
                return Verdict(*base, "unavailable", f"the stage holds no record of the job: it (re)started at "
                                                     f"since_ms {since}, after the job ended (ended_ms "
                                                     f"{receipt['ended_ms']}); not counted as failed")
            return Verdict(*base, "refused", f"the stage did not open its windows: {exc}")
        pred_part = None
        if pred is not None:
            try:
                pred_raw = await self._open(pred[1], pred[0], last)
            except (AuditFailed, HopTimeout, StreamClosed, SwarmError, OSError) as exc:
                return Verdict(*base, "unauditable", f"its predecessor did not open the windows that bind its input: "
                                                     f"{exc}")
            pred_part = (pred[0], [openings.check_opening(pred[0], o, k) for k, o in enumerate(pred_raw)], pred_raw)
        opened = [openings.check_opening(receipt, o, k) for k, o in enumerate(raw)]
        try:
            block = self.blocks.for_receipt(receipt)
        except SwarmError as exc:
            return Verdict(*base, "not comparable", f"not comparable: this auditor cannot load the range ({exc})")
        from swarm.transport.identity import sign

        await self.wait_idle()
        return await trio.to_thread.run_sync(
            lambda: judge(block, receipt, opened, raw, pred_part, sampled=sampled, auditor=self.host.peer_id,
                          sign=lambda data: sign(self.key, data), now_ms=receipts.now_ms()),
            limiter=self._limiter)

    async def _open(self, addr: str, receipt: dict, last: int) -> list[dict]:
        """The signed opening maps of windows 0 .. last, each checked, on one stream."""
        from swarm import wire

        stream = await self.host.open_stream(addr, wire.PROTOCOL_ID, timeout_s=self.timeout_s)
        try:
            got: list[dict] = []
            waits = 0
            while len(got) <= last:
                k = len(got)
                await self.wait_idle()
                await stream.send(Audit(session=receipt["session"], job=receipt["job_id"], window=k),
                                  timeout_s=self.timeout_s)
                try:
                    answer = wire.validate(await stream.recv(timeout_s=self.timeout_s))
                except ProtocolError as exc:
                    answer = Error(reason=f"a malformed answer: {exc}", code="bad_request")
                if isinstance(answer, AuditOk):
                    openings.check_opening(receipt, answer.opening, k)
                    got.append(answer.opening)
                    continue
                if isinstance(answer, Error) and answer.code == "rate_limited" and waits < RATE_LIMIT_WAITS:
                    waits += 1  # the stage protects its live sessions: ask again later, never count it against it
                    await trio.sleep(RATE_LIMIT_PAUSE_S)
                    continue
                reason = answer.reason if isinstance(answer, Error) else f"answered {answer.TYPE!r}"
                exc = AuditFailed(f"refused: window {k}: {str(reason)[:600]}")
                exc.check = "refused"
                if isinstance(answer, Error) and answer.code == "no_job":
                    exc.since_ms = answer.since_ms
                raise exc
            return got
        finally:
            await stream.aclose()

    def counts(self) -> dict[str, dict]:
        """The tally with ``unavailable`` beside the counts of each stage that had such audits (``add_tally``)."""
        zero = {"audited": 0, "passed": 0, "failed": 0}
        return {p: {**self.tally.get(p, zero),
                    **({"unavailable": self.unavailable[p]} if p in self.unavailable else {})}
                for p in {**self.tally, **self.unavailable}}

    async def wait_idle(self) -> None:
        """Return when the auditor may go on (at once without ``wait_idle``)."""
        if self._wait_idle is not None:
            await self._wait_idle()

    def _count(self, v: Verdict) -> None:
        if v.outcome == "unavailable":  # restarted since the job: nothing was opened, nothing failed
            self.unavailable[v.peer_id] = self.unavailable.get(v.peer_id, 0) + 1
        if v.outcome not in ("passed", "failed", "refused"):
            return
        t = self.tally.setdefault(v.peer_id, {"audited": 0, "passed": 0, "failed": 0})
        t["audited"] += 1
        t["passed" if v.outcome == "passed" else "failed"] += 1
        if v.proof is not None:
            self.proofs.append(v.proof)
        log.info("audit.%s peer=%s layers=%s job=%s reason=%s", v.outcome.replace(" ", "_"), v.peer_id,
                 list(v.layers), v.job_id, v.reason)


def restarted_since(receipt: dict, since_ms, now_ms: int) -> int | None:
    """The restart time a stage's ``no_job`` answer gave (``since_ms``, unix ms) when it explains the missing
    job: an int, after the job's signed ``ended_ms``, and not ahead of ``now_ms`` by more than
    ``RESTART_SKEW_MS``; else None (the answer is a refusal)."""
    ended = receipt.get("ended_ms")
    if type(since_ms) is not int or type(ended) is not int:
        return None
    if not ended < since_ms <= now_ms + RESTART_SKEW_MS:
        return None
    return since_ms


def _sampled(job: dict) -> bool:
    """Whether the job drew its tokens by sampling (its record's temperature is not 0)."""
    s = job.get("sampling")
    return isinstance(s, dict) and s.get("temperature", 0) != 0


__all__ = ["Auditor"]

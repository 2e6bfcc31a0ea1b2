"""Offering a signed job receipt to auditor-role stages: whom (pure) and the fire-and-forget send.

Owns: :func:`auditor_targets` (online stages whose record states ``audit_rate`` > 0, and a ring file's spares,
whose layers contain a stage range of the job and that did not serve in it; at most ``MAX_AUDITORS``) and
:func:`offer_job` (one ``audit_offer`` each, all under one deadline; answers logged, never raised).
"""

from __future__ import annotations

import logging

import msgpack
import trio

from swarm import wire
from swarm.errors import SwarmError
from swarm.frames import AuditOffer, AuditOfferOk, Error

log = logging.getLogger(__name__)

MAX_AUDITORS = 4  # auditor-role stages one job is offered to
OFFER_TIMEOUT_S = 5.0  # all offers of one job, together
MAX_OFFER_BYTES = 1 << 20  # the stage side's bound (swarm.stage.auditor_role): a larger receipt is not offered


def _within(inner, outer) -> bool:
    return outer[0] <= inner[0] < inner[1] <= outer[1]


def auditor_targets(job: dict, records=(), spares=()) -> list[str]:
    """The multiaddrs (with /p2p/) to offer ``job`` to.

    Args:
        job: the signed job receipt (its ``ring`` lists each stage's PeerId and layers).
        records: ``swarm.discovery.records.StageRecord`` s the coordinator read (any model: the ones of
            other weights have other layers' meaning, so the caller passes the job's model's records).
        spares: ``swarm.config.StageSpec`` s of the ring file (``addr``, ``layers``).
    Returns:
        At most ``MAX_AUDITORS`` addresses, records first (highest rate first), one per PeerId.
    """
    ranges = [tuple(e["layers"]) for e in job.get("ring", []) if isinstance(e, dict) and len(e.get("layers", [])) == 2]
    served = {e.get("peer_id") for e in job.get("ring", []) if isinstance(e, dict)}
    out: dict[str, str] = {}
    for r in sorted(records, key=lambda r: -getattr(r, "audit_rate", 0.0)):
        if getattr(r, "audit_rate", 0.0) <= 0 or r.state != "online" or r.peer_id in served or not r.addrs:
            continue
        if any(_within(span, r.layers) for span in ranges):
            out.setdefault(r.peer_id, r.addrs[0])
    for s in spares:
        peer = s.addr.rsplit("/p2p/", 1)[-1]
        if peer not in served and any(_within(span, (s.layers.start, s.layers.end)) for span in ranges):
            out.setdefault(peer, s.addr)
    return list(out.values())[:MAX_AUDITORS]


async def offer_job(host, job: dict, addrs: list[str], *, timeout_s: float = OFFER_TIMEOUT_S) -> dict[str, str]:
    """Offer ``job`` to each of ``addrs`` at once, for at most ``timeout_s`` in all.

    Returns:
        ``{addr: outcome}``: ``queued``, ``known`` (offered before), ``refused (code): reason``,
        ``failed: ...`` or ``no answer`` (past the deadline).
    """
    if not addrs:
        return {}
    if len(msgpack.packb(job, use_bin_type=True)) > MAX_OFFER_BYTES:
        log.info("audit.offer_skipped job=%s reason=the job receipt is over %d bytes", job.get("job_id"),
                 MAX_OFFER_BYTES)
        return {a: "skipped: too large" for a in addrs}
    got = {a: "no answer" for a in addrs}

    async def one(addr: str) -> None:
        try:
            stream = await host.open_stream(addr, wire.PROTOCOL_ID, timeout_s=timeout_s)
        except (SwarmError, OSError) as exc:
            got[addr] = f"failed: {exc}"[:300]
            return
        try:
            await stream.send(AuditOffer(job=job), timeout_s=timeout_s)
            answer = wire.validate(await stream.recv(timeout_s=timeout_s))
            if isinstance(answer, AuditOfferOk):
                got[addr] = "queued" if answer.queued else "known"
            elif isinstance(answer, Error):
                got[addr] = f"refused ({answer.code}): {answer.reason}"[:300]
            else:
                got[addr] = "failed: an answer that is not audit_offer_ok"
        except (SwarmError, OSError) as exc:
            got[addr] = f"failed: {exc}"[:300]
        finally:
            with trio.move_on_after(1.0) as cleanup:
                cleanup.shield = True
                await stream.aclose()

    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(one, addr)
    for addr, outcome in got.items():
        log.info("audit.offer job=%s to=%s outcome=%s", job.get("job_id"), addr, outcome)
    return got


__all__ = ["auditor_targets", "offer_job"]

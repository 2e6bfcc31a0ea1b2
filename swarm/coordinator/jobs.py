"""A generation as a job: its signed receipt written and verified, and the receipt offered to auditors.

Owns: ``check_receipt_dir``, ``write_job_receipt`` (the stages' parts joined into the job receipt,
signed, written atomically and verified) and ``offer_for_audit``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from swarm import receipts
from swarm.errors import ConfigError, ReceiptInvalid

log = logging.getLogger(__name__)


async def offer_for_audit(host, receipt: dict, discovery, spares=()) -> dict:
    """Offer a verified job receipt (``write_job_receipt``'s result) to the auditor-role stages this
    coordinator knows: the DHT records it routed with (``discovery``: a ``swarm.coordinator.routing.RouteContext``, or None) and
    the ring file's ``spares`` (``swarm.auditor.offers``; bounded in time, never raises).

    Returns:
        ``{addr: outcome}`` (empty when there is nobody to offer it to, or the receipt did not verify).
    """
    from swarm.auditor.offers import auditor_targets, offer_job

    if not receipt.get("verified"):
        return {}
    try:
        doc = json.loads(Path(receipt["path"]).read_text())
    except (OSError, ValueError) as exc:
        log.warning("audit.offer_skipped path=%s error=%s", receipt["path"], exc)
        return {}
    records = [r for r in discovery.records if r.model_id == discovery.model_id] if discovery else []
    targets = auditor_targets(doc, records, spares)
    return await offer_job(host, doc, targets) if targets else {}


def check_receipt_dir(directory) -> None:
    """Make sure receipts can be written to ``directory`` (created if missing), before any work.

    Raises:
        ConfigError: it is not a directory, cannot be created, or is not writable.
    """
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ConfigError(f"--receipt-dir {directory} is not a directory")
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the receipt directory {directory}: {exc.strerror}") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"the receipt directory {directory} is not writable (choose another with --receipt-dir)")


def write_job_receipt(receipt_dir, key, job: dict, parts: dict, *, model: str, model_digest: str, num_layers: int,
                      prompt_ids: list[int], output_ids: list[int], ring: list[dict], record: dict) -> dict:
    """Build, sign (coordinator key), save and verify the job receipt.

    Returns:
        ``{"path", "job_id", "verified", "summary" | "reason" and "check"}``; the verification is the same as
        ``swarm receipts verify``.
    Raises:
        ConfigError: the receipt directory cannot be written.
    """
    from swarm.transport.identity import peer_id_of, sign

    body = receipts.job_body(job_id=job["id"], nonce=job["nonce"], coordinator=peer_id_of(key), model=model,
                             model_digest=model_digest, num_layers=num_layers, prompt_ids=prompt_ids,
                             output_ids=output_ids, ring=ring, stage_receipts=parts["stage_receipts"],
                             sent=parts["sent"], received=parts["received"], record=record,
                             segments=parts.get("segments"))
    if parts["problems"]:
        body["receipt_problems"] = parts["problems"]
    doc = receipts.sign_receipt(body, lambda data: sign(key, data))
    try:
        path = receipts.save(doc, receipt_dir)
    except OSError as exc:
        raise ConfigError(f"cannot write the receipt to {receipt_dir}: {exc}") from exc
    out = {"path": os.path.abspath(path), "job_id": job["id"]}
    try:
        out.update(verified=True, summary=receipts.verify_job(doc).summary())
    except ReceiptInvalid as exc:
        out.update(verified=False, reason=str(exc), check=getattr(exc, "check", "schema"))
        log.warning("receipt.invalid path=%s reason=%s", path, exc)
    return out

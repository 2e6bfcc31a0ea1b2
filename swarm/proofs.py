"""Audit selection and fraud proofs: which receipts an auditor checks, and the evidence of a cheat.

Owns: :func:`pick` (from a hash of the signed job receipt and the stage's PeerId), the fraud proof
(:func:`build_proof`, :func:`encode` / :func:`decode`) and its check without weights (:func:`check_proof`, pure);
the re-run is ``swarm.auditor``'s. No torch. Formats: docs/protocol.md, "Fraud proofs"; reasons: docs/audits.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgpack

from swarm import openings, repro
from swarm.errors import AuditFailed, ProofRefused

SCHEMA = "swarm/fraud-proof/1"
_TAG = b"swarm-fraud-proof/1\n"
DEFAULT_RATE = 0.05  # audited share of an identity's sessions once it is past its first ones
FIRST_SESSIONS = 20  # an identity's first sessions an auditor sees are all audited
MAX_PROOF_BYTES = 1_000_000  # a proof larger than this is not read (a DHT record holds at most 1 MiB)


# ---- selection ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pick:
    """Whether to audit one stage of one job, and which window.

    Attributes:
        audit: audit it; ``draw``: the hash's number in [0, 1) compared with the rate; ``rate``: the
            rate that applied; ``window``: the window to open (None when the receipt has none).
    """

    audit: bool
    draw: float
    rate: float
    window: int | None


def pick_hash(job_sig: str, peer_id: str) -> bytes:
    """BLAKE2b-256 of the job receipt's signature bytes and the stage's PeerId (see the module docstring).

    Raises:
        ValueError: ``job_sig`` is not hex.
    """
    return hashlib.blake2b(bytes.fromhex(job_sig) + b"\x00" + peer_id.encode(), digest_size=32,
                           person=b"swarm-audit-pick").digest()


def pick(job_sig: str, peer_id: str, leaves: int | None, *, rate: float = DEFAULT_RATE, seen: int = 0,
         first_sessions: int = FIRST_SESSIONS) -> Pick:
    """Decide whether to audit the stage ``peer_id`` of the job signed ``job_sig``, and which window.

    Args:
        job_sig: the job receipt's ``sig`` (hex); peer_id: the stage; leaves: its receipt's window count.
        rate: the audited share ``s`` in [0, 1]; seen: sessions of this identity the auditor saw before.
        first_sessions: below this many ``seen``, the rate is 1.
    Raises:
        ValueError: a rate outside [0, 1] or a signature that is not hex.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"the audit rate must be in [0, 1], got {rate}")
    h = pick_hash(job_sig, peer_id)
    draw = int.from_bytes(h[:8], "big") / 2.0 ** 64
    eff = 1.0 if seen < first_sessions else rate
    window = int.from_bytes(h[8:16], "big") % leaves if leaves else None
    return Pick(draw < eff, draw, eff, window)


# ---- the proof ----------------------------------------------------------------------------------


def _row_digest(row: bytes | None) -> str:
    return hashlib.blake2b(row or b"", digest_size=32, person=b"swarm-row/1").hexdigest()


def _leaves(raw: list | None) -> list[str]:
    return [openings.opening_leaf(o).hex() for o in raw or []]


def claim_body(proof: dict) -> dict:
    """The part of a proof its auditor signs (JSON values only; rows enter as leaf hashes and digests)."""
    return {"schema": SCHEMA, "accused": proof["accused"], "auditor": proof["auditor"],
            "job_id": proof["receipt"].get("job_id"), "session": proof["receipt"].get("session"),
            "receipt_sig": proof["receipt"].get("sig"), "position": proof["position"],
            "leaves": _leaves(proof["openings"]), "pred_leaves": _leaves(proof.get("pred_openings")),
            "pred_sig": (proof.get("pred_receipt") or {}).get("sig"),
            "class": proof["auditor_class"].get("id"), "recomputed": _row_digest(proof["recomputed"]),
            "created_ms": proof["created_ms"]}


def build_proof(*, receipt: dict, openings: list[dict], pred_receipt: dict | None, pred_openings: list[dict] | None,
                position: int, recomputed: bytes, auditor_class: dict, auditor: str, sign, created_ms: int) -> dict:
    """A signed fraud proof (see the module docstring).

    Args:
        receipt, openings: the accused's signed receipt and its openings of windows 0 .. w (raw maps).
        pred_receipt, pred_openings: the predecessor's, or None at the head.
        position: the first position the re-run does not reproduce; recomputed: the auditor's row there.
        auditor_class: ``{id, facts}`` of the auditor's run; auditor: its PeerId; ``sign(bytes) -> bytes``.
        created_ms: wall-clock milliseconds.
    """
    w = position // receipt["windows"]["size"]
    proof = {"schema": SCHEMA, "accused": receipt["peer_id"], "receipt": receipt, "openings": openings[:w + 1],
             "pred_receipt": pred_receipt, "pred_openings": None if pred_openings is None else pred_openings[:w + 1],
             "position": position, "recomputed": bytes(recomputed), "auditor_class": auditor_class,
             "auditor": auditor, "created_ms": created_ms}
    return sign_claim(proof, sign)


def sign_claim(proof: dict, sign) -> dict:
    """``proof`` with ``sig``: hex of ``sign(bytes)`` over its :func:`claim_body` (the auditor's signature)."""
    from swarm.receipts import canonical

    return {**proof, "sig": sign(canonical(claim_body(proof), _TAG)).hex()}


def encode(proof: dict) -> bytes:
    """The proof's bytes (msgpack), as written to a file and put on the DHT."""
    return msgpack.packb(proof, use_bin_type=True)


def decode(data: bytes) -> dict:
    """A proof from its bytes.

    Raises:
        ProofRefused: (``malformed``) larger than ``MAX_PROOF_BYTES`` or not a msgpack map.
    """
    if len(data) > MAX_PROOF_BYTES:
        raise refused("malformed", f"the proof is {len(data)} bytes, more than {MAX_PROOF_BYTES}")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise refused("malformed", f"not a msgpack document ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise refused("malformed", "the proof is not a map")
    return doc


def refused(reason: str, msg: str, against: str | None = None) -> ProofRefused:
    """A :class:`ProofRefused` with ``.reason`` and ``.against`` (the auditor a framing is evidence against)."""
    exc = ProofRefused(f"refused ({reason}): {msg}")
    exc.reason, exc.against = reason, against
    return exc


@dataclass(frozen=True)
class Claim:
    """A proof that passed :func:`check_proof`: what remains is to re-run and compare.

    Attributes:
        accused, auditor: PeerIds; receipt: the accused's receipt; position: the claimed position.
        inputs: (kind, row bytes) per position ``0 .. position``; claimed: the accused's output row at
        ``position`` and ``out_kind`` its kind; recomputed: the auditor's row; cls: the receipt's class.
    """

    accused: str
    auditor: str
    receipt: dict
    position: int
    inputs: tuple
    out_kind: str
    claimed: bytes
    recomputed: bytes
    cls: repro.ReproClass


def _rows_by_position(receipt: dict, raw: Any, who: str) -> dict[int, tuple]:
    if not isinstance(raw, list) or not raw:
        raise refused("malformed", f"the proof holds no openings of the {who}")
    rows: dict[int, tuple] = {}
    for k, o in enumerate(raw):
        try:
            opened = openings.check_opening(receipt, o, window=k)
        except AuditFailed as exc:
            raise refused("opening", f"the {who}'s window {k}: {exc}") from None
        rows.update({opened.start + i: r for i, r in enumerate(opened.rows)})
    return rows


def check_proof(proof: Any) -> Claim:
    """Check a fraud proof without weights: everything but the re-run (see the module docstring).

    Returns:
        The :class:`Claim` to re-run.
    Raises:
        ProofRefused: with ``.reason`` and a line saying why.
    """
    from swarm.receipts import canonical, signature_ok
    from swarm.transport.identity import verify_peer_signature

    _check_fields(proof)
    receipt, p = proof["receipt"], proof["position"]
    if not signature_ok(receipt, receipt.get("peer_id")) or receipt.get("peer_id") != proof["accused"]:
        raise refused("signature", f"the receipt is not signed by the accused {proof['accused']}")
    rows = _rows_by_position(receipt, proof["openings"], "accused")
    size = receipt["windows"]["size"]
    if p not in rows or p // size != len(proof["openings"]) - 1:
        raise refused("wrong window", f"position {p} is not in the last opened window "
                                      f"({len(proof['openings']) - 1}, positions of {size})")
    in_kind, _, out_kind, claimed = rows[p]
    if claimed is None:
        raise refused("wrong window", f"the accused sent no output row at position {p}")
    if any(rows.get(q, (None, None))[1] is None for q in range(p + 1)):
        raise refused("input not bound", f"the accused's input rows do not cover positions [0, {p}]")
    _check_binding(proof, receipt, rows, p)
    try:
        theirs, mine = repro.parse(receipt.get("repro")), repro.parse(proof["auditor_class"])
    except ValueError as exc:
        raise refused("another class", f"a class does not read: {exc}") from None
    same = repro.comparable(theirs, mine)
    if not same:
        raise refused("another class", f"the auditor ran class {mine.id}, the stage signed {theirs.id}: {same.reason}")
    try:
        claim = canonical(claim_body(proof), _TAG)
        sig_ok = verify_peer_signature(proof["auditor"], claim, bytes.fromhex(proof["sig"]))
    except (ValueError, TypeError):
        sig_ok = False
    if not sig_ok:
        raise refused("signature", f"the claim is not signed by the auditor {proof['auditor']}")
    if bytes(proof["recomputed"]) == bytes(claimed):
        raise refused("honest stage framed", f"the auditor's recomputed row at position {p} equals the stage's",
                      against=proof["auditor"])
    inputs = tuple((rows[q][0], rows[q][1]) for q in range(p + 1))
    return Claim(proof["accused"], proof["auditor"], receipt, p, inputs, out_kind, bytes(claimed),
                 bytes(proof["recomputed"]), theirs)


def _check_fields(proof: Any) -> None:
    types = {"schema": str, "accused": str, "receipt": dict, "openings": list, "position": int,
             "recomputed": (bytes, bytearray), "auditor_class": dict, "auditor": str, "created_ms": int, "sig": str}
    if not isinstance(proof, dict):
        raise refused("malformed", "the proof is not a map")
    if proof.get("schema") != SCHEMA:
        raise refused("malformed", f"the schema is {str(proof.get('schema'))[:40]!r}, not {SCHEMA}")
    for name, t in types.items():
        if not isinstance(proof.get(name), t) or isinstance(proof.get(name), bool):
            raise refused("malformed", f"the proof lacks {name!r} or it has the wrong type")
    w = proof["receipt"].get("windows")
    if not (isinstance(w, dict) and type(w.get("size")) is int and w["size"] >= 1) or proof["position"] < 0:
        raise refused("malformed", "the receipt commits to no windows, or the position is negative")


def _check_binding(proof: dict, receipt: dict, rows: dict, p: int) -> None:
    """The predecessor's signed output rows must be the accused's input rows at every position up to ``p``."""
    from swarm.receipts import signature_ok

    layers = receipt.get("layers")
    if not (isinstance(layers, list) and len(layers) == 2):
        raise refused("malformed", "the receipt names no layer range")
    pred = proof.get("pred_receipt")
    if layers[0] == 0:
        if pred is not None:
            raise refused("malformed", "the head has no predecessor")
        return  # the head's inputs are the token ids it committed to
    if not isinstance(pred, dict) or not signature_ok(pred, pred.get("peer_id")):
        raise refused("input not bound", "no predecessor receipt signed by its PeerId binds the accused's input")
    same = all(pred.get(f) == receipt.get(f) for f in ("job_id", "nonce", "session"))
    if not same or not isinstance(pred.get("layers"), list) or pred["layers"][-1:] != layers[:1]:
        raise refused("input not bound", f"the predecessor receipt is not of this job and session, or its layers "
                                         f"{pred.get('layers')} do not end where the accused's {layers} start")
    prev = _rows_by_position(pred, proof.get("pred_openings"), "predecessor")
    for q in range(p + 1):
        sent = prev.get(q, (None, None, None, None))[3]
        if sent is None or bytes(sent) != bytes(rows[q][1]):
            raise refused("input not bound", f"at position {q} the accused's input row is not the row its "
                                             f"predecessor {pred['peer_id']} signed as sent")

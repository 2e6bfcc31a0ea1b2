"""Receipts: who computed what, signed with the node's own identity, and their verification.

Owns: the stage and job receipt schemas, the rolling digests over frame payloads (``forward_item``,
``result_item``), canonical signing bytes and ``verify_job`` (fail closed). No torch, no network. Formats:
docs/protocol.md, "Receipts on the wire"; what they prove: docs/architecture.md, "Receipts".
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from swarm.errors import ConfigError, ReceiptInvalid
from swarm.frames import Forward, Open, Refill, Repair, Result
from swarm.files import write_atomic
from swarm.ranges import LayerRange, check_tiling

STAGE_SCHEMA = "swarm/stage-receipt/1"
JOB_SCHEMA = "swarm/job-receipt/1"
DIGEST_ALG = "blake2b-256"
_SIGN_TAG = b"swarm-receipt/1\n"
_ID_PROOF_TAG = b"swarm-id-proof/1\n"
_OPEN_TAG = b"swarm-open/1\n"
MAX_ID_CHARS = 128

# ---- digests ------------------------------------------------------------------------------------


class RollingDigest:
    """BLAKE2b-256 over a sequence of items, each packed as one msgpack array (self-delimiting).

    ``frames`` counts the items. Two parties that add the same items in the same order get the
    same ``hexdigest()``.
    """

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=32, person=b"swarm-frames/1")
        self.frames = 0

    def add(self, item: list) -> None:
        self._h.update(msgpack.packb(item, use_bin_type=True))
        self.frames += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def as_dict(self) -> dict:
        return {"digest": self.hexdigest(), "frames": self.frames}


def forward_item(msg: Forward) -> list:
    """The digest item of a ``forward`` frame: position fields and the payload's exact bytes.

    ``["forward", epoch, pos, chunk, "tokens", [ids...]]`` for the head's input, or
    ``["forward", epoch, pos, chunk, "hidden", dtype, shape, data, scale]`` (``scale`` is None
    except for float8) for hidden states. Values are taken as decoded from the wire, not coerced:
    the receiver's item packs to the same bytes as the sender's.
    """
    head = ["forward", msg.epoch, msg.pos, msg.chunk]
    if msg.logits_from is not None:  # which rows the tail answers for: part of what was asked
        head.append(["logits_from", msg.logits_from])
    return head + _payload_item(msg)


def refill_item(msg: Refill) -> list:
    """The digest item of a ``refill`` frame (a heal's resent positions):
    ``["refill", epoch, pos, until, "tokens", [ids...]]`` or
    ``["refill", epoch, pos, until, "hidden", dtype, shape, data, scale]``."""
    return ["refill", msg.epoch, msg.pos, msg.until] + _payload_item(msg)


def _payload_item(msg: Forward | Refill) -> list:
    if msg.tokens is not None:
        return ["tokens", msg.tokens]
    t = msg.hidden
    return ["hidden", t.get("dtype"), t.get("shape"), t.get("data"), t.get("scale")]


def result_item(msg: Result) -> list:
    """The digest item of a ``result`` frame: ``["result", epoch, pos, chunk, [token ids...]]``, with
    ``["logits_from", n]`` after ``chunk`` when the frame answers only rows from ``n`` on."""
    head = ["result", msg.epoch, msg.pos, msg.chunk]
    if msg.logits_from is not None:
        head.append(["logits_from", msg.logits_from])
    return head + [msg.token_ids]


def ids_digest(ids: list[int]) -> str:
    """BLAKE2b-256 hex of a token-id list (msgpack array of ints)."""
    return hashlib.blake2b(msgpack.packb([int(i) for i in ids]), digest_size=32, person=b"swarm-ids/1").hexdigest()


def new_nonce() -> str:
    """A fresh 128-bit nonce, hex (the coordinator picks one per job)."""
    return secrets.token_hex(16)


def now_ms() -> int:
    return int(time.time() * 1000)


# ---- signing ------------------------------------------------------------------------------------


def canonical(body: dict, tag: bytes = _SIGN_TAG) -> bytes:
    """The bytes a receipt signature covers: the domain tag + canonical JSON of all but ``sig``.

    Raises:
        ValueError: the body holds NaN/inf or a value JSON cannot encode.
        TypeError: the body holds bytes or another non-JSON value.
    """
    unsigned = {k: v for k, v in body.items() if k != "sig"}
    return tag + json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                            allow_nan=False).encode()


def assignment_bytes(open_frame: Open | Repair, coordinator: str) -> bytes:
    """What a coordinator signs in an ``open`` (or ``repair``) frame: every field of its wire map but
    ``sig``, plus its own PeerId, under the tag ``swarm-open/1\\n`` (so an open can never pass for a
    receipt, or the reverse)."""
    return canonical({**open_frame.to_wire(), "coordinator": coordinator}, _OPEN_TAG)


def assignment_ok(open_frame: Open | Repair, coordinator: str) -> bool:
    """True when ``open_frame.sig`` is ``coordinator``'s signature of the assignment (fails closed)."""
    from swarm.transport.identity import verify_peer_signature

    sig = open_frame.sig
    try:
        return isinstance(sig, str) and verify_peer_signature(
            coordinator, assignment_bytes(open_frame, coordinator), bytes.fromhex(sig))
    except (ValueError, TypeError):
        return False


def sign_receipt(body: dict, sign: Callable[[bytes], bytes]) -> dict:
    """Return ``body`` with ``sig`` (hex of ``sign(canonical(body))``) added.

    Args:
        body: the receipt fields (JSON values only).
        sign: the node's signing function (``swarm.transport.identity.sign`` bound to its key).
    """
    out = {k: v for k, v in body.items() if k != "sig"}
    out["sig"] = sign(canonical(out)).hex()
    return out


def signature_ok(receipt: dict, peer_id: str) -> bool:
    """True when ``receipt["sig"]`` is ``peer_id``'s signature of the receipt (fails closed)."""
    from swarm.transport.identity import verify_peer_signature

    sig = receipt.get("sig")
    if not isinstance(sig, str) or not isinstance(peer_id, str):
        return False
    try:
        raw = bytes.fromhex(sig)
        data = canonical(receipt)
    except (ValueError, TypeError):
        return False
    return verify_peer_signature(peer_id, data, raw)


def id_proof_message(nonce: str) -> bytes:
    """The bytes ``swarm id prove`` signs: a domain tag + the nonce (UTF-8)."""
    return _ID_PROOF_TAG + nonce.encode()


# ---- the stage side -----------------------------------------------------------------------------


@dataclass
class StageLedger:
    """What one stage records for one session of a job (``open`` carried ``job``)."""

    job_id: str
    nonce: str
    started_ms: int = field(default_factory=now_ms)
    input: RollingDigest = field(default_factory=RollingDigest)
    output: RollingDigest = field(default_factory=RollingDigest)
    segments: list = field(default_factory=list)  # closed digests, see cut()

    def cut(self, side: str, peer: str) -> None:
        """Close the ``side`` ("input" or "output") digest at a heal that re-pointed this stage:
        frames so far went to (or came from) ``peer``, the stage that was replaced; later frames
        start a fresh digest, which chains to the replacement's. The closed digest goes into the
        receipt's ``segments``."""
        old = self.input if side == "input" else self.output
        self.segments.append({"side": side, "peer": peer, **old.as_dict()})
        if side == "input":
            self.input = RollingDigest()
        else:
            self.output = RollingDigest()

    def body(self, *, session: str, coordinator: str, peer_id: str, model: str, model_digest: str,
             range_digest: str, layers: list[int], num_layers: int, dtype: str, wire_dtype: str,
             positions: int, reused: int = 0, repro: dict | None = None, windows: dict | None = None,
             answers: dict | None = None) -> dict:
        """The unsigned stage receipt (see the module docstring for the fields). ``reused``: positions
        ``[0, reused)`` this stage took from its prefix cache instead of computing them in this session
        (the receipt then vouches only for the frames it received and sent). ``repro``: the stage's
        reproducibility class (``swarm.repro``, ``{"id", "facts"}``); ``windows``: the Merkle
        commitment to its rows per window (``swarm.openings.Commitment.field``); ``answers``: the tail's
        token ids by position (``{"from", "ids"}``)."""
        return {
            "schema": STAGE_SCHEMA, "job_id": self.job_id, "nonce": self.nonce, "session": session,
            "coordinator": coordinator,
            "peer_id": peer_id, "model": model, "model_digest": model_digest, "range_digest": range_digest,
            "layers": list(layers), "num_layers": num_layers, "dtype": dtype, "wire_dtype": wire_dtype,
            "positions": positions, "digest_alg": DIGEST_ALG, "input": self.input.as_dict(),
            "output": self.output.as_dict(), "started_ms": self.started_ms, "ended_ms": now_ms(),
            **({"segments": [dict(x) for x in self.segments]} if self.segments else {}),
            **({"reused": reused} if reused else {}),
            **({"repro": repro} if repro is not None else {}),
            **({"windows": windows} if windows is not None else {}),
            **({"answers": answers} if answers is not None else {}),
        }


def check_job_field(job: Any) -> tuple[str, str]:
    """Validate the ``job`` map of an ``open`` frame; return (job id, nonce).

    Raises:
        ValueError: not a map of two non-empty strings of at most 128 characters.
    """
    if not isinstance(job, dict):
        raise ValueError("'job' must be a map with 'id' and 'nonce'")
    jid, nonce = job.get("id"), job.get("nonce")
    for name, v in (("id", jid), ("nonce", nonce)):
        if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_CHARS:
            raise ValueError(f"job {name} must be a string of 1..{MAX_ID_CHARS} characters")
    return jid, nonce


# ---- the job receipt ----------------------------------------------------------------------------


def job_body(*, job_id: str, nonce: str, coordinator: str, model: str, model_digest: str, num_layers: int,
             prompt_ids: list[int], output_ids: list[int], ring: list[dict], stage_receipts: list[dict],
             sent: dict, received: dict, record: dict, segments: list | None = None) -> dict:
    """The unsigned job receipt.

    Args:
        ring: ``[{index, peer_id, addr, layers}]`` of the ring that finished the job.
        stage_receipts: signed stage receipts in ring order (a missing one is simply absent).
        sent / received: the coordinator's ``RollingDigest.as_dict()`` of frames sent to the head
            and results received from the tail.
        record: the decode record (tokens_per_s, ttft_s, total_s, spec, sampling, wire_dtype,
            heal_events, ...); JSON values only.
        segments: the coordinator's closed digests (``{side: "sent"|"received", peer, digest,
            frames}``): a heal that kept the survivors replaced the head (what was sent to it) or the
            tail (what it returned); ``sent`` / ``received`` then cover the frames since.
    """
    keep = ("tokens_per_s", "ttft_s", "total_s", "spec", "sampling", "wire_dtype", "wire_lossy", "heal_events",
            "context_limited")
    return {
        "schema": JOB_SCHEMA, "job_id": job_id, "nonce": nonce, "created_ms": now_ms(), "coordinator": coordinator,
        "model": model, "model_digest": model_digest, "num_layers": num_layers, "digest_alg": DIGEST_ALG,
        "prompt_tokens": len(prompt_ids), "prompt_digest": ids_digest(prompt_ids),
        "output_ids": [int(i) for i in output_ids], "output_digest": ids_digest(output_ids),
        "ring": ring, "stage_receipts": stage_receipts, "coordinator_sent": sent, "coordinator_received": received,
        **({"coordinator_segments": list(segments)} if segments else {}),
        **{k: record[k] for k in keep if k in record},
    }


@dataclass
class Verified:
    """A passed verification: the facts for a one-line summary."""

    job_id: str
    model: str
    stages: int
    new_tokens: int
    tokens_per_s: float | None
    healed: int

    def summary(self) -> str:
        ok = isinstance(self.tokens_per_s, (int, float)) and 0 < self.tokens_per_s < 1e9
        rate = f"{self.tokens_per_s:.1f} tok/s" if ok else "n/a tok/s"
        heal = f", healed {self.healed}x" if self.healed else ""
        return (f"OK job {self.job_id[:12]} model {self.model}: {self.stages} stage receipts, signatures and chain "
                f"valid, {self.new_tokens} tokens, {rate}{heal}")


def _fail(check: str, msg: str, stage: int | None = None) -> ReceiptInvalid:
    where = f"stage {stage}: " if stage is not None else ""
    exc = ReceiptInvalid(f"{check}: {where}{msg}")
    exc.check, exc.stage = check, stage  # type: ignore[attr-defined]
    return exc


def _need(obj: Any, name: str, types, where: str, stage: int | None = None):
    if not isinstance(obj, dict) or name not in obj:
        raise _fail("schema", f"{where} lacks field {name!r}", stage)
    v = obj[name]
    if not isinstance(v, types) or (isinstance(v, bool) and types is int):
        raise _fail("schema", f"{where} field {name!r} has type {type(v).__name__}", stage)
    return v


def verify_job(job: Any, *, expect_model_digest: str | None = None,
               expect_range_digests: dict[tuple[int, int], str] | None = None) -> Verified:
    """Verify a job receipt and every stage receipt in it; fail closed on the first bad check.

    Checks, in order: schema and types; each stage receipt's signature (by the PeerId it names);
    the coordinator's signature of the job; stage count and PeerIds against the ring; the ring's
    ranges tile ``[0, num_layers)`` exactly and each receipt covers its ring slot's range; nonce,
    job id and model digest in every stage receipt; the digest chain coordinator -> stage 0 -> ...
    -> tail -> coordinator; the output-id digest; heal events name spares that are in the ring.
    With ``expect_*`` (from a local copy of the model): the manifest and per-range weight digests.

    Args:
        job: the parsed JSON of ``receipts/<job_id>.json``.
        expect_model_digest: the model manifest digest the job must name.
        expect_range_digests: ``{(start, end): range digest}`` every stage must match.
    Returns:
        A ``Verified`` summary.
    Raises:
        ReceiptInvalid: with ``.check`` (schema, signature, job signature, missing stage, peer id,
            ranges, layer range, job id, nonce, model digest, chain, output digest, heal,
            range digest, repro, windows, answers) and ``.stage`` (ring index, or None for job-level checks).
    """
    try:
        return _verify_job(job, expect_model_digest, expect_range_digests)
    except ReceiptInvalid:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
        # a malformed value the checks above did not anticipate: still a failure, never a crash
        raise _fail("schema", f"malformed receipt ({type(exc).__name__}: {exc})") from None


def _verify_job(job: Any, expect_model_digest: str | None, expect_range_digests: dict | None) -> Verified:
    if not isinstance(job, dict) or job.get("schema") != JOB_SCHEMA:
        raise _fail("schema", f"not a {JOB_SCHEMA} document")
    for name, types in (("job_id", str), ("nonce", str), ("coordinator", str), ("model", str), ("model_digest", str),
                        ("num_layers", int), ("output_ids", list), ("output_digest", str), ("ring", list),
                        ("stage_receipts", list), ("coordinator_sent", dict), ("coordinator_received", dict),
                        ("sig", str)):
        _need(job, name, types, "job receipt")
    ring, receipts = job["ring"], job["stage_receipts"]
    for i, r in enumerate(receipts):
        if r is None:
            who = ring[i].get("peer_id") if i < len(ring) and isinstance(ring[i], dict) else "?"
            raise _fail("missing stage", f"no receipt from {who}", i)
        for name, types in (("schema", str), ("peer_id", str), ("layers", list), ("job_id", str), ("nonce", str),
                            ("coordinator", str), ("model_digest", str), ("input", dict), ("output", dict),
                            ("sig", str)):
            _need(r, name, types, "stage receipt", i)
        if r["schema"] != STAGE_SCHEMA:
            raise _fail("schema", f"receipt schema {r['schema']!r} is not {STAGE_SCHEMA}", i)
        if not signature_ok(r, r["peer_id"]):
            raise _fail("signature", f"signature of {r['peer_id']} does not verify", i)
    if not signature_ok(job, job["coordinator"]):
        raise _fail("job signature", f"the coordinator {job['coordinator']}'s signature does not verify")
    for i, s in enumerate(ring):
        for name, types in (("peer_id", str), ("layers", list)):
            _need(s, name, types, "ring entry", i)
    if len(receipts) < len(ring):
        gap = next((i for i, r in enumerate(receipts) if r["peer_id"] != ring[i]["peer_id"]), len(receipts))
        raise _fail("missing stage", f"no receipt from {ring[gap]['peer_id']} (layers {_fmt(ring[gap]['layers'])})",
                    gap)
    if len(receipts) > len(ring):
        raise _fail("missing stage", f"{len(receipts)} stage receipts for a ring of {len(ring)}", len(ring))
    for i, (s, r) in enumerate(zip(ring, receipts)):
        if r["peer_id"] != s["peer_id"]:
            raise _fail("peer id", f"receipt signed by {r['peer_id']} but the ring names {s['peer_id']}", i)
    _check_tiling([s["layers"] for s in ring], job["num_layers"])
    for i, (s, r) in enumerate(zip(ring, receipts)):
        if list(r["layers"]) != list(s["layers"]):
            raise _fail("layer range", f"receipt covers layers {_fmt(r['layers'])} but the ring slot is "
                                       f"{_fmt(s['layers'])}", i)
        if r["nonce"] != job["nonce"]:
            raise _fail("nonce", f"receipt carries nonce {r['nonce'][:16]}..., the job's is {job['nonce'][:16]}... "
                                 "(a receipt from another job)", i)
        if r["job_id"] != job["job_id"]:
            raise _fail("job id", f"receipt is for job {r['job_id']}, not {job['job_id']}", i)
        if r["coordinator"] != job["coordinator"]:
            raise _fail("coordinator", f"the stage served coordinator {r['coordinator']}, but the job receipt is "
                                       f"signed by {job['coordinator']}", i)
        if r["model_digest"] != job["model_digest"]:
            raise _fail("model digest", f"stage served model {r['model_digest'][:16]}..., the job names "
                                        f"{job['model_digest'][:16]}...", i)
        _check_openable(r, i)
    links = [("the coordinator", job["coordinator_sent"])] + [(f"stage {i}", r["output"]) for i, r in enumerate(receipts)]
    sinks = [r["input"] for r in receipts] + [job["coordinator_received"]]
    for i, ((src, sent), got) in enumerate(zip(links, sinks)):
        if sent.get("digest") != got.get("digest") or sent.get("frames") != got.get("frames"):
            dst = f"stage {i}" if i < len(receipts) else "the coordinator"
            raise _fail("chain", f"{dst} received {got.get('frames')} frames (digest {str(got.get('digest'))[:16]}...) "
                                 f"but {src} sent {sent.get('frames')} (digest {str(sent.get('digest'))[:16]}...)",
                        i if i < len(receipts) else len(receipts) - 1)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in job["output_ids"]):
        raise _fail("schema", "output_ids must be token ids (integers in [0, 2^31))")
    if ids_digest(job["output_ids"]) != job["output_digest"]:
        raise _fail("output digest", "the output ids do not match output_digest")
    if receipts and "answers" in receipts[-1]:
        _check_answers(receipts[-1]["answers"], job, len(receipts) - 1)
    _check_heal_events(job.get("heal_events") or [], [s["peer_id"] for s in ring])
    _check_segments(job.get("heal_events") or [], [s["peer_id"] for s in ring], receipts,
                    job.get("coordinator_segments", []))
    if expect_model_digest is not None and job["model_digest"] != expect_model_digest:
        raise _fail("model digest", f"job names model digest {job['model_digest'][:16]}..., the local model's is "
                                    f"{expect_model_digest[:16]}...")
    for i, r in enumerate(receipts):
        want = (expect_range_digests or {}).get(tuple(r["layers"]))
        if want is not None and r.get("range_digest") != want:
            raise _fail("range digest", f"weights of layers {_fmt(r['layers'])} digest to "
                                        f"{str(r.get('range_digest'))[:16]}..., the local model's to {want[:16]}...", i)
    return Verified(job["job_id"], job["model"], len(receipts), len(job["output_ids"]), job.get("tokens_per_s"),
                    len(job.get("heal_events") or []))


def _check_answers(answers: Any, job: dict, i: int) -> None:
    """The tail's signed answers must be the job's output ids: output id ``k`` is the token the tail sent
    after position ``prompt_tokens - 1 + k``. Positions it did not answer in the session that finished
    the job (a heal replayed them as input) are skipped; the last output id must be answered."""
    ok = isinstance(answers, dict) and type(answers.get("from")) is int and answers["from"] >= 0 \
        and isinstance(answers.get("ids"), list) and type(job.get("prompt_tokens")) is int
    if not ok or not all(t is None or (type(t) is int and t >= 0) for t in answers["ids"]):
        raise _fail("answers", "the tail's answers must be {from: position, ids: [token id or null, ...]}", i)
    out, first = job["output_ids"], job["prompt_tokens"] - 1 - answers["from"]
    for k, t in enumerate(out):
        j = first + k
        got = answers["ids"][j] if 0 <= j < len(answers["ids"]) else None
        if (got is None and k == len(out) - 1) or (got is not None and got != t):
            raise _fail("answers", f"output id {k} is {t}, but the tail signed "
                                   f"{'no answer' if got is None else got} at position {job['prompt_tokens'] - 1 + k}"
                                   " (the coordinator's output is not what the ring answered)", i)


def _check_openable(r: dict, i: int) -> None:
    """A stage receipt's optional ``repro`` (a class whose id is the digest of its facts, naming the
    receipt's own weights and dtype) and ``windows`` (a well-formed Merkle commitment: as many
    leaves as windows of ``size`` over ``positions``). Receipts from before these fields pass."""
    from swarm import repro

    if "repro" in r:
        try:
            cls = repro.parse(r["repro"])
        except ValueError as exc:
            raise _fail("repro", str(exc), i) from None
        for fact, field_name in (("weights", "range_digest"), ("dtype", "dtype")):
            if cls.facts.get(fact) != r.get(field_name):
                raise _fail("repro", f"the class names {fact} {str(cls.facts.get(fact))[:16]}, the receipt's "
                                     f"{field_name} is {str(r.get(field_name))[:16]}", i)
    if "windows" in r:
        w = r["windows"]
        ints = isinstance(w, dict) and all(type(w.get(k)) is int and w[k] >= 0 for k in ("size", "positions", "leaves"))
        root = w.get("root") if isinstance(w, dict) else None
        if not (ints and w["size"] >= 1 and isinstance(root, str) and len(root) == 64
                and w["leaves"] == -(-w["positions"] // w["size"])):
            raise _fail("windows", "the window commitment must be {size >= 1, positions, leaves = "
                                   "ceil(positions / size), root: 64 hex digits}", i)


def _check_heal_events(events: Any, slots: list[str]) -> None:
    """Each heal event's replacement (``spares``: its PeerIds in ring order, or the one ``spare``)
    must sit at its ``stage`` position of the ring as that heal left it. Walked back from the final
    ring: undoing an event puts unknown stages (None) where its replacement sat, one per position it
    took over (``positions``), so an earlier event whose stage was replaced again later is not held
    to the final ring there."""
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise _fail("schema", "heal_events must be a list of maps")
    slots = list(slots)
    for e in reversed(events):
        idx = e.get("stage")
        new = e.get("spares") or [e.get("spare")]
        if not isinstance(new, list) or not isinstance(idx, int) or isinstance(idx, bool) or not (
                0 <= idx and idx + len(new) <= len(slots)):
            raise _fail("heal", f"heal event at stage {idx!r} names {new!r}, which does not fit the final ring")
        if any(have is not None and have != want for have, want in zip(slots[idx:idx + len(new)], new)):
            raise _fail("heal", f"heal event names spare {','.join(map(str, new))} at stage {idx}, which is not "
                                "in the final ring")
        slots[idx:idx + len(new)] = [None] * _positions(e)


def _positions(event: dict) -> int:
    """Ring positions a heal event's replacement took over (``HealEvent.positions``; 1 when absent:
    receipts from before re-routed windows). Raises ReceiptInvalid (check ``heal``) on a bad value."""
    n = event.get("positions", 1)
    if type(n) is not int or n < 1:
        raise _fail("heal", f"heal event at stage {event.get('stage')!r} has positions {n!r}: a count >= 1 is needed")
    return n


# heals that keep the survivors' session (swarm.heal.HealEvent.replay): the digests of the neighbours
# restart at them. At a "shadow" heal the predecessor's (or, for a head, the coordinator's) new output
# digest continues the digest of the frames it mirrored to the shadow, which the shadow's input digest
# also began with, so the chain check covers the mirrored frames too.
KEPT_MODES = ("survivors_kept", "shadow")


def _check_segments(events: list, peers: list[str], receipts: list, coordinator_segments: Any) -> None:
    """Digests that restart mid-session must be explained by heals that kept the survivors' session.

    A heal with ``replay: "survivors_kept"`` or ``"shadow"`` re-points the neighbours of the replaced stage: the
    predecessor's output digest and the successor's input digest (the coordinator's ``sent`` for a
    lost head, ``received`` for a lost tail) are closed (``segments``, naming the replaced PeerId)
    and restart, and the fresh digests chain to the replacement's, which the chain check covers.
    Only the heals since the last full replay count: a full replay opened a fresh session, whose
    receipts these are. Every closed segment must name a stage such a heal replaced (``replaced``),
    and each such heal must have closed the digests of the neighbours it re-pointed that sit in the
    final ring. Fails closed (check ``heal``).
    """
    if not isinstance(coordinator_segments, list):
        raise _fail("schema", "coordinator_segments must be a list")
    last_full = max((i for i, e in enumerate(events) if e.get("replay", "full") not in KEPT_MODES), default=-1)
    kept = [(i, e) for i, e in enumerate(events) if i > last_full]
    replaced: set[str] = set()
    for _, e in kept:
        names = e.get("replaced")
        if not isinstance(names, list) or not names or not all(isinstance(p, str) for p in names):
            raise _fail("heal", f"heal event at stage {e.get('stage')!r} kept the survivors but names no replaced "
                                "stage")
        replaced.update(names)
    owners = [(f"stage {i}", i, r.get("segments", [])) for i, r in enumerate(receipts)]
    owners.append(("the coordinator", None, coordinator_segments))
    found: dict[tuple, int] = {}  # (owner, side, peer) -> closed segments
    for who, idx, segs in owners:
        if not isinstance(segs, list):
            raise _fail("schema", f"{who}'s segments must be a list", idx)
        for seg in segs:
            for name, types in (("side", str), ("peer", str), ("digest", str), ("frames", int)):
                _need(seg, name, types, f"{who}'s segment", idx)
            if seg["peer"] not in replaced:
                raise _fail("heal", f"{who}'s {seg['side']} digest restarts after {seg['frames']} frames from "
                                    f"{seg['peer']}, but no heal that kept the survivors replaced that stage", idx)
            key = ("coordinator" if idx is None else peers[idx], seg["side"], seg["peer"])
            found[key] = found.get(key, 0) + 1
    slots: list = list(peers)
    for i, e in reversed(list(enumerate(events))):  # walk back from the final ring, as _check_heal_events
        idx, new = e["stage"], e.get("spares") or [e.get("spare")]
        if i > last_full:
            names = e["replaced"]
            needs = []
            if idx == 0:
                needs.append(("coordinator", "sent"))
            elif slots[idx - 1] is not None:
                needs.append((slots[idx - 1], "output"))
            if idx + len(new) == len(slots):
                needs.append(("coordinator", "received"))
            elif slots[idx + len(new)] is not None:
                needs.append((slots[idx + len(new)], "input"))
            for owner, side in needs:
                if not any(found.get((owner, side, p)) for p in names):
                    where = "the coordinator" if owner == "coordinator" else owner
                    raise _fail("heal", f"the heal at stage {idx} kept the survivors, but {where} shows no "
                                        f"{side} digest closed at the replaced stage {names[-1]}")
        slots[idx:idx + len(new)] = [None] * _positions(e)


def _fmt(layers: Any) -> str:
    try:
        return f"[{layers[0]}, {layers[1]})"
    except (TypeError, IndexError, KeyError):
        return repr(layers)


def _check_tiling(ranges: list, num_layers: int) -> None:
    try:
        if not all(isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in ranges):
            raise ValueError(f"layer ranges must be [start, end] integer pairs, got {ranges!r}"[:200])
        check_tiling([LayerRange(*r) for r in ranges], num_layers)
    except (ConfigError, ValueError, TypeError) as exc:
        raise _fail("ranges", f"the ring's ranges do not tile [0, {num_layers}): {exc}") from None


def save(doc: dict, directory) -> str:
    """Write a job receipt as ``<directory>/<job_id>.json`` (atomically: temp file + rename).

    Returns:
        The path written. Raises OSError when the directory cannot be created or written.
    """
    path = Path(directory) / f"{doc['job_id']}.json"
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return str(path)


def load(path) -> Any:
    """Read a receipt file as JSON.

    Raises:
        ReceiptInvalid (check ``schema``): unreadable, empty, not JSON, or nested too deeply.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
        if not data.strip():
            raise _fail("schema", f"{path} is empty")
        return json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:
        raise _fail("schema", f"cannot read {path}: {type(exc).__name__}: {str(exc)[:200]}") from None


def verify_files(paths: list, **expect) -> list[tuple[str, Verified | ReceiptInvalid]]:
    """Verify job receipt files; a nonce seen in two files fails the later one (a replayed job).

    Returns:
        ``[(path, Verified or ReceiptInvalid)]`` in input order; unreadable or non-JSON files fail
        with check ``schema``.
    """
    seen: dict[str, str] = {}
    out: list = []
    done: set[str] = set()
    for p in paths:
        real = os.path.realpath(p)
        if real in done:  # the same file named twice is one receipt, not a replay
            continue
        done.add(real)
        try:
            job = load(p)
        except ReceiptInvalid as exc:
            out.append((str(p), exc))
            continue
        try:
            v = verify_job(job, **expect)
            if job["nonce"] in seen:
                raise _fail("nonce", f"nonce {job['nonce'][:16]}... was already used by {seen[job['nonce']]} "
                                     "(a replayed job)")
            seen[job["nonce"]] = str(p)
            out.append((str(p), v))
        except ReceiptInvalid as exc:
            out.append((str(p), exc))
    return out

"""Signed stage records: what a stage announces on the DHT, and the checks every reader applies.

Owns: ``StageRecord``, its canonical encoding and signing (``sign_record``), ``open_record`` (the validator's
checks) and ``select_record`` (which of two values for one key wins). No torch, no trio, no clock: time is an
argument. The format: docs/protocol.md, "The swarm's DHT".
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import msgpack

from swarm import repro
from swarm.errors import SwarmError
from swarm.transport.identity import peer_id_of, sign, verify_peer_signature

NAMESPACE = "swarm-stage"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024
MAX_TTL_S = 600.0  # a reader refuses an expiry further out: a leaked record dies within 10 minutes
DEFAULT_TTL_S = 120.0
STATES = ("joining", "online", "draining")
_SIGN_DOMAIN = b"swarm-stage-record/1\x00"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class RecordInvalid(SwarmError):
    """A DHT value is not a valid, current, correctly signed stage record.

    Attributes:
        kind: which check failed: ``"expired"``, ``"future"`` (expires further out than
            ``MAX_TTL_S``), ``"model"`` (not an accepted model) or ``"invalid"`` (encoding,
            fields, key or signature).
    """

    def __init__(self, message: str, kind: str = "invalid"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class StageRecord:
    """One stage's signed announcement.

    Args:
        peer_id: base58 PeerId of the stage (the signer).
        model_id: 64-hex model id of its weights (per-tensor sha256 manifest).
        model_name: the name the operator gave (display only; never trusted for matching).
        num_layers: L, the model's decoder layer count.
        layers: ``(start, end)``: the block of layers it holds, ``0 <= start < end <= L``.
        addrs: multiaddrs (ending in ``/p2p/<peer_id>``) it can be dialed at.
        relay_addrs: circuit addresses through relays (empty when directly reachable).
        dtype, device: its compute dtype (e.g. ``float32``) and device kind (``cpu``/``cuda``).
        max_ctx: the longest session (positions) it accepts.
        free_kv_bytes: KV budget it has left now, in bytes.
        kv_bytes_per_token_layer: KV bytes one position costs in one layer.
        sessions: sessions open now.
        state: ``joining`` | ``online`` | ``draining``.
        version: swarm software version.
        throughput_tps: decode steps per second it measured on its whole block at start.
        rtt_ms: ``{peer_id: round-trip ms}`` it measured to holders of the layers after its block.
        seq: sequence number; a newer record has a higher one.
        expires_at: unix seconds after which readers reject it.
        repro: its reproducibility class for its whole block (``swarm.repro``: ``{"id", "facts"}``,
            the id checked against the facts by every reader), so an auditor finds the stages whose
            bits it may compare; empty in records of stages that predate it.
        audit_rate: the rate of its auditor role (``swarm stage --audit-rate``: it accepts ``audit_offer``
            frames and audits the offered jobs' stages within its layers while idle); 0: no auditor role.
    """

    peer_id: str
    model_id: str
    model_name: str
    num_layers: int
    layers: tuple[int, int]
    addrs: tuple[str, ...]
    relay_addrs: tuple[str, ...] = ()
    dtype: str = "float32"
    device: str = "cpu"
    max_ctx: int = 0
    free_kv_bytes: int = 0
    kv_bytes_per_token_layer: int = 0
    sessions: int = 0
    state: str = "online"
    version: str = ""
    throughput_tps: float = 0.0
    rtt_ms: dict = field(default_factory=dict)
    seq: int = 0
    expires_at: float = 0.0
    repro: dict = field(default_factory=dict)  # {"id", "facts"}: its reproducibility class; {}: not stated
    audit_rate: float = 0.0  # its auditor role's rate; 0: none (records before the role lack it)

    def to_body(self) -> bytes:
        """Canonical msgpack bytes of the record (the signed part)."""
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["addrs"], d["relay_addrs"] = list(self.addrs), list(self.relay_addrs)
        d["rtt_ms"] = {k: float(v) for k, v in sorted(self.rtt_ms.items())}
        d["v"] = RECORD_VERSION
        return msgpack.packb(dict(sorted(d.items())), use_bin_type=True)


_FIELDS = frozenset(StageRecord.__dataclass_fields__)


def record_key(peer_id: str) -> str:
    """The DHT key of a stage's record: ``/swarm-stage/<peer_id>`` (well under the 128-byte limit)."""
    return f"/{NAMESPACE}/{peer_id}"


def sign_record(key_pair, record: StageRecord) -> bytes:
    """Sign a record with the stage's node key.

    Args:
        key_pair: the ed25519 libp2p KeyPair whose PeerId is ``record.peer_id``.
        record: the record to publish.
    Returns:
        The DHT value: msgpack ``{"body": bytes, "sig": 64 bytes}``.
    Raises:
        RecordInvalid: the key does not belong to ``record.peer_id``, or the record is too large.
    """
    if peer_id_of(key_pair) != record.peer_id:
        raise RecordInvalid(f"record names {record.peer_id} but the key is {peer_id_of(key_pair)}")
    body = record.to_body()
    value = msgpack.packb({"body": body, "sig": sign(key_pair, _SIGN_DOMAIN + body)}, use_bin_type=True)
    if len(value) > MAX_RECORD_BYTES:
        raise RecordInvalid(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
    return value


def open_record(key: str, value: bytes, *, now: float, accept_models: frozenset[str] | None = None) -> StageRecord:
    """Check a DHT value and return the record it carries.

    Checks, failing closed: size; encoding and field types; that ``key`` is the record key of the
    PeerId in the body; the ed25519 signature by that PeerId; that it has not expired and expires
    no more than ``MAX_TTL_S`` from ``now``; the layer range, state and model id; and, when
    ``accept_models`` is given, that the model id is one of them.

    Args:
        key: the DHT key the value was stored under.
        value: the stored bytes.
        now: current unix time in seconds.
        accept_models: model ids this reader accepts (None: any well-formed one).
    Returns:
        The StageRecord.
    Raises:
        RecordInvalid: naming the first check that failed.
    """
    if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_RECORD_BYTES:
        raise RecordInvalid("record value is not bytes or is too large")
    try:
        outer = msgpack.unpackb(bytes(value), raw=False)
        body, sig = outer["body"], outer["sig"]
        d = msgpack.unpackb(body, raw=False)
        if not isinstance(d, dict) or d.pop("v", None) != RECORD_VERSION:
            raise RecordInvalid("unknown record version")
        d["layers"] = tuple(d["layers"])
        d["addrs"], d["relay_addrs"] = tuple(d["addrs"]), tuple(d["relay_addrs"])
        # fields a later version added are ignored (the signature covers them all): a newer stage's
        # record still opens here. Records before ``repro`` lacked it, and open with its default.
        record = StageRecord(**{k: v for k, v in d.items() if k in _FIELDS})
    except RecordInvalid:
        raise
    except (ValueError, TypeError, KeyError, msgpack.exceptions.ExtraData) as e:
        raise RecordInvalid(f"malformed record: {e!r}") from None
    _check_types(record)
    if key != record_key(record.peer_id):
        raise RecordInvalid(f"key {key!r} does not name the signer {record.peer_id}")
    if not isinstance(sig, bytes) or not verify_peer_signature(record.peer_id, _SIGN_DOMAIN + body, sig):
        raise RecordInvalid(f"bad signature on the record of {record.peer_id}")
    if not record.expires_at > now:
        raise RecordInvalid(f"record of {record.peer_id} expired {now - record.expires_at:.0f} s ago", "expired")
    if record.expires_at - now > MAX_TTL_S:
        raise RecordInvalid(f"record of {record.peer_id} expires too far out ({record.expires_at - now:.0f} s)",
                            "future")
    if accept_models is not None and record.model_id not in accept_models:
        raise RecordInvalid(f"record of {record.peer_id} is for model {record.model_id[:16]}, not accepted here",
                            "model")
    return record


def select_record(key: str, values: list[bytes], *, now: float) -> int:
    """Index of the value that wins for one key: the valid one with the highest ``seq``.

    Ties go to the later expiry, then to the earlier index; invalid values never win.
    """
    best, best_rank = 0, (-1, -math.inf)
    for i, value in enumerate(values):
        try:
            r = open_record(key, value, now=now)
        except RecordInvalid:
            continue
        if (r.seq, r.expires_at) > best_rank:
            best, best_rank = i, (r.seq, r.expires_at)
    return best


def _check_types(r: StageRecord) -> None:
    def bad(what: str) -> RecordInvalid:
        return RecordInvalid(f"record field {what} is invalid")
    ints = (r.num_layers, r.max_ctx, r.free_kv_bytes, r.kv_bytes_per_token_layer, r.sessions, r.seq)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints):
        raise bad("counts")
    if not isinstance(r.peer_id, str) or not isinstance(r.model_id, str) or not _HEX64.match(r.model_id):
        raise bad("peer_id/model_id")
    if not (len(r.layers) == 2 and all(isinstance(x, int) for x in r.layers)
            and 0 <= r.layers[0] < r.layers[1] <= r.num_layers):
        raise bad(f"layers {r.layers!r}")
    if r.state not in STATES:
        raise bad(f"state {r.state!r}")
    for text in (r.model_name, r.dtype, r.device, r.version, *r.addrs, *r.relay_addrs):
        if not isinstance(text, str) or len(text) > 512:
            raise bad("strings")
    if not r.addrs and not r.relay_addrs:
        raise bad("addrs (none)")
    if not isinstance(r.audit_rate, (int, float)) or isinstance(r.audit_rate, bool) or not 0 <= r.audit_rate <= 1:
        raise bad("audit_rate")
    for x in (r.throughput_tps, r.expires_at):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
            raise bad("numbers")
    if r.repro != {}:
        try:
            repro.parse(r.repro)
        except ValueError as exc:
            raise bad(f"repro ({exc})") from None
    if not isinstance(r.rtt_ms, dict) or len(r.rtt_ms) > 64 or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
            for k, v in r.rtt_ms.items()):
        raise bad("rtt_ms")

"""Typed frames of the ring protocol ``/swarm/ring/1``: one frozen dataclass per frame type.

Owns: each type's fields, :meth:`Frame.to_wire` (the msgpack map, ``v`` and ``type`` first) and :func:`of` (the
typed frame of a map that :func:`swarm.wire.validate` has checked). The fields' meanings, optional fields and
the ``extra`` a newer peer adds: docs/protocol.md, "Frames".
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

VERSION = 1

SignedInt = int  # an integer that may be -1 ("nothing yet")
TensorMap = dict  # {"dtype", "shape", "data"[, "scale"]}: swarm.wire.encode_tensor's map


@dataclass(frozen=True, slots=True)
class Frame:
    """A frame's common part. Subclasses name their ``TYPE`` (the wire's ``type``)."""

    TYPE: ClassVar[str] = ""
    REQUIRED: ClassVar[tuple[str, ...]] = ()  # set by _register: the fields without a default
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def to_wire(self) -> dict[str, Any]:
        """The frame as the msgpack map it travels as: ``v``, ``type``, the required fields, the
        optional ones that are set, then ``extra``."""
        out: dict[str, Any] = {"v": VERSION, "type": self.TYPE}
        for name in self.REQUIRED:
            out[name] = getattr(self, name)
        for name in self.OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.extra:
            out.update(self.extra)
        return out


FRAME_TYPES: dict[str, type[Frame]] = {}


def _register(cls: type[Frame]) -> type[Frame]:
    names = [f for f in fields(cls) if f.name != "extra"]
    cls.REQUIRED = tuple(f.name for f in names if f.default is MISSING and f.default_factory is MISSING)
    cls.OPTIONAL = tuple(f.name for f in names if f.name not in cls.REQUIRED)
    FRAME_TYPES[cls.TYPE] = cls
    return cls


def frame_type(cls):
    """Declare a frame type: a frozen, slotted dataclass whose unknown wire fields go to ``extra``."""
    cls.__annotations__["extra"] = "dict[str, Any]"
    cls.extra = field(default_factory=dict, kw_only=True, compare=False, repr=False)
    return _register(dataclass(frozen=True, slots=True)(cls))


def of(msg: dict[str, Any]) -> Frame:
    """The typed frame of a checked map (``swarm.wire.validate`` has run). Raises KeyError for an
    unknown ``type``."""
    cls = FRAME_TYPES[msg["type"]]
    given = dict(msg)
    del given["v"], given["type"]
    if "extra" not in given:
        try:
            return cls(**given)  # an optional field given as None is the default
        except TypeError:
            pass  # a field this version does not know
    known = cls.__dataclass_fields__
    return cls(**{k: v for k, v in given.items() if k in known and k != "extra"},
               extra={k: v for k, v in given.items() if k not in known or k == "extra"})


# ---- session set-up and teardown


@frame_type
class Info(Frame):
    """Coordinator -> stage: what do you serve? Answered by :class:`InfoOk`."""

    TYPE = "info"


@frame_type
class InfoOk(Frame):
    """Stage -> coordinator: its identity, block and load (docs/protocol.md lists every field)."""

    TYPE = "info_ok"
    peer_id: str
    model: str
    model_digest: str
    layers: list
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    max_ctx: int
    model_id: str | None = None
    addrs: list | None = None
    sessions: int | None = None
    kv_bytes: int | None = None
    kv_reserved_bytes: int | None = None
    draining: bool | None = None
    batching: dict | None = None
    kernels: dict | None = None
    repro: dict | None = None
    prefix_cache: dict | None = None
    auditor: dict | None = None
    retention: dict | None = None
    hops: list | None = None
    timing: dict | None = None


@frame_type
class Open(Frame):
    """Coordinator -> stage: assign ``session`` (signed: :func:`swarm.receipts.assignment_bytes`).

    ``next`` is the successor's multiaddr (None at the tail); ``max_len`` positions (0: the stage's
    own); optional: ``prev`` (the predecessor's PeerId), ``sampling`` (tail), ``wire_dtype``, ``job``
    (``{id, nonce}``), ``batch``, ``layers`` (``[start, end)``), ``shadow``, ``mirror`` with
    ``mirror_until``, ``prefix`` (``{ids, ns}``)."""

    TYPE = "open"
    session: str
    next: str | None
    max_len: int
    sig: str
    prev: str | None = None
    sampling: dict | None = None
    wire_dtype: str | None = None
    job: dict | None = None
    batch: bool | None = None
    layers: list | None = None
    shadow: bool | None = None
    mirror: str | None = None
    mirror_until: int | None = None
    prefix: dict | None = None


@frame_type
class OpenOk(Frame):
    """Stage -> coordinator: the session is open; ``reused``: positions [0, n) from the prefix cache."""

    TYPE = "open_ok"
    session: str
    reused: int | None = None


@frame_type
class Close(Frame):
    """Coordinator -> stage: drop the session; ``keep``: its committed ids, to cache their blocks' KV."""

    TYPE = "close"
    session: str
    keep: list | None = None


@frame_type
class CloseOk(Frame):
    TYPE = "close_ok"
    session: str


@frame_type
class Drain(Frame):
    """An ``--admin`` peer -> stage: drain and exit."""

    TYPE = "drain"


@frame_type
class DrainOk(Frame):
    TYPE = "drain_ok"
    sessions: int


# ---- data: rows around the ring


class Rows:
    """What a data frame (:class:`Forward`, :class:`Refill`) carries: ``tokens`` or ``hidden`` rows."""

    __slots__ = ()

    @property
    def rows(self) -> int:
        """T, the positions the frame carries."""
        return len(self.tokens) if self.tokens is not None else int(self.hidden["shape"][1])


@frame_type
class Forward(Frame, Rows):
    """Rows ``[pos, pos + T)`` of a chunk: ``tokens`` (to the head) or ``hidden`` (1, T, D), exactly
    one; ``logits_from``: the tail answers only for rows from there on."""

    TYPE = "forward"
    session: str
    epoch: int
    pos: int
    chunk: int
    tokens: list | None = None
    hidden: TensorMap | None = None
    logits_from: int | None = None


@frame_type
class Refill(Frame, Rows):
    """A heal's rows ``[pos, pos + T)``: they only fill the KV caches of the stages replacing a lost
    range, up to the stage whose layers end at ``until``; ``tokens`` or ``hidden``, as :class:`Forward`."""

    TYPE = "refill"
    session: str
    epoch: int
    pos: int
    until: int
    tokens: list | None = None
    hidden: TensorMap | None = None


@frame_type
class Result(Frame):
    """Tail -> coordinator: ``token_ids``, for each fed position q from ``logits_from`` (default
    ``pos``) on, the token for q + 1."""

    TYPE = "result"
    session: str
    epoch: int
    pos: int
    chunk: int
    token_ids: list
    logits_from: int | None = None


@frame_type
class Cancel(Frame):
    """Coordinator -> stage (control stream): frames of ``session`` below ``epoch`` are stale."""

    TYPE = "cancel"
    session: str
    epoch: int


# ---- healing


@frame_type
class Progress(Frame):
    """Coordinator -> stage (control stream): heartbeat and heal probe."""

    TYPE = "progress"
    session: str


@frame_type
class ProgressOk(Frame):
    """Stage -> coordinator: the highest chunk ids ``received`` and ``sent`` on (-1: none) and state."""

    TYPE = "progress_ok"
    session: str
    received: SignedInt
    sent: SignedInt
    known: bool | None = None
    busy: bool | None = None
    lost_successor: bool | None = None
    draining: bool | None = None


@frame_type
class Repair(Frame):
    """Coordinator -> a surviving stage: keep the session's KV, take frames of ``epoch`` on (signed as
    :class:`Open`); optional new neighbours ``prev`` / ``next``, ``resend`` positions [0, n) to ``next``
    as refills up to layer ``until``, ``mirror``: promote the shadow ``next``."""

    TYPE = "repair"
    session: str
    epoch: int
    sig: str
    prev: str | None = None
    next: str | None = None
    resend: int | None = None
    until: int | None = None
    mirror: bool | None = None


@frame_type
class RepairOk(Frame):
    """Stage -> coordinator: ``kv_len`` positions held, ``resent`` posted as refills; ``mirrored``:
    positions [0, n) its mirror had delivered."""

    TYPE = "repair_ok"
    session: str
    kv_len: int
    resent: int
    mirrored: int | None = None


# ---- receipts and audits


@frame_type
class Receipt(Frame):
    """Flows head -> tail behind the session's frames: sign your receipt."""

    TYPE = "receipt"
    session: str


@frame_type
class ReceiptOk(Frame):
    """Stage -> coordinator: its signed stage receipt."""

    TYPE = "receipt_ok"
    session: str
    receipt: dict


@frame_type
class Audit(Frame):
    """Anyone -> stage: open window ``window`` of job ``job`` of ``session``."""

    TYPE = "audit"
    session: str
    job: str
    window: int


@frame_type
class AuditOk(Frame):
    """Stage -> the asker: the window's ``opening`` (rows, Merkle path, signature)."""

    TYPE = "audit_ok"
    session: str
    job: str
    window: int
    opening: dict


@frame_type
class AuditOffer(Frame):
    """A job's coordinator -> a stage in the auditor role: the signed job receipt ``job``."""

    TYPE = "audit_offer"
    job: dict


@frame_type
class AuditOfferOk(Frame):
    TYPE = "audit_offer_ok"
    job: str
    queued: int
    waiting: int


@frame_type
class Error(Frame):
    """A refusal: ``reason`` (one line), ``code`` (docs/protocol.md), the ``session`` and ``epoch``
    it concerns where it has them; ``since_ms``: with ``no_job``, when the stage (re)started."""

    TYPE = "error"
    reason: str
    code: str
    session: str | None = None
    epoch: int | None = None
    since_ms: int | None = None


@dataclass(frozen=True, slots=True)
class LinkLost:
    """Not a frame: what a stream's reader hands on when the stream ended (``reason``)."""

    reason: str
    session: None = None  # so code that filters incoming frames by session reads it like a frame

    TYPE: ClassVar[str] = "_lost"


Incoming = Frame | LinkLost  # what a link's reader task delivers

"""Frames of the ring protocol: schema, validation, and tensors as raw bytes.

Owns: the message types of ``/swarm/ring/1``, their field types and ranges (``validate``), and tensors to and
from ``{"dtype", "shape", "data"}`` maps (raw little-endian bytes, no pickle). Framing on the stream is
``swarm.transport.framing``; the format is docs/protocol.md.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import torch

from swarm import frames
from swarm.errors import ContextOverflow, ProtocolError
from swarm.frames import Error, Frame, Open, Repair

PROTOCOL_ID = "/swarm/ring/1"
VERSION = frames.VERSION

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
LOSSLESS = {"float32", "float64"}  # for float32/float64 stages; narrower wire dtypes are opt-in and lossy
FP8_MAX = 448.0  # largest finite float8_e4m3fn

_SIGNED = ("signed",)  # an int that may be -1 (nothing yet)
_WIRE_TYPES = {"str": (str,), "int": (int,), "str | None": (str, type(None)), "list": (list,), "dict": (dict,),
               "SignedInt": _SIGNED}

# type -> {required field: allowed python types}, from the frame classes of swarm.frames (their optional
# fields are checked by _CHECKS); "v" and "type" are checked for every frame.
SCHEMA: dict[str, dict[str, tuple]] = {
    kind: {name: _WIRE_TYPES[cls.__dataclass_fields__[name].type] for name in cls.REQUIRED}
    for kind, cls in frames.FRAME_TYPES.items()
}
MAX_SESSION_CHARS = 128
MAX_TOKENS_PER_FRAME = 1 << 18  # a prefill chunk longer than any context we serve
MAX_INT = 2**31 - 1


def frame(kind: str, **fields: Any) -> dict:
    """A raw frame map of ``kind`` with the protocol version set, unchecked (for tests of the wire
    itself; swarm's own code sends the typed frames of :mod:`swarm.frames`)."""
    return {"v": VERSION, "type": kind, **fields}


def open_frame(key_pair, session: str, next_addr: str | None, max_len: int, *, prev: str | None = None,
               **extra: Any) -> Open:
    """A signed ``open`` frame: the coordinator (``key_pair``) assigns ``session`` at one stage.

    Args:
        key_pair: the coordinator's node key (its PeerId is what the stage sees on the stream).
        next_addr: the successor's multiaddr (with /p2p/PeerId), None at the tail.
        prev: the predecessor stage's PeerId, None at the head (whose input is the coordinator).
        extra: the optional fields of :class:`swarm.frames.Open` (sampling, wire_dtype, job, batch,
            layers, shadow, mirror with mirror_until, prefix).
    """
    from swarm.receipts import assignment_bytes
    from swarm.transport.identity import peer_id_of, sign

    unsigned = Open(session=session, next=next_addr, max_len=max_len, sig="", prev=prev, **extra)
    return replace(unsigned, sig=sign(key_pair, assignment_bytes(unsigned, peer_id_of(key_pair))).hex())


def repair_frame(key_pair, session: str, epoch: int, *, prev: str | None = None, next_addr: str | None = None,
                 resend: int | None = None, until: int | None = None, mirror: bool = False) -> Repair:
    """A signed ``repair`` frame: the coordinator (``key_pair``) re-points a surviving stage of
    ``session`` after a heal, keeping its KV cache (see docs/protocol.md, "Healing on the wire").

    Args:
        epoch: the session's epoch from now on (older frames are stale).
        prev: the new predecessor's PeerId (the stage after a replaced range).
        next_addr: the new successor's multiaddr with /p2p/ (the stage before a replaced range).
        resend: resend the hidden states this stage sent for positions [0, resend) to ``next_addr``
            as ``refill`` frames; ``until``: the end layer of the replaced range (required with it).
        mirror: ``next_addr`` is the shadow this stage mirrors to: promote it, resending only the
            positions of ``[0, resend)`` the mirror did not deliver (refused when the mirror was dropped).
    """
    from swarm.receipts import assignment_bytes
    from swarm.transport.identity import peer_id_of, sign

    unsigned = Repair(session=session, epoch=epoch, sig="", prev=prev, next=next_addr, resend=resend, until=until,
                      mirror=True if mirror else None)
    return replace(unsigned, sig=sign(key_pair, assignment_bytes(unsigned, peer_id_of(key_pair))).hex())


def is_lossy(wire_dtype: str | None, stage_dtype: str) -> bool:
    """True when hidden states of ``stage_dtype`` lose precision as ``wire_dtype`` (None = the stage's own)."""
    if wire_dtype is None or wire_dtype == stage_dtype:
        return False
    exact_into = {"float64": {"float32", "bfloat16", "float16"}, "float32": {"bfloat16", "float16"}}
    return stage_dtype not in exact_into.get(wire_dtype, set())


def error_frame(reason: str, code: str = "bad_request", session: str | None = None,
                epoch: int | None = None) -> Error:
    """An error reply; ``code`` is one of bad_request, no_session, overflow, internal, unavailable,
    forbidden (the sender is not the peer this session or stage accepts that frame from), busy (the
    KV budget is full), no_state (a ``repair`` asks for state the stage does not hold: the session's
    KV or the hidden states it sent), no_job (an ``audit`` names a job the stage does not hold: never
    seen, or evicted from its retention), rate_limited (too many ``audit`` or ``audit_offer`` requests from
    that PeerId)."""
    return Error(reason=reason, code=code, session=session, epoch=epoch)


def validate(msg: Any) -> Frame:
    """Check a decoded frame map against the schema and return it typed (:mod:`swarm.frames`).

    The envelope (a map, ``v``, a known ``type``) first, then the kind's required fields
    (``SCHEMA``), then the kind's own checks in order (``_CHECKS``: optional fields, the session
    id, fields that go together). Every check raises on the first fault it finds.

    Raises:
        ProtocolError: naming the first bad field (wrong version, unknown type, missing field,
            wrong type, negative or oversized integer, over-long session id).
    """
    kind = _check_envelope(msg)
    _check_required(kind, msg)
    for check in _CHECKS.get(kind, (_check_session,)):
        check(msg)
    return frames.of(msg)


def _check_envelope(msg: Any) -> str:
    """The frame's type, once ``msg`` is a map of this protocol version with a known type."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame is a {type(msg).__name__}, not a map")
    if type(msg.get("v")) is not int or msg.get("v") != VERSION:
        raise ProtocolError(f"unsupported protocol version {msg.get('v')!r} (this node speaks {VERSION})")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise ProtocolError(f"unknown frame type {kind!r}"[:200])
    return kind


def _check_required(kind: str, msg: dict) -> None:
    """Every field ``SCHEMA[kind]`` names is present with an allowed type; integers in [0, MAX_INT]
    (``_SIGNED``: [-1, MAX_INT]); a bool is never an integer."""
    for name, types in SCHEMA[kind].items():
        if name not in msg:
            raise ProtocolError(f"{kind} frame lacks field {name!r}")
        value = msg[name]
        if types is _SIGNED:
            if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value <= MAX_INT:
                raise ProtocolError(f"{kind} frame field {name!r} must be an integer >= -1")
            continue
        if not isinstance(value, types) or isinstance(value, bool):
            raise ProtocolError(f"{kind} frame field {name!r} has type {type(value).__name__}")
        if isinstance(value, int) and not 0 <= value <= MAX_INT:
            raise ProtocolError(f"{kind} frame field {name!r}={value} is out of range")


FieldCheck = Callable[[Any, dict], None]  # (the field's value, the frame) -> None, or raises ProtocolError


def _optional(checks: dict[str, FieldCheck]) -> Callable[[dict], None]:
    """A frame check that runs ``checks[name]`` on each optional field present and not None, in order."""
    def check(msg: dict) -> None:
        for name, check_field in checks.items():
            if msg.get(name) is not None:
                check_field(msg[name], msg)

    return check


def _flag(kind: str, name: str) -> FieldCheck:
    def check(value: Any, msg: dict) -> None:
        if not isinstance(value, bool):
            raise ProtocolError(f"{kind} frame field {name!r} must be true or false")

    return check


def _open_sampling(value: Any, msg: dict) -> None:
    if not isinstance(value, dict):
        raise ProtocolError("open frame field 'sampling' must be a map")


def _open_wire_dtype(value: Any, msg: dict) -> None:
    if not isinstance(value, str) or value not in WIRE_DTYPES:
        raise ProtocolError(f"open frame wire_dtype {value!r} is not one of {', '.join(WIRE_DTYPES)}")


def _open_prev(value: Any, msg: dict) -> None:
    if not (isinstance(value, str) and 0 < len(value) <= MAX_SESSION_CHARS):
        raise ProtocolError("open frame field 'prev' must be a PeerId string")


def _open_layers(value: Any, msg: dict) -> None:
    if not (isinstance(value, list) and len(value) == 2 and all(type(x) is int and 0 <= x <= MAX_INT for x in value)
            and value[0] < value[1]):
        raise ProtocolError("open frame field 'layers' must be [start, end) with 0 <= start < end")


def _open_mirror(value: Any, msg: dict) -> None:
    mu = msg.get("mirror_until")
    if not (isinstance(value, str) and 0 < len(value) <= 1024):
        raise ProtocolError("open frame field 'mirror' must be a multiaddr string")
    if type(mu) is not int or not 0 < mu <= MAX_INT:
        raise ProtocolError("open frame field 'mirror' needs 'mirror_until' (the shadow's end layer, an integer)")


def _open_job(value: Any, msg: dict) -> None:
    from swarm.receipts import check_job_field

    try:
        check_job_field(value)
    except ValueError as exc:
        raise ProtocolError(f"open frame: {exc}") from None


def _open_ok_reused(value: Any, msg: dict) -> None:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise ProtocolError("open_ok frame field 'reused' must be an integer >= 0")


def _check_session(msg: dict) -> None:
    """Any frame's ``session``, where it has one: a string of 1..MAX_SESSION_CHARS characters."""
    session = msg.get("session")
    if "session" in msg and not isinstance(session, str):
        raise ProtocolError(f"{msg['type']} frame field 'session' must be a string")
    if isinstance(session, str) and not 0 < len(session) <= MAX_SESSION_CHARS:
        raise ProtocolError(f"session id must be 1..{MAX_SESSION_CHARS} characters")


def _check_repair_targets(msg: dict) -> None:
    """A repair's new neighbours (``prev``, ``next``) and what it resends (``resend`` with ``until``,
    to ``next``; ``mirror`` needs both)."""
    for name in ("prev", "next"):
        if msg.get(name) is not None and not (isinstance(msg[name], str) and 0 < len(msg[name]) <= 1024):
            raise ProtocolError(f"repair frame field {name!r} must be a non-empty string")
    resend, until = msg.get("resend"), msg.get("until")
    for name, value in (("resend", resend), ("until", until)):
        if value is not None and (type(value) is not int or not 0 <= value <= MAX_INT):
            raise ProtocolError(f"repair frame field {name!r} must be an integer >= 0")
    if (resend is None) != (until is None):
        raise ProtocolError("repair frame fields 'resend' and 'until' go together")
    if resend is not None and msg.get("next") is None:
        raise ProtocolError("repair frame 'resend' needs 'next' (the stage to resend to)")
    if msg.get("mirror") and resend is None:
        raise ProtocolError("repair frame 'mirror' needs 'next' and 'resend' (the shadow it promotes)")


def _check_rows(msg: dict) -> None:
    """A forward's or refill's input: exactly one of ``tokens`` (a non-empty list of ints, at most
    MAX_TOKENS_PER_FRAME) or ``hidden`` (a tensor map)."""
    kind = msg["type"]
    has_tokens, has_hidden = "tokens" in msg, "hidden" in msg
    if has_tokens == has_hidden:
        raise ProtocolError(f"{kind} frame must carry exactly one of 'tokens' or 'hidden'")
    if has_tokens:
        toks = msg["tokens"]
        if isinstance(toks, list) and len(toks) > MAX_TOKENS_PER_FRAME:
            raise ProtocolError(f"{kind} frame carries {len(toks)} token ids; at most {MAX_TOKENS_PER_FRAME}")
        if not isinstance(toks, list) or not toks or not all(type(x) is int for x in toks):
            raise ProtocolError(f"{kind} frame 'tokens' must be a non-empty list of integers")
    elif not isinstance(msg["hidden"], dict):
        raise ProtocolError(f"{kind} frame 'hidden' must be a tensor map")


def _check_logits_from(msg: dict) -> None:
    """A forward's or result's optional ``logits_from``: a position in [pos, pos + T]."""
    if "logits_from" not in msg:
        return
    kind, lf = msg["type"], msg["logits_from"]
    if type(lf) is not int or not msg["pos"] <= lf <= MAX_INT:
        raise ProtocolError(f"{kind} frame field 'logits_from' must be an integer position >= pos, got {lf!r}")
    if kind == "forward" and "tokens" in msg and lf > msg["pos"] + len(msg["tokens"]):
        raise ProtocolError(f"forward frame 'logits_from' {lf} lies past its last row")


# type -> its checks after the required fields, in order; a type not listed: only _check_session.
# The optional fields of each type are described in SCHEMA's comments.
_CHECKS: dict[str, tuple[Callable[[dict], None], ...]] = {
    "open": (_optional({"sampling": _open_sampling, "wire_dtype": _open_wire_dtype, "batch": _flag("open", "batch"),
                        "prev": _open_prev, "layers": _open_layers, "shadow": _flag("open", "shadow"),
                        "mirror": _open_mirror, "job": _open_job,
                        "prefix": lambda value, msg: _check_prefix(value)}),
             _check_session),
    "open_ok": (_optional({"reused": _open_ok_reused}), _check_session),
    "close": (_optional({"keep": lambda value, msg: _check_ids(value, "close frame field 'keep'")}), _check_session),
    "repair": (_optional({"mirror": _flag("repair", "mirror")}), _check_session, _check_repair_targets),
    "forward": (_check_session, _check_rows, _check_logits_from),
    "refill": (_check_session, _check_rows),
    "result": (_check_session, _check_logits_from),
    "audit": (_check_session, lambda msg: _check_job_id(msg)),
    "audit_ok": (_check_session, lambda msg: _check_job_id(msg)),
}


def _check_job_id(msg: dict) -> None:
    """An ``audit`` frame's ``job``: a job id as an ``open`` frame's ``job.id`` (1..128 characters)."""
    if not 0 < len(msg["job"]) <= MAX_SESSION_CHARS:
        raise ProtocolError(f"{msg['type']} frame field 'job' must be a job id of 1..{MAX_SESSION_CHARS} characters")


MAX_PREFIX_NS_CHARS = 128


def _check_ids(ids: Any, where: str) -> None:
    if not isinstance(ids, list) or len(ids) > MAX_TOKENS_PER_FRAME:
        raise ProtocolError(f"{where} must be a list of at most {MAX_TOKENS_PER_FRAME} token ids")
    if not all(type(x) is int and 0 <= x <= MAX_INT for x in ids):
        raise ProtocolError(f"{where} must hold token ids (integers >= 0)")


def _check_prefix(prefix: Any) -> None:
    """An open frame's ``prefix``: ``{"ids": [...], "ns": str}``, the session's prompt ids (the stage
    may reuse cached KV of their leading blocks) and the coordinator's fingerprint of the stages before
    this one (their PeerIds, layers, dtypes and the wire dtype), which scopes what may be reused."""
    if not isinstance(prefix, dict) or set(prefix) != {"ids", "ns"}:
        raise ProtocolError("open frame field 'prefix' must be a map of 'ids' and 'ns'")
    _check_ids(prefix["ids"], "open frame field 'prefix.ids'")
    ns = prefix["ns"]
    if not isinstance(ns, str) or not 0 < len(ns) <= MAX_PREFIX_NS_CHARS:
        raise ProtocolError(f"open frame field 'prefix.ns' must be a string of 1..{MAX_PREFIX_NS_CHARS} characters")


def encode_tensor(t: torch.Tensor, dtype: torch.dtype | None = None) -> dict:
    """Encode a tensor as ``{"dtype": name, "shape": [...], "data": raw bytes}``.

    float8_e4m3fn carries one float32 scale per position (row of the last dimension) in ``scale``:
    each row is divided by max|row| / 448 before the cast, so every row uses the full fp8 range.

    Args:
        t: a float tensor (float32/64, bfloat16, float16); moved to CPU.
        dtype: the wire dtype to cast to; default keeps ``t.dtype``.
    Raises:
        ProtocolError: if the dtype is not a wire dtype.
    """
    t = t.detach().to("cpu")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ProtocolError(f"dtype {dtype} cannot travel on the wire")
    extra = {}
    if dtype == torch.float8_e4m3fn:
        rows = t.float()
        scale = (rows.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-30)  # (..., 1)
        t = (rows / scale).to(torch.float8_e4m3fn)
        extra["scale"] = _raw(scale.squeeze(-1).contiguous())
    elif dtype is not None:
        t = t.to(dtype)
    if t.dtype not in DTYPE_NAMES:
        raise ProtocolError(f"dtype {t.dtype} cannot travel on the wire")
    t = t.contiguous()
    return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data": _raw(t), **extra}


def _raw(t: torch.Tensor) -> bytes:
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def decode_tensor(m: Any, *, rank: int | None = None, last_dim: int | None = None,
                  max_elements: int = 1 << 28) -> torch.Tensor:
    """Decode a tensor map, checking dtype, rank, last dimension and byte length before copying.

    Args:
        m: the map produced by :func:`encode_tensor`.
        rank: required number of dimensions (e.g. 3 for (B, T, D)).
        last_dim: required size of the last dimension (e.g. the hidden size D).
        max_elements: refuse larger tensors.
    Returns:
        A CPU tensor of the declared dtype and shape (a private copy of the bytes); float8 comes
        back dequantized to float32 with its per-row scale.
    Raises:
        ProtocolError: unknown dtype, bad shape, or ``len(data) != prod(shape) * itemsize``.
    """
    if not isinstance(m, dict):
        raise ProtocolError("tensor field is not a map")
    name, shape, data = m.get("dtype"), m.get("shape"), m.get("data")
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise ProtocolError(f"tensor dtype {name!r} is not allowed (allowed: {', '.join(WIRE_DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"tensor shape {shape!r} is not a list of non-negative integers")
    if rank is not None and len(shape) != rank:
        raise ProtocolError(f"tensor has rank {len(shape)}, expected {rank}")
    if last_dim is not None and shape and shape[-1] != last_dim:
        raise ProtocolError(f"tensor last dimension is {shape[-1]}, expected {last_dim}")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("tensor data is not bytes")
    numel = math.prod(shape)
    if numel > max_elements:
        raise ProtocolError(f"tensor of {numel} elements exceeds the limit of {max_elements}")
    dtype = WIRE_DTYPES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != numel * itemsize:
        raise ProtocolError(f"tensor data has {len(data)} bytes, shape {shape} x {itemsize} needs {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    out = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    if dtype == torch.float8_e4m3fn:
        scale = m.get("scale")
        rows = numel // shape[-1] if shape and shape[-1] else 0
        if not isinstance(scale, (bytes, bytearray)) or len(scale) != rows * 4:
            raise ProtocolError(f"float8 tensor needs a float32 scale per row ({rows * 4} bytes)")
        s = torch.frombuffer(bytearray(scale), dtype=torch.float32).reshape(*shape[:-1], 1)
        if not torch.isfinite(s).all():
            raise ProtocolError("float8 tensor has a non-finite scale")
        out = out.float() * s
    return out


def forward_inputs(msg: frames.Forward | frames.Refill, *, is_head: bool, vocab_size: int, hidden_size: int,
                   kv_len: int, max_len: int) -> dict:
    """Check a validated ``forward`` (or ``refill``) frame against the stage and session, and decode its input.

    The one place a stage checks a forward's payload: stage 0 takes ``tokens`` (ids in
    ``[0, V)``), other stages ``hidden`` of shape (1, T, D) with D the model's hidden size; T >= 1;
    the chunk starts at or before the session's ``kv_len`` (before it: a rollback) and ends within
    its ``max_len``.

    Returns:
        ``{"token_ids": (1, T) int64}`` or ``{"hidden": (1, T, D)}`` for ``LayerBlock.forward``.
    Raises:
        ProtocolError: wrong input kind for the stage, a token id outside the vocabulary, a tensor
            of the wrong dtype/rank/shape/byte length, a position gap.
        ContextOverflow: ``pos + T > max_len``.
    """
    pos = msg.pos
    if is_head:
        if msg.tokens is None:
            raise ProtocolError("this stage is the head and expects token ids, got hidden states")
        tokens = msg.tokens
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ProtocolError(f"token id {bad[0]} is outside the vocabulary of {vocab_size}")
        t = len(tokens)
    else:
        if msg.hidden is None:
            raise ProtocolError("this stage expects hidden states, got token ids")
        shape = msg.hidden.get("shape") if isinstance(msg.hidden, dict) else None
        if isinstance(shape, list) and len(shape) == 3 and shape[0] != 1:
            raise ProtocolError(f"hidden states have batch size {shape[0]}, expected 1")
        t = shape[1] if isinstance(shape, list) and len(shape) == 3 and isinstance(shape[1], int) else None
        if t is not None and t < 1:
            raise ProtocolError("hidden states hold no positions (T = 0)")
    if pos > kv_len:
        raise ProtocolError(f"chunk at pos {pos} is not contiguous with the session's kv_len {kv_len}")
    if t is not None and pos + t > max_len:
        raise ContextOverflow(f"positions [{pos}, {pos + t}) exceed the session's maximum context of {max_len}")
    if is_head:
        return {"token_ids": torch.tensor([tokens], dtype=torch.long)}
    return {"hidden": decode_tensor(msg.hidden, rank=3, last_dim=hidden_size,
                                    max_elements=max(1, max_len) * hidden_size)}

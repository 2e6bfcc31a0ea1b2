"""Openable receipts: the window leaves a stage receipt commits to, openings, and the audit client.

Owns: rows as Merkle leaves (:class:`WindowLog`, :func:`leaf_data`), the receipt's ``windows`` (:class:`Commitment`),
a window's signed opening (:func:`opening_body`, :func:`sign_opening`), its pure check (:func:`check_opening`) and
the client (:func:`request_window`, :func:`open_window`). No torch. Formats: docs/protocol.md; rows: docs/audits.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from swarm import merkle
from swarm.errors import AuditFailed, ProtocolError
from swarm.frames import Audit, AuditOk, Error, Forward, Refill

WINDOW_POSITIONS = 64
OPENING_SCHEMA = "swarm/audit-opening/1"
_LEAF_TAG = "swarm-window/1"
_OPENING_TAG = b"swarm-audit-opening/1\n"
MAX_WINDOWS = 1 << 20

Row = tuple  # (in_kind, in_bytes, out_kind, out_bytes), each None where absent


# ---- rows of frames -----------------------------------------------------------------------------


def token_rows(ids: list[int]) -> list[bytes]:
    """One 4-byte unsigned little-endian row per token id."""
    return [struct.pack("<I", int(i)) for i in ids]


def hidden_rows(tensor: dict) -> tuple[str, list[bytes]]:
    """The rows of a (1, T, D) wire tensor map: ``(dtype name, [row bytes] * T)`` (float8 rows end
    with their 4-byte scale).

    Raises:
        ValueError: not a (1, T, D) map whose data splits into T equal rows.
    """
    shape, data = tensor.get("shape"), tensor.get("data")
    if not (isinstance(shape, list) and len(shape) == 3 and isinstance(shape[1], int) and shape[1] >= 1
            and isinstance(data, (bytes, bytearray)) and len(data) % shape[1] == 0):
        raise ValueError(f"hidden states of shape {shape!r} do not split into rows")
    t = shape[1]
    step = len(data) // t
    rows = [bytes(data[i * step:(i + 1) * step]) for i in range(t)]
    scale = tensor.get("scale")
    if scale is not None:
        if not isinstance(scale, (bytes, bytearray)) or len(scale) != 4 * t:
            raise ValueError("a float8 tensor needs a 4-byte scale per row")
        rows = [r + bytes(scale[4 * i:4 * i + 4]) for i, r in enumerate(rows)]
    return str(tensor.get("dtype")), rows


def token_ids(rows: list[bytes]) -> list[int]:
    """The token ids of rows of kind ``tokens`` / ``token_ids`` (inverse of :func:`token_rows`).

    Raises:
        ValueError: a row that is not 4 bytes (or absent).
    """
    if not all(isinstance(r, (bytes, bytearray)) and len(r) == 4 for r in rows):
        raise ValueError("token rows must be 4 bytes each")
    return [struct.unpack("<I", r)[0] for r in rows]


def tensor_map(kind: str, rows: list[bytes], hidden_size: int) -> dict:
    """A (1, T, D) wire tensor map of hidden-state rows (inverse of :func:`hidden_rows`), for
    ``swarm.wire.decode_tensor``: what an auditor feeds the block it re-runs.

    Args:
        kind: the rows' wire dtype name; rows: T row byte strings (float8: each ending in its scale).
        hidden_size: D.
    Raises:
        ValueError: no rows, an absent row, or rows of unequal length.
    """
    if not rows or not all(isinstance(r, (bytes, bytearray)) for r in rows) or len({len(r) for r in rows}) != 1:
        raise ValueError("hidden rows must be present and of one length")
    out = {"dtype": kind, "shape": [1, len(rows), hidden_size]}
    if kind == "float8_e4m3fn":
        out["data"] = b"".join(bytes(r[:-4]) for r in rows)
        out["scale"] = b"".join(bytes(r[-4:]) for r in rows)
    else:
        out["data"] = b"".join(bytes(r) for r in rows)
    return out


def input_rows(msg: Forward | Refill) -> tuple[str, list[bytes]]:
    """A ``forward``/``refill`` frame's input rows: ``("tokens", ...)`` or ``(dtype, ...)``."""
    if msg.tokens is not None:
        return "tokens", token_rows(msg.tokens)
    return hidden_rows(msg.hidden)


class WindowLog:
    """The rows one stage computed for one job's session, by absolute position (see the module
    docstring, "Which rows"); the retention store keeps a finished job's log for audits.

    Args:
        max_bytes: the most it may hold (the stage's ``--audit-retention-mb``: a bigger log could never
            be retained). Past it the log drops its rows for good (``broken`` says why) and the
            receipt commits to no windows.
    """

    def __init__(self, max_bytes: int = 1 << 62) -> None:
        self.rows: list[Row] = []
        self.nbytes = 0
        self.max_bytes = max_bytes
        self.broken = ""

    def __len__(self) -> int:
        return len(self.rows)

    def record(self, pos: int, in_kind: str, ins: list[bytes], out_kind: str | None,
               outs: list[bytes | None] | None) -> None:
        """Keep rows ``[pos, pos + len(ins))``, dropping every row from ``pos`` on first.

        Args:
            pos: the absolute position of ``ins[0]``; past the end, the gap is filled with absent rows.
            in_kind, ins: the input rows' kind and bytes.
            out_kind, outs: the output rows' kind and bytes; ``outs`` is aligned to the end of
                ``ins`` (the tail answers the last rows only) and may be None (nothing was sent on).
        """
        if self.broken:
            return
        if pos < len(self.rows):
            self.nbytes -= sum(_row_bytes(r) for r in self.rows[pos:])
            del self.rows[pos:]
        self.rows.extend([(None, None, None, None)] * (pos - len(self.rows)))
        outs = list(outs or [])
        lead = len(ins) - len(outs)
        for i, data in enumerate(ins):
            out = outs[i - lead] if i >= lead else None
            row = (in_kind, bytes(data), out_kind if out is not None else None, out)
            self.rows.append(row)
            self.nbytes += _row_bytes(row)
        if self.nbytes > self.max_bytes:
            self.broken = f"its rows up to position {len(self.rows)} pass {self.max_bytes} bytes (--audit-retention-mb)"
            self.rows, self.nbytes = [], 0

    def record_chunk(self, msg: Forward | Refill, output: Any) -> None:
        """Record a computed ``forward``/``refill`` frame ``msg`` and what was sent for it.

        Args:
            msg: the input frame (validated: ``tokens`` or a (1, T, D) ``hidden`` map).
            output: the tail's token ids for the frame's last rows (a list), the hidden states sent on
                (a tensor map), or None when nothing was sent on.
        Raises:
            ValueError: a tensor map that does not split into rows.
        """
        in_kind, ins = input_rows(msg)
        if output is None:
            out_kind, outs = None, None
        elif isinstance(output, list):
            out_kind, outs = "token_ids", token_rows(output)
        else:
            out_kind, outs = hidden_rows(output)
        self.record(msg.pos, in_kind, ins, out_kind, outs)

    def snapshot(self) -> list[Row]:
        """The rows now (a copy of the list; rows are immutable bytes, shared)."""
        return list(self.rows)


def _row_bytes(row: Row) -> int:
    return len(row[1] or b"") + len(row[3] or b"") + 48


# ---- leaves, the commitment ---------------------------------------------------------------------


def leaf_data(window: int, start: int, rows: list) -> bytes:
    """The leaf data of window ``window``: msgpack ``["swarm-window/1", window, start, rows]``."""
    return msgpack.packb([_LEAF_TAG, window, start, [list(r) for r in rows]], use_bin_type=True)


class Commitment:
    """The Merkle tree over a job's windows: the receipt's ``windows`` field and the openings.

    Args:
        rows: a :class:`WindowLog`'s snapshot; ``size``: positions per window (>= 1).
    Raises:
        ValueError: ``size`` below 1.
    """

    def __init__(self, rows: list[Row], size: int = WINDOW_POSITIONS) -> None:
        if size < 1:
            raise ValueError(f"a window must hold at least 1 position, got {size}")
        self.rows, self.size, self.positions = rows, size, len(rows)
        self.tree = merkle.Tree([merkle.leaf_hash(leaf_data(k, s, rows[s:s + size]))
                                 for k, s in enumerate(range(0, len(rows), size))])
        self.nbytes = sum(_row_bytes(r) for r in rows) + 32 * len(self.tree)

    def field(self) -> dict:
        """The receipt's ``windows``: ``{"size", "positions", "leaves", "root"}`` (root hex)."""
        return {"size": self.size, "positions": self.positions, "leaves": len(self.tree),
                "root": self.tree.root.hex()}

    def window(self, k: int) -> tuple[int, list[Row], list[bytes]]:
        """Window ``k``'s start, rows and inclusion path. Raises IndexError outside the tree."""
        path = self.tree.path(k)
        start = k * self.size
        return start, self.rows[start:start + self.size], path


# ---- openings -----------------------------------------------------------------------------------


def opening_body(receipt: dict, commitment: Commitment, k: int) -> dict:
    """The unsigned opening of window ``k`` of the job ``receipt`` (this stage's signed receipt).

    Raises:
        IndexError: ``k`` is not a window of the job.
    """
    start, rows, path = commitment.window(k)
    return {"schema": OPENING_SCHEMA, "peer_id": receipt["peer_id"], "session": receipt["session"],
            "job_id": receipt["job_id"], "window": k, "start": start, "size": commitment.size,
            "positions": commitment.positions, "leaves": len(commitment.tree),
            "root": commitment.tree.root.hex(), "rows": [list(r) for r in rows], "path": path}


def _signed_part(opening: dict, leaf: bytes) -> bytes:
    from swarm.receipts import canonical

    fields = {k: v for k, v in opening.items() if k not in ("rows", "path", "sig")}
    return canonical({**fields, "leaf": leaf.hex()}, _OPENING_TAG)


def _leaf_of(opening: dict) -> bytes:
    return merkle.leaf_hash(leaf_data(opening["window"], opening["start"], opening["rows"]))


def opening_leaf(opening: dict) -> bytes:
    """The leaf hash (32 bytes) of an opening's window, rows and start (what its path proves)."""
    return _leaf_of(opening)


def sign_opening(body: dict, sign) -> dict:
    """``body`` with ``sig``: hex of ``sign(bytes)`` over the signed part (see the module docstring)."""
    return {**body, "sig": sign(_signed_part(body, _leaf_of(body))).hex()}


@dataclass(frozen=True)
class Opening:
    """A checked opening of one window.

    Attributes:
        peer_id, job_id, session, window: what was opened; ``start``: its first position.
        rows: ``(in_kind, in_bytes, out_kind, out_bytes)`` per position ``start, start + 1, ...``.
        leaf: the leaf hash (32 bytes), proven under the receipt's root.
    """

    peer_id: str
    job_id: str
    session: str
    window: int
    start: int
    rows: tuple
    leaf: bytes

    def inputs(self) -> list[bytes | None]:
        """The input row bytes per position (None where absent)."""
        return [r[1] for r in self.rows]

    def outputs(self) -> list[bytes | None]:
        """The output row bytes per position (None where absent)."""
        return [r[3] for r in self.rows]


def _audit_fail(check: str, msg: str) -> AuditFailed:
    exc = AuditFailed(f"{check}: {msg}")
    exc.check = check
    return exc


def check_opening(receipt: dict, opening: Any, window: int | None = None) -> Opening:
    """Check a stage's opening of a window against that stage's signed receipt.

    Args:
        receipt: the stage receipt (from a job receipt) whose ``windows`` root the opening must prove.
        opening: the ``opening`` map of the stage's ``audit_ok``.
        window: the window asked for (None: any).
    Returns:
        The :class:`Opening`.
    Raises:
        AuditFailed: with ``.check``: ``receipt`` (the receipt is unsigned, malformed or commits to no
            windows), ``schema`` (a malformed opening), ``mismatch`` (another job, session, stage,
            window or commitment than the receipt's), ``signature`` (the opening is not the stage's),
            ``path`` (the rows do not hash to a leaf under the receipt's root).
    """
    from swarm.receipts import signature_ok
    from swarm.transport.identity import verify_peer_signature

    if not isinstance(receipt, dict) or not signature_ok(receipt, receipt.get("peer_id")):
        raise _audit_fail("receipt", "the stage receipt's signature does not verify")
    w = receipt.get("windows")
    if not (isinstance(w, dict) and all(type(w.get(k)) is int for k in ("size", "positions", "leaves"))
            and isinstance(w.get("root"), str)):
        raise _audit_fail("receipt", "the stage receipt commits to no windows (a receipt from before openable "
                                     "receipts, or a malformed 'windows' field)")
    _check_shape(opening)
    want = {"peer_id": receipt["peer_id"], "session": receipt.get("session"), "job_id": receipt.get("job_id"),
            "size": w["size"], "positions": w["positions"], "leaves": w["leaves"], "root": w["root"]}
    if window is not None:
        want["window"] = window
    for name, value in want.items():
        if opening[name] != value:
            raise _audit_fail("mismatch", f"the opening names {name} {str(opening[name])[:40]!r}, the receipt "
                                          f"{str(value)[:40]!r}")
    k, size = opening["window"], w["size"]
    if opening["start"] != k * size or len(opening["rows"]) != max(0, min(size, w["positions"] - k * size)):
        raise _audit_fail("mismatch", f"window {k} must start at {k * size} and hold "
                                      f"{max(0, min(size, w['positions'] - k * size))} rows")
    try:
        leaf = _leaf_of(opening)
        sig_ok = verify_peer_signature(opening["peer_id"], _signed_part(opening, leaf), bytes.fromhex(opening["sig"]))
        root = bytes.fromhex(w["root"])
    except (ValueError, TypeError):
        raise _audit_fail("schema", "the opening's rows, signature or root cannot be read") from None
    if not sig_ok:
        raise _audit_fail("signature", f"the opening is not signed by {opening['peer_id']}")
    if not merkle.verify(leaf, k, w["leaves"], opening["path"], root):
        raise _audit_fail("path", f"window {k}'s rows do not hash to a leaf under the receipt's root "
                                  f"{w['root'][:16]}...")
    return Opening(opening["peer_id"], opening["job_id"], opening["session"], k, opening["start"],
                   tuple(tuple(r) for r in opening["rows"]), leaf)


def _check_shape(opening: Any) -> None:
    types = {"schema": str, "peer_id": str, "session": str, "job_id": str, "window": int, "start": int,
             "size": int, "positions": int, "leaves": int, "root": str, "rows": list, "path": list, "sig": str}
    if not isinstance(opening, dict):
        raise _audit_fail("schema", "the opening is not a map")
    for name, t in types.items():
        if not isinstance(opening.get(name), t) or isinstance(opening.get(name), bool):
            raise _audit_fail("schema", f"the opening lacks {name!r} or it has the wrong type")
    if opening["schema"] != OPENING_SCHEMA:
        raise _audit_fail("schema", f"the opening's schema is {opening['schema']!r}, not {OPENING_SCHEMA}")
    for r in opening["rows"]:
        if not (isinstance(r, list) and len(r) == 4 and all(x is None or isinstance(x, (str, bytes)) for x in r)):
            raise _audit_fail("schema", "each opened row must be [in_kind, in_bytes, out_kind, out_bytes]")


# ---- the client ---------------------------------------------------------------------------------


async def request_window(stream, receipt: dict, window: int, *, timeout_s: float = 30.0) -> Opening:
    """Ask a stage for window ``window`` of the job in ``receipt`` (the stage's own signed receipt)
    on an open ``/swarm/ring/1`` stream, and check the answer (:func:`check_opening`).

    Raises:
        AuditFailed: the stage refused (check ``refused``: an error frame, e.g. an unknown or evicted
            job, or the rate limit; the reason is the stage's), answered something else
            (``schema``), or an opening that does not check.
        HopTimeout, StreamClosed: the stage did not answer within ``timeout_s`` or went away; an
            auditor counts either as a failed audit.
    """
    from swarm import wire

    await stream.send(Audit(session=receipt["session"], job=receipt["job_id"], window=window), timeout_s=timeout_s)
    raw = await stream.recv(timeout_s=timeout_s)
    try:
        answer = wire.validate(raw)
    except ProtocolError as exc:
        raise _audit_fail("schema", f"the stage answered a malformed frame: {exc}"[:200]) from None
    if isinstance(answer, Error):
        exc = _audit_fail("refused", f"{answer.code}: {answer.reason}")
        exc.code = answer.code
        raise exc
    if not isinstance(answer, AuditOk):
        raise _audit_fail("schema", f"the stage answered {answer.TYPE!r}, not audit_ok")
    return check_opening(receipt, answer.opening, window)


async def open_window(host, addr: str, receipt: dict, window: int, *, timeout_s: float = 30.0) -> Opening:
    """:func:`request_window` on a new stream to the stage at ``addr`` (a multiaddr with /p2p/),
    closed afterwards. ``host``: a ``swarm.transport`` host (``open_stream``)."""
    from swarm.wire import PROTOCOL_ID

    stream = await host.open_stream(addr, PROTOCOL_ID, timeout_s=timeout_s)
    try:
        return await request_window(stream, receipt, window, timeout_s=timeout_s)
    finally:
        await stream.aclose()


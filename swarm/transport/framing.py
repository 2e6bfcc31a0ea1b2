"""Length-prefixed msgpack frames over one libp2p stream.

Owns: the frame wire format, its pure encoder and decoder, and ``FramedStream`` (a send lock, a reader task
draining the stream into a bounded queue, deadlines, close and reset, ``migrate``). What a map holds is
``swarm.wire``'s; the format is docs/protocol.md, "Framing".
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import trio
from libp2p.exceptions import BaseLibp2pError

from swarm.errors import FrameTooLarge, HopTimeout, ProtocolError, StreamClosed, SwarmError
from swarm.frames import Frame

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 256 * 1024 * 1024
"""Default largest accepted frame body, in bytes (prefill of a long prompt is the big one)."""
QUEUE_FRAMES = 64
"""Decoded frames a reader task may hold before it stops draining the stream."""
READ_AHEAD_BYTES = 64 * 1024
"""Least a frame reader asks the stream for at once (what it gets past a frame waits for the next)."""
LENGTH_PREFIX_BYTES = 4
_PREFIX = struct.Struct(">I")
_CLOSE_TIMEOUT_S = 1.0  # graceful FIN; a frozen peer must not hold up our close
MOVED = "_moved"
"""Frame type that ends one side's frames on a stream that moves (``FramedStream.migrate``)."""


def _check_max(max_bytes: int) -> int:
    if not 1 <= max_bytes <= 0xFFFF_FFFF:
        raise ValueError(f"max frame bytes must be in [1, 2**32 - 1], got {max_bytes}")
    return max_bytes


def encode_frame(msg: Mapping[str, Any] | Frame, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Pack one map into a complete frame (length prefix + msgpack body).

    Args:
        msg: the map to send, or a typed frame (sent as its ``to_wire()`` map); values must be
            msgpack-serializable (bytes stay bytes).
        max_bytes: largest allowed body size in bytes.
    Returns:
        ``uint32_be(len(body)) + body`` as one bytes object, ready for a single write.
    Raises:
        FrameTooLarge: the packed body exceeds ``max_bytes``.
        TypeError: ``msg`` is not a mapping or holds a value msgpack cannot pack.
    """
    if isinstance(msg, Frame):
        msg = msg.to_wire()
    if not isinstance(msg, Mapping):
        raise TypeError(f"a frame is a map, got {type(msg).__name__}")
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > max_bytes:
        raise FrameTooLarge(f"frame body is {len(body)} bytes, max is {max_bytes} (sender side)")
    return _PREFIX.pack(len(body)) + body


def decode_length_prefix(prefix: bytes, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """Read a frame's declared body length and check it against the maximum.

    Args:
        prefix: exactly 4 bytes, the big-endian uint32 length.
        max_bytes: largest allowed body size in bytes.
    Returns:
        The declared body length in bytes.
    Raises:
        ProtocolError: ``prefix`` is not 4 bytes.
        FrameTooLarge: the declared length exceeds ``max_bytes`` (nothing has been allocated).
    """
    if len(prefix) != LENGTH_PREFIX_BYTES:
        raise ProtocolError(f"length prefix is {len(prefix)} bytes, expected 4")
    (length,) = _PREFIX.unpack(prefix)
    if length > max_bytes:
        raise FrameTooLarge(f"peer declared a {length}-byte frame, max is {max_bytes}")
    return length


def decode_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Unpack one frame body, which must be exactly one msgpack map.

    Args:
        body: the bytes after the length prefix.
    Returns:
        The decoded map (str/bytes keys; bin -> bytes, str -> str).
    Raises:
        ProtocolError: malformed msgpack, trailing bytes, non-str/bytes keys, or a top level
            that is not a map.
    """
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        # ValueError covers ExtraData, FormatError, StackError and truncated input.
        raise ProtocolError(f"malformed msgpack in a {len(body)}-byte frame: {e}") from e
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame top level is {type(msg).__name__}, expected a map")
    return msg


class FrameDecoder:
    """Incremental, network-free frame decoder (for tests, fuzzing and byte-level tools).

    Feed it arbitrary slices of a byte stream; it returns every frame completed so far. After
    an error it stays failed: the stream cannot be resynchronized.
    """

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_bytes = _check_max(max_bytes)
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame in progress
        self._error: SwarmError | None = None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Append bytes and return the frames they complete.

        Args:
            data: the next bytes of the stream, any length.
        Returns:
            Decoded maps, in order (possibly empty).
        Raises:
            FrameTooLarge: a declared length exceeds ``max_bytes`` (checked on the prefix alone).
            ProtocolError: a body is not one msgpack map.
        """
        if self._error is not None:
            raise type(self._error)(str(self._error))
        self._buf += data
        out: list[dict[str, Any]] = []
        try:
            while True:
                if self._need is None:
                    if len(self._buf) < LENGTH_PREFIX_BYTES:
                        return out
                    self._need = decode_length_prefix(bytes(self._buf[:4]), self.max_bytes)
                    del self._buf[:4]
                if len(self._buf) < self._need:
                    return out
                body = bytes(self._buf[: self._need])
                del self._buf[: self._need]
                self._need = None
                out.append(decode_body(body))
        except ProtocolError as e:
            self._error = e
            raise

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet part of a completed frame."""
        return len(self._buf)


class RawStream(Protocol):
    """What FramedStream needs from a byte stream (a libp2p ``INetStream`` fits)."""

    async def read(self, n: int) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def close(self) -> None: ...
    async def reset(self) -> None: ...


# What a raw stream raises when the peer or the connection goes away.
_RAW_ERRORS = (
    EOFError,
    OSError,
    BaseLibp2pError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


@dataclass
class Meter:
    """Frames and bytes (length prefix included, before Noise and Yamux) through every FramedStream
    of one node, in and out: plain counters, read by the node's metrics (``swarm.serve.metrics``)."""

    frames_in: int = 0
    bytes_in: int = 0
    frames_out: int = 0
    bytes_out: int = 0


def is_relayed(raw) -> bool:
    """True when the libp2p stream (or BufferedRaw) runs over a relayed connection."""
    net = getattr(raw, "net", raw)
    conn = getattr(net, "swarm_conn", None)
    try:
        return conn is not None and any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())
    except Exception:
        return False


class FramedStream:
    """A message stream of msgpack maps over one raw (libp2p) stream.

    Lifetime: construct, then ``start(nursery)`` runs the reader task in that nursery.
    ``SwarmHost`` does both: outbound streams' readers run in the host's nursery, inbound
    streams' readers in a nursery scoped to the protocol handler (the stream is closed when the
    handler returns). The reader drains the stream continuously into a queue of
    ``queue_frames`` decoded frames, so the Yamux window keeps opening while the consumer
    computes (Yamux resets a writer whose window stays full for 5 s).

    ``async with stream:`` closes it on exit.
    """

    def __init__(
        self,
        raw: RawStream,
        *,
        remote_peer_id: str,
        protocol_id: str,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        queue_frames: int = QUEUE_FRAMES,
        migrator: Any = None,
        meter: Meter | None = None,
    ) -> None:
        self.meter = meter  # frames and bytes in and out, summed over a node's streams (its metrics)
        self.raw = raw  # what the reader reads
        self._wraw = raw  # what send writes (another stream than ``raw`` only in the middle of a move)
        # swarm.transport.migrate.Migrator (or None: this stream never moves, and a peer's
        # ``_moved`` frame is passed up like any other frame)
        self.migrator = migrator
        self._pending_raw: RawStream | None = None  # a move we started: read it after the peer's marker
        self._ahead = bytearray()  # bytes read past the last frame (the reader task's own)
        self.moves = 0
        self.opened_at = time.monotonic()  # monotonic seconds: a hop's move time is measured from here
        self.moved_at: float | None = None  # monotonic seconds of the first completed move
        self.remote_peer_id = remote_peer_id
        self.protocol_id = protocol_id
        self.max_frame_bytes = _check_max(max_frame_bytes)
        self._ahead_bytes = min(READ_AHEAD_BYTES, self.max_frame_bytes + LENGTH_PREFIX_BYTES)
        self._send_lock = trio.Lock()
        self._tx, self._rx = trio.open_memory_channel[dict[str, Any]](queue_frames)
        self._reader_scope = trio.CancelScope()
        self._started = False
        self._closed = False  # we called aclose() or reset(): send and recv fail at once
        self._closed_how = "closed"
        self._broken = False  # reset after a fatal error: send fails, recv drains the queue
        self._terminal: SwarmError | None = None  # why no more frames will arrive

    def __repr__(self) -> str:
        return f"FramedStream(peer={self.remote_peer_id}, protocol={self.protocol_id})"

    @property
    def closed(self) -> bool:
        """True once the stream can carry no new frames: closed or reset locally, reset after an
        error, or ended by the peer (frames already queued can still be received)."""
        return self._closed or self._broken or self._terminal is not None

    def start(self, nursery: trio.Nursery) -> None:
        """Start the reader task in ``nursery``; call exactly once, before ``recv``."""
        if self._started:
            raise RuntimeError(f"{self!r} already started")
        self._started = True
        nursery.start_soon(self._reader, name=f"frame-reader {self.remote_peer_id[-8:]}")

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---- sending -------------------------------------------------------------------------

    async def send(self, msg: Mapping[str, Any] | Frame, timeout_s: float | None = 30.0) -> None:
        """Send one map (or typed frame) as one frame; concurrent senders never interleave.

        Args:
            msg: the map or typed frame (:mod:`swarm.frames`) to send.
            timeout_s: deadline in seconds for waiting on the lock and writing (None: no limit).
        Raises:
            FrameTooLarge: the packed map exceeds ``max_frame_bytes`` (nothing was written).
            HopTimeout: the deadline passed; if part of the frame was written the stream is
                reset, because the byte stream can no longer be resynchronized.
            StreamClosed: the stream was closed (by us or the peer) or reset.
            TypeError: ``msg`` cannot be packed.
        """
        frame = encode_frame(msg, self.max_frame_bytes)
        self._check_sendable()
        writing = False
        lock = self._send_lock
        try:
            with _deadline(timeout_s):
                # Lock.acquire less its pass through trio's scheduler when the lock is free (the
                # write makes one); a cancelled caller stops here, before anything is written
                await trio.lowlevel.checkpoint_if_cancelled()
                try:
                    lock.acquire_nowait()
                except trio.WouldBlock:
                    await lock.acquire()
                try:
                    self._check_sendable()
                    writing = True
                    # One write of header+body: Yamux slices it into frames itself.
                    await self._wraw.write(frame)
                    writing = False
                    if self.meter is not None:
                        self.meter.frames_out += 1
                        self.meter.bytes_out += len(frame)
                finally:
                    lock.release()
        except trio.TooSlowError:
            log.warning(
                "hop.send_timeout peer=%s protocol=%s frame_bytes=%d timeout_s=%.2f partial=%s",
                self.remote_peer_id, self.protocol_id, len(frame), timeout_s, writing,
            )
            if writing:
                await self._abort(StreamClosed(f"{self!r} was reset after a send timeout"))
            raise HopTimeout(
                f"send to peer {self.remote_peer_id} ({self.protocol_id}) of {len(frame)} bytes "
                f"timed out after {timeout_s}s"
            ) from None
        except _RAW_ERRORS as e:
            raise StreamClosed(
                f"send to peer {self.remote_peer_id} ({self.protocol_id}) failed: "
                f"{type(e).__name__}: {e}"
            ) from e

    # ---- receiving -----------------------------------------------------------------------

    async def recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Return the next frame's map, in the order the peer sent them.

        Args:
            timeout_s: deadline in seconds (None: wait as long as the stream lives).
        Returns:
            The decoded map.
        Raises:
            HopTimeout: no frame arrived before the deadline (the stream stays usable).
            StreamClosed: EOF or reset from the peer (after every queued frame was returned),
                or we closed the stream.
            FrameTooLarge / ProtocolError: the peer sent an oversized or malformed frame; the
                stream has been reset, and every later recv raises the same error.
        """
        if self._closed:
            raise StreamClosed(f"{self!r} was {self._closed_how} locally")
        if not self._started:
            raise RuntimeError(f"recv on {self!r} before start(nursery)")
        try:
            with _deadline(timeout_s):
                return await self._rx.receive()
        except trio.TooSlowError:
            raise HopTimeout(
                f"recv from peer {self.remote_peer_id} ({self.protocol_id}) timed out "
                f"after {timeout_s}s"
            ) from None
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._terminal_copy() from None

    def _check_sendable(self) -> None:
        if self._closed:
            raise StreamClosed(f"{self!r} was {self._closed_how} locally")
        if self._broken:
            raise StreamClosed(f"{self!r} was reset after: {self._terminal}")

    def _terminal_copy(self) -> SwarmError:
        t = self._terminal or StreamClosed(f"{self!r} is closed")
        return type(t)(str(t))

    async def _reader(self) -> None:
        terminal: SwarmError | None = None
        try:
            with self._reader_scope:
                terminal = await self._read_frames()
        except ProtocolError as e:  # includes FrameTooLarge
            log.warning(
                "hop.bad_frame peer=%s protocol=%s error=%s",
                self.remote_peer_id, self.protocol_id, e,
            )
            terminal = e
            await self._abort(e)
        except StreamClosed as e:
            terminal = e
        finally:
            # Cancelled (aclose, or the owning nursery shutting down) leaves terminal None.
            if self._terminal is None:
                self._terminal = terminal or StreamClosed(f"{self!r} stopped reading (closed locally)")
            self._tx.close()

    async def _read_frames(self) -> StreamClosed:
        """Move decoded frames into the queue until a clean EOF, which it returns."""
        while True:
            prefix = await self._read_exact(LENGTH_PREFIX_BYTES, frame_start=True)
            if prefix is None:
                return StreamClosed(
                    f"peer {self.remote_peer_id} closed the stream ({self.protocol_id})"
                )
            length = decode_length_prefix(prefix, self.max_frame_bytes)
            body = await self._read_exact(length)
            if self.meter is not None:
                self.meter.frames_in += 1
                self.meter.bytes_in += LENGTH_PREFIX_BYTES + length
            msg = decode_body(body or b"")
            if self.migrator is not None and msg.get("type") == MOVED:
                await self._follow_move(msg.get("token"))
                continue
            await self._tx.send(msg)

    def hop_state(self) -> dict[str, Any]:
        """Where this stream runs now, for a node's ``info``: ``{"peer", "protocol", "relayed",
        "moves", "moved_after_s"}``; ``moved_after_s`` is the seconds from opening the stream to its
        first completed move onto another connection (None: it never moved)."""
        moved = None if self.moved_at is None else round(self.moved_at - self.opened_at, 3)
        return {"peer": self.remote_peer_id, "protocol": self.protocol_id, "relayed": is_relayed(self._wraw),
                "moves": self.moves, "moved_after_s": moved}

    # ---- moving to another stream (e.g. from a relayed connection to a direct one) -----------

    async def migrate(self) -> None:
        """Move this stream onto a new stream to the same peer, at a frame boundary, keeping
        every frame in order in both directions (a hop leaving a relay once a direct connection
        exists; the new stream goes over the connection libp2p prefers, direct before relayed).

        The side that opened the stream starts the move: it opens the new stream (announced by a
        random token), writes a ``_moved`` frame with the token last on the old one and sends on
        the new one from then on. The peer reads the old stream up to that marker, takes the new
        stream with the token, answers with its own ``_moved`` on the old one and moves too; each
        side reads the new stream only after the other's marker, then closes the old one. The
        application sees one stream. No-op without a migrator or while a move is under way.

        Raises:
            StreamClosed: the stream is closed, or the new stream could not be opened.
        """
        if self.migrator is None or self._pending_raw is not None:
            return
        self._check_sendable()
        token = secrets.token_bytes(16)
        new = await self.migrator.open(self, token)
        async with self._send_lock:
            try:
                self._check_sendable()
                await self._wraw.write(encode_frame({"type": MOVED, "token": token}, self.max_frame_bytes))
            except (*_RAW_ERRORS, StreamClosed):
                with contextlib.suppress(*_RAW_ERRORS):
                    await new.reset()
                raise
            self._pending_raw, self._wraw = new, new
        log.info("hop.move_started peer=%s protocol=%s", self.remote_peer_id, self.protocol_id)

    async def _follow_move(self, token: Any) -> None:
        """The peer's ``_moved`` marker: every frame it sent on the current stream has been read."""
        if self._ahead:
            raise ProtocolError(f"peer {self.remote_peer_id} sent {len(self._ahead)} bytes after its {MOVED} marker")
        old = self.raw
        if self._pending_raw is not None:  # our move: the peer has answered it
            new, self._pending_raw = self._pending_raw, None
        else:  # the peer's move: take its new stream, answer on the old one, send on the new one
            if not isinstance(token, bytes) or len(token) != 16:
                raise ProtocolError(f"peer {self.remote_peer_id} sent a malformed {MOVED} frame")
            new = await self.migrator.take(self.remote_peer_id, token)
            async with self._send_lock:
                with contextlib.suppress(*_RAW_ERRORS):
                    await self._wraw.write(encode_frame({"type": MOVED, "token": token}, self.max_frame_bytes))
                self._wraw = new
        self.raw = new
        self.moves += 1
        if self.moved_at is None:
            self.moved_at = time.monotonic()
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT_S):
            with contextlib.suppress(*_RAW_ERRORS):
                await old.close()
        log.info("hop.moved peer=%s protocol=%s", self.remote_peer_id, self.protocol_id)

    async def _read_exact(self, n: int, frame_start: bool = False) -> bytes | None:
        """Read exactly ``n`` bytes; libp2p's read(n) may return fewer. Reads ask for at least
        ``READ_AHEAD_BYTES`` and keep what is past ``n`` for the next call, so a small frame's
        length prefix and body come from one read of the stream (one Yamux read, not two).

        Returns None on a clean EOF before the first byte of a frame (``frame_start``).
        Raises StreamClosed on reset, or on EOF in the middle of a frame.
        """
        ahead = self._ahead
        if len(ahead) >= n:
            out = bytes(ahead[:n])
            del ahead[:n]
            return out
        chunks: list[bytes] = [bytes(ahead)] if ahead else []
        got = len(ahead)
        ahead.clear()
        while got < n:
            try:
                data = await self.raw.read(max(n - got, self._ahead_bytes))
            except _RAW_ERRORS as e:
                if isinstance(e, EOFError):  # libp2p StreamEOF / MuxedStreamEOF
                    data = b""
                else:
                    raise StreamClosed(
                        f"stream from peer {self.remote_peer_id} ({self.protocol_id}) broke: "
                        f"{type(e).__name__}: {e}"
                    ) from e
            if not data:
                if frame_start and got == 0:
                    return None
                raise StreamClosed(
                    f"peer {self.remote_peer_id} closed the stream ({self.protocol_id}) "
                    f"mid-frame after {got} of {n} bytes"
                )
            if got + len(data) > n:  # past this frame: keep the rest for the next read
                cut = n - got
                ahead += memoryview(data)[cut:]
                data = data[:cut]
            chunks.append(data)
            got += len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # ---- closing -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close our side gracefully (FIN after any frame being written) and stop reading.

        Later ``send``/``recv`` raise StreamClosed ("closed locally"). Frames the peer sends
        afterwards are not read. Idempotent; never raises for a broken stream.
        """
        if self._closed:
            return
        self._closed = True
        if self._terminal is None:
            self._terminal = StreamClosed(f"{self!r} was closed locally")
        self._reader_scope.cancel()
        if self._broken:  # already reset: nothing graceful left to do
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_CLOSE_TIMEOUT_S) as scope:
                async with self._send_lock:
                    for raw in {id(r): r for r in (self._wraw, self.raw, self._pending_raw) if r}.values():
                        with contextlib.suppress(*_RAW_ERRORS):
                            await raw.close()
            if scope.cancelled_caught:
                await self._reset_raw()
        log.debug("hop.close peer=%s protocol=%s", self.remote_peer_id, self.protocol_id)

    async def reset(self) -> None:
        """Abort the stream now (Yamux RST): the peer's reads fail, queued frames are dropped.

        Use when the stream's state is unknown (a handler crashed, a frame was cut off).
        Later ``send``/``recv`` raise StreamClosed. Never raises for a broken stream.
        """
        if not self._closed:
            self._closed, self._closed_how = True, "reset"
        await self._abort(StreamClosed(f"{self!r} was reset locally"))

    async def _abort(self, reason: SwarmError) -> None:
        """Reset the stream after a fatal error; ``reason`` is what recv/send report."""
        self._broken = True
        if self._terminal is None:
            self._terminal = reason
        self._reader_scope.cancel()
        await self._reset_raw()

    async def _reset_raw(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT_S):
            for raw in {id(r): r for r in (self._wraw, self.raw, self._pending_raw) if r}.values():
                with contextlib.suppress(*_RAW_ERRORS):
                    await raw.reset()


def _deadline(timeout_s: float | None) -> contextlib.AbstractContextManager[Any]:
    """``trio.fail_after(timeout_s)``, or no deadline when ``timeout_s`` is None."""
    return contextlib.nullcontext() if timeout_s is None else trio.fail_after(timeout_s)

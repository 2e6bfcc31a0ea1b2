"""Fewer Python steps per byte on libp2p 0.8.1's Noise and Yamux, with the same bytes on the wire.

Owns: ``BatchedNoiseTransport`` (a write sealed into consecutive Noise messages sent at once, the socket read in
large blocks), ``BulkYamuxStream`` (DATA frames up to ``BULK_FRAME_BYTES`` within the peer's window;
``bulk_stream``), ``QuickLock`` and ``check_version``. Why a stock peer still understands it: docs/architecture.md.
"""

from __future__ import annotations

import logging
import struct
from importlib.metadata import version

import trio
from libp2p.io.exceptions import IncompleteReadError
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoiseTransportReadWriter
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.yamux.yamux import (
    HEADER_SIZE,
    TYPE_DATA,
    YAMUX_HEADER_FORMAT,
    YamuxStream,
)

log = logging.getLogger(__name__)

PINNED_LIBP2P = "0.8.1"
READ_BYTES = 256 * 1024
"""Largest socket read of a Noise session: one read may carry several messages."""
BULK_FRAME_BYTES = 1024 * 1024
"""Largest Yamux DATA payload one write sends (the peer's window caps it further)."""
WINDOW_POLL_S = 0.001
"""How often a writer whose send window is empty looks again (libp2p: 10 ms)."""
WINDOW_WAIT_S = 5.0
"""A writer whose window stays empty this long fails (as libp2p's own)."""
_LEN = 2  # bytes of a Noise message's length prefix
_DATA_HEADER = struct.Struct(YAMUX_HEADER_FORMAT)


def check_version() -> None:
    """Raise RuntimeError unless the installed libp2p is the version these subclasses were written
    and tested against (their behaviour rests on its internals)."""
    got = version("libp2p")
    if got != PINNED_LIBP2P:
        raise RuntimeError(f"swarm.transport.dataplane is pinned to libp2p {PINNED_LIBP2P}, found {got}: re-check "
                           "its Noise and Yamux subclasses against that version (tests/transport/test_dataplane.py)")


class BatchedNoiseReadWriter(NoiseTransportReadWriter):
    """A Noise transport session's message layer: the same messages, fewer calls.

    ``write_msg(data)``: ``data`` split into messages of at most 65519 plaintext bytes, each
    encrypted in order, all sent with one write to the raw connection. ``read_msg()``: the
    plaintext of every complete message in the read buffer (at least one), concatenated; the
    buffer is filled by reads of up to ``READ_BYTES``. Callers (``SecureSession``) treat what
    ``read_msg`` returns as a byte stream, never as message boundaries.
    """

    def __init__(self, conn, noise_state) -> None:
        super().__init__(conn, noise_state)
        self._raw = conn
        self._inbuf = bytearray()
        inner = getattr(conn, "stream", None)
        if type(conn) is RawConnection and type(inner) is TrioTCPStream:  # libp2p's TCP: its socket locks
            quicken(inner, "read_lock", "write_lock")

    async def write_msg(self, msg: bytes, prefix_encoded: bool = False) -> None:
        if prefix_encoded:  # handshake-only framing; never used once the session is up
            await super().write_msg(msg, prefix_encoded)
            return
        view = memoryview(msg)
        out = bytearray()
        start = 0
        while True:  # at least one message: an empty write still sends its 16-byte tag
            end = min(start + MAX_PLAINTEXT_LENGTH, len(view))
            sealed = self.encrypt(bytes(view[start:end]))
            out += len(sealed).to_bytes(_LEN, "big")
            out += sealed
            start = end
            if start >= len(view):
                break
        await self._raw.write(out)  # any bytes-like: trio's send_all takes a buffer

    async def read_msg(self, prefix_encoded: bool = False) -> bytes:
        if prefix_encoded:
            return await super().read_msg(prefix_encoded)
        buf = self._inbuf
        while True:
            plain, pos = [], 0
            with memoryview(buf) as view:  # released before the buffer is resized
                while len(view) - pos >= _LEN:
                    n = (view[pos] << 8) | view[pos + 1]
                    if len(view) - pos - _LEN < n:
                        break
                    plain.append(self.decrypt(view[pos + _LEN:pos + _LEN + n].tobytes()))
                    pos += _LEN + n
            if plain:
                del buf[:pos]
                return plain[0] if len(plain) == 1 else b"".join(plain)
            data = await self._raw.read(READ_BYTES)
            if not data:  # what libp2p's read_exactly raises at EOF (Yamux tells a clean close by it)
                raise IncompleteReadError(f"connection closed with {len(buf)} bytes of a Noise message buffered",
                                          expected_bytes=_LEN, received_bytes=len(buf))
            buf += data


class BatchedNoiseTransport(NoiseTransport):
    """libp2p's Noise XX transport; its sessions use ``BatchedNoiseReadWriter`` once the
    handshake is done (the handshake itself is libp2p's, unchanged)."""

    async def secure_inbound(self, conn):
        return _batched(await super().secure_inbound(conn))

    async def secure_outbound(self, conn, peer_id):
        return _batched(await super().secure_outbound(conn, peer_id))


def _batched(session):
    """Swap a fresh session's message layer for the batched one (same raw connection and keys;
    nothing has been read past the handshake, which reads exact lengths)."""
    if isinstance(session, SecureSession) and type(session.conn) is NoiseTransportReadWriter:
        old = session.conn
        session.conn = BatchedNoiseReadWriter(old.read_writer.read_write_closer, old.noise_state)
    return session


class BulkYamuxStream(YamuxStream):
    """A Yamux stream whose ``write`` sends DATA frames of up to ``BULK_FRAME_BYTES`` (within the
    send window) and looks for window updates every ``WINDOW_POLL_S``, and whose reads return
    receive credit in batches (go-yamux's rule: once half the window is consumed, or the window
    may grow), not after every read; otherwise libp2p's."""

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        # libp2p 0.8.1's own, less two branches that return credit after every read: the one of
        # PY_YAMUX_RELEASE_ON_READ (on by default), and the one for a consumed amount still below
        # the threshold (it made every decode-sized frame cost a WINDOW_UPDATE frame: one more
        # Noise message and socket write per frame, and a wakeup of the peer to read it). Credit
        # still returns once it reaches the threshold (half the target window), so a writer blocked
        # on a full window always gets it: everything it sent has been read by then.
        total_delta = 0
        async with self.window_lock:
            if bytes_read > 0:
                self._pending_recv_release += bytes_read
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            delta = self.target_recv_window - (self.recv_window + buffered)
            threshold = self._grow_threshold()
            pending = self._pending_recv_release
            if delta >= threshold and delta > 0:
                total_delta = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
                self._pending_recv_release = 0
            elif pending >= threshold:
                self.recv_window += pending
                total_delta = pending
                self._pending_recv_release = 0
                total_delta += self._apply_autotune_epoch(buffered)
        if total_delta > 0:
            await self.send_window_update(total_delta, skip_lock=True)

    async def write(self, data: bytes) -> None:
        # libp2p's also holds the stream's rw_lock (writer side) around taking the window: a lock
        # between writers of one stream, which FramedStream's send lock already is
        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        view = memoryview(data)
        total, sent = len(view), 0
        while sent < total:
            frame = None
            with trio.move_on_after(WINDOW_WAIT_S) as waited:
                while frame is None:
                    async with self.window_lock:
                        if self.send_closed:
                            raise MuxedStreamError("Stream is closed for sending")
                        if self.closed:
                            raise MuxedStreamError("Stream is closed")
                        if self.send_window > 0:
                            n = min(self.send_window, BULK_FRAME_BYTES, total - sent)
                            self.send_window -= n
                            frame = _DATA_HEADER.pack(0, TYPE_DATA, 0, self.stream_id, n) + view[sent:sent + n]
                    if frame is None:
                        self._zero_window_waits += 1
                        await trio.sleep(WINDOW_POLL_S)
            if waited.cancelled_caught:
                raise MuxedStreamError(f"Timed out waiting for window update after {WINDOW_WAIT_S:g} seconds.")
            await _write_frame(self.conn, frame)
            sent += len(frame) - HEADER_SIZE


async def _write_frame(conn, frame: bytes) -> None:
    """libp2p's ``Yamux._write_frame`` (whole frames on the connection, one at a time, under its
    write lock), less the header it decodes for a debug line and its trailing checkpoint (the
    socket write has just passed through trio's scheduler)."""
    async with conn._write_lock:
        await conn.secured_conn.write(frame)


class QuickLock:
    """A trio Lock that ``async with`` takes without a pass through trio's scheduler when it is
    free; waited for as before when it is held. Wraps the lock (its state stays in it).

    libp2p 0.8.1 takes a trio Lock around most steps of a frame (the stream's state, its window,
    the connection's stream table and writes, the TCP socket's reads and writes), each around a
    few statements, and trio's ``Lock.acquire`` always yields to the scheduler (about 5 us, with
    an epoll call, each time): a dozen passes per frame and side. Mutual exclusion is the same,
    and so is cancellation: a cancelled caller raises ``Cancelled`` before taking it (a send must
    stop before Noise encrypts, or the nonces of the two ends part); only the cancel-shielded
    checkpoint after taking a free lock is dropped.
    """

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        # trio's Lock.acquire, less the cancel-shielded checkpoint after taking a free lock
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()

    async def __aexit__(self, *exc) -> None:
        self.lock.release()

    async def acquire(self) -> None:
        await self.__aenter__()

    def acquire_nowait(self) -> None:
        self.lock.acquire_nowait()

    def release(self) -> None:
        self.lock.release()

    def locked(self) -> bool:
        return self.lock.locked()

    def statistics(self):
        return self.lock.statistics()


def quicken(obj, *names: str) -> None:
    """Replace the trio Locks ``obj.<name>`` by ``QuickLock`` wrappers around them (idempotent)."""
    for name in names:
        lock = getattr(obj, name, None)
        if type(lock) is trio.Lock:
            setattr(obj, name, QuickLock(lock))


def bulk_stream(net_stream):
    """Make the Yamux stream under a libp2p net stream a ``BulkYamuxStream`` and return the net
    stream. libp2p 0.8.1 builds every Yamux connection with its own class (its muxer selector
    ignores the class a host is given), so the streams swarm reads and writes are re-typed one by
    one as ``SwarmHost`` opens or accepts them: the subclass adds methods and no state, and any
    other stream (a DHT or identify stream, or another muxer's) is left as it is. The locks that
    the net stream, the Yamux stream and its connection take per frame become ``QuickLock``s."""
    muxed = getattr(net_stream, "muxed_stream", None)
    if type(muxed) is YamuxStream:
        muxed.__class__ = BulkYamuxStream
    if type(muxed) is BulkYamuxStream:
        quicken(net_stream, "_state_lock")
        quicken(muxed, "window_lock")
        quicken(muxed.conn, "streams_lock", "_write_lock")
    return net_stream

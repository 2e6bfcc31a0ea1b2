"""Fewer Python steps per byte on libp2p 0.8.1's Noise and Yamux, with the same bytes on the wire.

Owns: ``BatchedNoiseTransport`` (libp2p's Noise XX transport whose sessions encrypt a whole write
into consecutive Noise messages and send them in one socket write, and read the socket in large
blocks, decrypting every complete message buffered) and ``BulkYamuxStream`` (libp2p's Yamux
stream sending DATA frames of up to ``BULK_FRAME_BYTES`` within the peer's window, instead of one
frame per 64 KiB; ``bulk_stream`` re-types a stream). ``open_host`` uses the transport for every
connection and ``SwarmHost`` the stream class for every stream it opens or accepts.

Nothing about the protocols changes, so either end may be a stock libp2p:

- Noise (https://github.com/libp2p/specs/blob/master/noise/README.md): each message is still a
  2-byte length and at most 65535 bytes of ciphertext (ChaCha20-Poly1305 with the session keys
  of the XX handshake, which binds them to both PeerIds), nonces in sending order. Only the number
  of ``send`` calls and of ``recv`` calls per message changes. A message that fails its tag
  raises (libp2p's ``InvalidTag`` path) and the connection dies, as before.
- Yamux (https://github.com/hashicorp/yamux/blob/master/spec.md) has no frame size limit but
  the receive window: a DATA frame here never exceeds the send window the peer granted, and
  libp2p 0.8.1's reader accepts DATA frames up to its 16 MiB maximum window.

Measured on loopback (two processes, 2 cores): see ``bench/transport.py``.

Pinned to libp2p 0.8.1 (``check_version``): the subclasses rely on its internals (the Noise
read-writer's ``read_writer``/``noise_state``, the Yamux stream's window fields and locks), which
``tests/transport/test_dataplane.py`` exercises against stock peers of the same version.
May import: stdlib, trio, libp2p.
"""

from __future__ import annotations

import logging
from importlib.metadata import version

import trio
from libp2p.io.exceptions import IncompleteReadError
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
        # libp2p 0.8.1's own, less its PY_YAMUX_RELEASE_ON_READ branch (on by default), which sends
        # a WINDOW_UPDATE after every read: two more Noise messages and socket writes per decode
        # frame. Credit still returns once it reaches the threshold (half the target window), so a
        # writer blocked on a full window always gets it: everything it sent has been read then.
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
            elif 0 < delta < threshold and bytes_read > 0:
                self.recv_window += delta + bytes_read
                total_delta = delta + bytes_read
                self._pending_recv_release -= bytes_read
                total_delta += self._apply_autotune_epoch(buffered)
        if total_delta > 0:
            await self.send_window_update(total_delta, skip_lock=True)

    async def write(self, data: bytes) -> None:
        import struct

        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        view = memoryview(data)
        total, sent = len(view), 0
        while sent < total:
            frame = None
            with trio.move_on_after(WINDOW_WAIT_S) as waited:
                while frame is None:
                    async with self.rw_lock.write_lock():
                        if self.send_closed:
                            raise MuxedStreamError("Stream is closed for sending")
                        async with self.window_lock:
                            if self.closed:
                                raise MuxedStreamError("Stream is closed")
                            if self.send_window > 0:
                                n = min(self.send_window, BULK_FRAME_BYTES, total - sent)
                                self.send_window -= n
                                frame = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, self.stream_id, n) \
                                    + view[sent:sent + n].tobytes()
                    if frame is None:
                        self._zero_window_waits += 1
                        await trio.sleep(WINDOW_POLL_S)
            if waited.cancelled_caught:
                raise MuxedStreamError(f"Timed out waiting for window update after {WINDOW_WAIT_S:g} seconds.")
            await self.conn._write_frame(frame)
            sent += len(frame) - HEADER_SIZE


def bulk_stream(net_stream):
    """Make the Yamux stream under a libp2p net stream a ``BulkYamuxStream`` and return the net
    stream. libp2p 0.8.1 builds every Yamux connection with its own class (its muxer selector
    ignores the class a host is given), so the streams swarm reads and writes are re-typed one by
    one as ``SwarmHost`` opens or accepts them: the subclass adds a method and no state, and any
    other stream (a DHT or identify stream, or another muxer's) is left as it is."""
    muxed = getattr(net_stream, "muxed_stream", None)
    if type(muxed) is YamuxStream:
        muxed.__class__ = BulkYamuxStream
    return net_stream

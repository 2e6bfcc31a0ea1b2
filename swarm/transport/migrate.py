"""Moving hops off relays: once a hole punch gives a direct connection, relayed streams move onto it.

Owns: the move protocol ``/swarm/migrate/1`` (docs/protocol.md, "Transport"), ``Migrator`` (its handler, new
streams waiting by token, the loop that starts moves, ``relay_gone``) and ``BufferedRaw`` (a raw stream read
ahead into memory); the handover at a frame boundary is ``FramedStream.migrate``. Why: docs/architecture.md.
"""

from __future__ import annotations

import logging
import weakref

import trio

from swarm.addrs import peer_id_from_addr
from swarm.errors import ProtocolError, StreamClosed
from swarm.transport.dataplane import bulk_stream
from swarm.transport.framing import (
    LENGTH_PREFIX_BYTES,
    decode_body,
    decode_length_prefix,
    encode_frame,
    is_relayed,
)

log = logging.getLogger(__name__)

PROTOCOL_ID = "/swarm/migrate/1"
TAKE_TIMEOUT_S = 10.0  # how long a ``_moved`` marker waits for its new stream (and a new stream for its taker)
CHECK_S = 0.5  # how often relayed streams are checked for a direct connection to their peer
READ_BYTES = 256 * 1024


def relay_ids(raw) -> set[str]:
    """PeerIds of the relays a relayed stream's connection runs through (empty: direct, or unknown)."""
    net = getattr(raw, "net", raw)
    conn = getattr(net, "swarm_conn", None)
    try:
        addrs = [str(a) for a in conn.get_transport_addresses()] if conn is not None else []
    except Exception:
        return set()
    return {peer_id_from_addr(a.split("/p2p-circuit", 1)[0]) for a in addrs if "/p2p-circuit" in a} - {""}


class BufferedRaw:
    """A libp2p stream read ahead into memory by a task in ``nursery`` (``read``/``write``/
    ``close``/``reset`` as FramedStream needs them). ``net`` is the wrapped stream."""

    def __init__(self, net, nursery: trio.Nursery, leftover: bytes = b"") -> None:
        self.net = net
        self._send, self._recv = trio.open_memory_channel(float("inf"))
        self._buf = bytearray(leftover)
        self._eof = False
        self._error: BaseException | None = None
        nursery.start_soon(self._pump)

    async def _pump(self) -> None:
        try:
            while True:
                data = await self.net.read(READ_BYTES)
                if not data:
                    break
                self._send.send_nowait(data)
        except Exception as e:  # noqa: BLE001 - reported to the reader
            self._error = e
        finally:
            self._send.close()

    async def read(self, n: int) -> bytes:
        while not self._buf and not self._eof:
            try:
                self._buf += await self._recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                self._eof = True
                if self._error is not None:
                    raise self._error
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def write(self, data: bytes) -> None:
        await self.net.write(data)

    async def close(self) -> None:
        await self.net.close()

    async def reset(self) -> None:
        await self.net.reset()


async def _read_token(net) -> tuple[bytes, bytes]:
    """The first frame of a move stream (its token) and any bytes read past it."""
    buf = b""
    while len(buf) < LENGTH_PREFIX_BYTES:
        data = await net.read(READ_BYTES)
        if not data:
            raise StreamClosed("the move stream ended before its token")
        buf += data
    length = decode_length_prefix(buf[:LENGTH_PREFIX_BYTES], 64)
    while len(buf) < LENGTH_PREFIX_BYTES + length:
        data = await net.read(READ_BYTES)
        if not data:
            raise StreamClosed("the move stream ended inside its token")
        buf += data
    msg = decode_body(buf[LENGTH_PREFIX_BYTES:LENGTH_PREFIX_BYTES + length])
    token = msg.get("token")
    if not isinstance(token, bytes) or len(token) != 16:
        raise ProtocolError("a move stream must start with {token: 16 bytes}")
    return token, buf[LENGTH_PREFIX_BYTES + length:]


class Migrator:
    """A host's side of stream moves (see the module docstring); built by ``open_host``.

    Args:
        libp2p_host: the host. nursery: where read-ahead and the check loop run. bulk: re-type
            the streams it makes with ``swarm.transport.dataplane.bulk_stream``.
    """

    def __init__(self, libp2p_host, nursery: trio.Nursery, bulk: bool = False) -> None:
        self.host = libp2p_host
        self.bulk = bulk  # new streams send large Yamux frames, as the host's framed streams do
        self.nursery = nursery
        self.outbound: weakref.WeakSet = weakref.WeakSet()  # FramedStreams this node opened
        self._waiting: dict[tuple[str, bytes], BufferedRaw] = {}
        self._arrived = trio.Event()

    def install(self) -> None:
        from libp2p.custom_types import TProtocol

        self.host.set_stream_handler(TProtocol(PROTOCOL_ID), self._handle)

    def watch(self, stream) -> None:
        """Move ``stream`` (one this node opened) off its relay once a direct connection exists;
        protect its peer's connections from being trimmed meanwhile (a second connection to a
        peer would otherwise close the older, relayed one under the hop)."""
        self.outbound.add(stream)
        self.protect_if_relayed(stream)

    def protect_if_relayed(self, stream) -> None:
        if is_relayed(stream.raw):
            from libp2p.peer.id import ID

            self.host.get_network().protect(ID.from_base58(stream.remote_peer_id), "swarm-relayed-hop")

    async def _handle(self, net) -> None:
        peer = net.muxed_conn.peer_id.to_base58()
        try:
            with trio.fail_after(TAKE_TIMEOUT_S):
                token, leftover = await _read_token(net)
        except Exception as e:  # noqa: BLE001 - a bad or slow move stream is dropped, nothing else
            log.info("hop.move_refused peer=%s reason=%r", peer, e)
            await net.reset()
            return
        if self.bulk:
            bulk_stream(net)
        raw = BufferedRaw(net, self.nursery, leftover)
        key = (peer, token)
        self._waiting[key] = raw
        self._arrived.set()
        self._arrived = trio.Event()
        await trio.sleep(TAKE_TIMEOUT_S)
        if self._waiting.pop(key, None) is not None:  # nobody took it: no stream of that peer moved
            log.info("hop.move_unclaimed peer=%s", peer)
            await net.reset()

    async def open(self, stream, token: bytes) -> BufferedRaw:
        """A new stream to ``stream``'s peer (libp2p picks the best connection: direct first),
        announced by ``token``."""
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        try:
            net = await self.host.new_stream(ID.from_base58(stream.remote_peer_id), [TProtocol(PROTOCOL_ID)])
            await net.write(encode_frame({"token": token}))
        except Exception as e:  # noqa: BLE001 - any failure: the stream stays where it is
            raise StreamClosed(f"cannot open a stream to move onto: {type(e).__name__}: {e}") from e
        if self.bulk:
            bulk_stream(net)
        return BufferedRaw(net, self.nursery)

    async def take(self, peer: str, token: bytes) -> BufferedRaw:
        """The new stream ``peer`` opened for ``token`` (waiting up to ``TAKE_TIMEOUT_S``).

        Raises:
            StreamClosed: it did not arrive in time.
        """
        with trio.move_on_after(TAKE_TIMEOUT_S):
            while (peer, token) not in self._waiting:
                await self._arrived.wait()
            return self._waiting.pop((peer, token))
        raise StreamClosed(f"peer {peer} moved a stream but its new stream never arrived")

    def relay_gone(self, stream) -> bool:
        """True when ``stream`` runs through a relay this node no longer has a connection to."""
        from libp2p.peer.id import ID

        me = self.host.get_id().to_base58()
        relays = relay_ids(stream._wraw) - {me}  # inbound relayed connections name us as their relay
        network = self.host.get_network()
        return bool(relays) and not any(network.get_connections(ID.from_base58(r)) for r in relays)

    def direct_connection(self, peer: str) -> bool:
        from libp2p.peer.id import ID

        for conn in self.host.get_network().get_connections(ID.from_base58(peer)):
            try:
                if not any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses()):
                    return True
            except Exception:
                continue
        return False

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Every ``CHECK_S``: move each open outbound stream that runs over a relay and whose peer
        now has a direct connection."""
        task_status.started()
        while True:
            await trio.sleep(CHECK_S)
            for stream in list(self.outbound):
                if stream.closed or stream._pending_raw is not None:
                    continue
                if self.relay_gone(stream):
                    # libp2p 0.8.1 does not notice that a circuit died with its relay (writes
                    # vanish without an error; measured in the NAT lab): fail it now, so the ring
                    # heals instead of waiting for a timeout
                    log.warning("hop.relay_lost peer=%s protocol=%s: its relay is gone", stream.remote_peer_id,
                                stream.protocol_id)
                    await stream.reset()
                    continue
                if not is_relayed(stream._wraw) or not self.direct_connection(stream.remote_peer_id):
                    continue
                try:
                    await stream.migrate()
                except Exception as e:  # noqa: BLE001 - it stays relayed and is tried again
                    log.info("hop.move_failed peer=%s reason=%r", stream.remote_peer_id, e)

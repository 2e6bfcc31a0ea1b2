"""The libp2p host of a swarm node: listen, dial, and hand out framed streams.

Owns: ``open_host`` -> ``SwarmHost``: py-libp2p on TCP + Noise + Yamux and nothing else (its defaults would also
offer TLS, secio and plaintext), its lifetime on trio, listen-address checks, dials under deadlines, and libp2p
failures mapped onto swarm errors. No torch.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.exceptions import StreamFailure
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.protocol_muxer.exceptions import MultiselectClientError, ProtocolNotSupportedError
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from swarm.addrs import without_peer_id
from swarm.errors import ConfigError, HopTimeout, ListenError, ProtocolError, StageLost
from swarm.transport import dataplane
from swarm.transport.circuit import CircuitClient, RelayError, is_circuit
from swarm.transport.migrate import Migrator
from swarm.transport.framing import MAX_FRAME_BYTES, FramedStream, Meter
from swarm.transport.identity import peer_id_of
from swarm.transport.names import SystemResolvingTCP
from swarm.transport.peerstore import MAX_PEERS, BoundedPeerStore, guard_handlers, live_peers

log = logging.getLogger(__name__)

DEFAULT_LISTEN_ADDRS = ("/ip4/127.0.0.1/tcp/0",)
StreamHandler = Callable[[FramedStream], Awaitable[None]]


class SwarmHost:
    """A running libp2p host; obtain one from ``open_host``."""

    def __init__(self, host: IHost, nursery: trio.Nursery, key_pair=None, circuits=None, migrator=None,
                 bulk: bool = False) -> None:
        self.libp2p_host = host  # escape hatch for diagnostics; swarm code should not need it
        self._nursery = nursery
        self.key_pair = key_pair  # the node key: signs session assignments and receipts
        # circuit relay v2 (swarm.transport.circuit.CircuitClient): relayed connections in and out
        self.circuits = circuits
        # swarm.transport.migrate.Migrator: moves streams this node opened off a relay once a
        # direct connection to the peer exists
        self.migrator = migrator
        self.bulk = bulk  # framed streams send large Yamux frames (swarm.transport.dataplane)
        self.meter = Meter()  # frames and bytes through every framed stream of this host (metrics)
        # streams to one peer are negotiated one at a time (they share its connection); one lock
        # per peer, so a peer that does not answer delays only dials to itself
        self._open_locks: dict[str, trio.Lock] = {}
        self._peer_id = host.get_id().to_base58()

    @property
    def peer_id(self) -> str:
        """This node's base58 PeerId."""
        return self._peer_id

    def addrs(self) -> list[str]:
        """Full dialable multiaddrs of this node, each ending in ``/p2p/<peer_id>``.

        Returns:
            The actually bound addresses (a requested port 0 shows the kernel's choice).
        """
        out = []
        for addr in self.libp2p_host.get_addrs():
            text = str(addr)
            out.append(text if "/p2p/" in text else f"{text}/p2p/{self._peer_id}")
        return out

    def set_handler(
        self, protocol_id: str, handler: StreamHandler, *, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        """Serve inbound streams of ``protocol_id`` with ``handler(FramedStream)``.

        Each inbound stream runs ``handler`` in its own task with the stream's reader task in a
        nursery scoped to it; the stream is closed when the handler returns, so a handler that
        serves a long-lived hop simply keeps awaiting. An exception escaping the handler is
        logged with its traceback and resets that stream only.

        Args:
            protocol_id: multistream protocol id, e.g. ``/swarm/hop/1``.
            handler: async callable taking the FramedStream.
            max_frame_bytes: largest frame body accepted on these streams.
        """

        async def serve(net_stream: INetStream) -> None:
            stream = self._framed(net_stream, protocol_id, max_frame_bytes)
            if self.migrator is not None:
                self.migrator.protect_if_relayed(stream)
            log.debug("hop.accept peer=%s protocol=%s", stream.remote_peer_id, protocol_id)
            try:
                async with trio.open_nursery() as nursery:
                    stream.start(nursery)
                    try:
                        await handler(stream)
                    except BaseException:
                        await stream.reset()  # mid-conversation: tell the peer at once
                        raise
                    finally:
                        await stream.aclose()  # also stops the reader so the nursery can exit
            except Exception:  # root of a stream task: report, never take the host down
                log.exception(
                    "hop.handler_failed peer=%s protocol=%s", stream.remote_peer_id, protocol_id
                )

        self.libp2p_host.set_stream_handler(TProtocol(protocol_id), serve)

    def _framed(self, net_stream: INetStream, protocol_id: str, max_frame_bytes: int) -> FramedStream:
        """A (not yet started) FramedStream over a negotiated libp2p stream, either direction: on the
        bulk data plane when the host uses it, moved off relays by the migrator, counted by the meter."""
        if self.bulk:
            dataplane.bulk_stream(net_stream)
        return FramedStream(
            net_stream,
            remote_peer_id=_remote_peer_id(net_stream),
            protocol_id=protocol_id,
            max_frame_bytes=max_frame_bytes,
            migrator=self.migrator,
            meter=self.meter,
        )

    async def _dial(self, info, start: float, addr: str) -> None:
        if is_circuit(addr):  # libp2p's dialer skips circuit addresses: through the relay transport
            if self.circuits is None:
                raise ConfigError(f"{addr} is a relayed address and this node has no relay support")
            await self.circuits.dial(addr)
            log.debug("hop.dial_relayed peer=%s waited_s=%.3f", info.peer_id, trio.current_time() - start)
            return
        # The swarm dials only one TCP addr per peer, possibly a stale one from an earlier dial
        # or identify: dial exactly the addr we were given.
        host = self.libp2p_host
        host.get_peerstore().clear_addrs(info.peer_id)
        host.get_network().unblock_peer(info.peer_id)
        await host.connect(info)
        log.debug("hop.dial peer=%s waited_s=%.3f", info.peer_id, trio.current_time() - start)

    async def _new_stream(self, info, protocol_id: str, start: float, addr: str):
        """Negotiate one stream to ``info.peer_id``, dialing first if there is no connection.
        A connection libp2p still lists can be dead (its path went away, e.g. a relay or a peer that
        restarted on a new port): then drop it and dial afresh, once."""
        host = self.libp2p_host
        network = host.get_network()
        had_connection = bool(network.get_connections(info.peer_id))
        if had_connection and self.circuits is not None and self.circuits.orphaned(info.peer_id):
            # relayed only, through relays we no longer reach: libp2p 0.8.1 does not notice that
            # such a connection died with its relay, and a new stream on it would hang
            log.info("hop.redial peer=%s reason=relay-gone", info.peer_id)
            await network.close_peer(info.peer_id)
            had_connection = False
        if not had_connection:
            await self._dial(info, start, addr)
        try:
            return await host.new_stream(info.peer_id, [TProtocol(protocol_id)])
        except (SwarmException, StreamFailure) as e:
            if not had_connection or (isinstance(e, StreamFailure) and is_unsupported_protocol(e)):
                raise
            log.info("hop.redial peer=%s reason=stale-connection error=%r", info.peer_id, e)
            await network.close_peer(info.peer_id)
            await self._dial(info, start, addr)
            return await host.new_stream(info.peer_id, [TProtocol(protocol_id)])

    async def _open_net_stream(self, addr: str, protocol_id: str, timeout_s: float):
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except (ValueError, multiaddr.exceptions.Error) as e:
            raise ConfigError(f"not a dialable multiaddr with /p2p/<peer_id>: {addr!r} ({e})") from e
        start = trio.current_time()
        try:
            with trio.fail_after(timeout_s):
                async with self._open_locks.setdefault(str(info.peer_id), trio.Lock()):
                    net_stream = await self._new_stream(info, protocol_id, start, addr)
        except trio.TooSlowError:
            log.warning("hop.dial_timeout addr=%s protocol=%s waited_s=%.2f", addr, protocol_id, timeout_s)
            raise HopTimeout(
                f"opening {protocol_id} to {addr} timed out after {timeout_s}s"
            ) from None
        except StreamFailure as e:
            if is_unsupported_protocol(e):
                raise ProtocolError(f"peer at {addr} does not speak {protocol_id}") from e
            raise StageLost(f"cannot open {protocol_id} to {addr}: {e}") from e
        except RelayError as e:
            log.info("hop.unreachable addr=%s error=%s", addr, e)
            raise StageLost(str(e)) from e
        except (BaseLibp2pError, OSError) as e:
            log.info("hop.unreachable addr=%s error=%s", addr, e)
            raise StageLost(f"peer at {addr} {dial_failure(e, str(info.peer_id))}") from e
        log.debug("hop.open peer=%s protocol=%s waited_s=%.3f", info.peer_id, protocol_id, trio.current_time() - start)
        return net_stream

    async def open_raw_stream(self, addr: str, protocol_id: str, timeout_s: float = 10.0):
        """Like ``open_stream`` but return libp2p's own net stream, unframed (for libp2p protocols
        such as ping). Same dialing rules, deadline and errors as ``open_stream``."""
        return await self._open_net_stream(addr, protocol_id, timeout_s)

    async def open_stream(
        self,
        addr: str,
        protocol_id: str,
        timeout_s: float = 10.0,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> FramedStream:
        """Connect to a peer (if not connected) and open a new framed stream to it.

        When not connected, the peer is taken off libp2p's 60 s negative dial cache and its
        remembered addresses are replaced by ``addr``, so a restarted stage or a spare at the
        same PeerId but a new port can be reached at once. An existing connection is reused.

        Args:
            addr: full multiaddr ending in ``/p2p/<peer_id>``.
            protocol_id: protocol to negotiate on the new stream.
            timeout_s: deadline in seconds for dial + stream negotiation together.
            max_frame_bytes: largest frame body accepted on this stream.
        Returns:
            A started FramedStream; its reader runs in the host's nursery.
        Raises:
            ConfigError: ``addr`` is not a multiaddr with a ``/p2p/`` PeerId.
            HopTimeout: the deadline passed.
            StageLost: the peer is unreachable, refused, or failed the Noise handshake.
            ProtocolError: the peer does not speak ``protocol_id``.
        """
        net_stream = await self._open_net_stream(addr, protocol_id, timeout_s)
        stream = self._framed(net_stream, protocol_id, max_frame_bytes)
        stream.start(self._nursery)
        if self.migrator is not None:
            self.migrator.watch(stream)
        return stream


@asynccontextmanager
async def open_host(
    key_pair: KeyPair,
    listen_addrs: Sequence[str] = DEFAULT_LISTEN_ADDRS,
    *,
    dial_retries: int = 1,
    health_check_interval_s: float | None = None,
    announce_addrs: Sequence[str] = (),
    relay_hop: bool = False,
    hole_punch: bool = True,
    batched: bool = True,
    max_peers: int = MAX_PEERS,
) -> AsyncIterator[SwarmHost]:
    """Run a libp2p host (TCP, Noise only, Yamux only) for the duration of the block.

    Args:
        key_pair: the node's ed25519 key (see ``load_or_create_key``); fixes the PeerId.
        listen_addrs: TCP multiaddrs such as ``/ip4/127.0.0.1/tcp/0`` (port 0: any free port;
            ``SwarmHost.addrs()`` reports the bound one).
        dial_retries: extra TCP dial attempts libp2p makes per connect (0.1 s, 0.2 s... apart).
        health_check_interval_s: if set, enable libp2p's connection health monitor: ping each
            connection this often and close it when a ping fails, so a frozen peer surfaces
            as StreamClosed instead of a silent hang. Off by default (hops carry their own
            deadlines and heartbeats).
        announce_addrs: TCP multiaddrs to advertise instead of the bound ones (identify, DHT,
            ``SwarmHost.addrs()``), e.g. a port forward or relay in front of this node.
        relay_hop: also relay circuits for others (``swarm relay``). Every host accepts relayed
            connections and dials ``/p2p-circuit`` addresses (``swarm.transport.circuit``).
        hole_punch: run DCUtR on relayed connections, and move the streams this node opened onto
            a punched direct connection (``swarm.transport.migrate``). False keeps them relayed.
        batched: Noise sessions that send a write in one socket call and read in large blocks,
            and Yamux DATA frames of up to 1 MiB (``swarm.transport.dataplane``; the same
            protocols on the wire). False: libp2p's own classes (for comparison in benchmarks).
        max_peers: peers the peer store remembers besides this node and the connected ones; past
            it, the departed peers heard of longest ago are forgotten (``swarm.transport.peerstore``).
    Yields:
        The SwarmHost. Its nursery (outbound stream readers) is cancelled on exit.
    Raises:
        ConfigError: a listen address is malformed, not TCP, already in use, or not local, or
            max_peers < 1.
    """
    if max_peers < 1:
        raise ConfigError(f"max_peers must be >= 1, got {max_peers}")
    if dial_retries < 0:
        raise ConfigError(f"dial_retries must be >= 0, got {dial_retries}")
    maddrs = [_parse_listen_addr(a) for a in listen_addrs]
    if not maddrs:
        raise ConfigError("open_host needs at least one listen address")
    for maddr in maddrs:
        _probe_bindable(maddr)
    announce = [_parse_announce_addr(a) for a in announce_addrs]
    _route_libp2p_logs()
    host = _new_libp2p_host(key_pair, maddrs, announce, dial_retries=dial_retries,
                            health_check_interval_s=health_check_interval_s, batched=batched,
                            max_peers=max_peers)
    async with host.run(maddrs):
        network = host.get_network()
        # The auto-connector dials every peer in the peerstore until it holds ~150
        # connections, and re-dials dead ones every 10 s; the ring decides whom we dial.
        await network.auto_connector.stop()
        listening = network.listeners
        failed = [str(m) for m in maddrs if str(m) not in listening]
        if failed:
            raise ListenError(", ".join(failed), why="address in use or not local", flag="--listen")
        log.info("host.start peer=%s addrs=%s", peer_id_of(key_pair), [str(a) for a in host.get_addrs()])
        async with trio.open_nursery() as nursery:
            circuits = CircuitClient(host, hop=relay_hop, hole_punch=hole_punch)
            await nursery.start(circuits.run)
            migrator = Migrator(host, nursery, bulk=batched)
            migrator.install()
            await nursery.start(migrator.run)
            try:
                yield SwarmHost(host, nursery, key_pair, circuits, migrator, bulk=batched)
            finally:
                nursery.cancel_scope.cancel()
                # libp2p 0.8.1 leaves its connections and listening sockets open when the host
                # stops: a peer never saw this host go (a client that connected again with the same
                # key was refused by the peer's per-peer connection limit after 8 runs in one
                # process), and a node restarted in the same process could not listen on its port
                with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                    await _close_connections(network)
                    for listener in list(network.listeners.values()):
                        await listener.close()
    log.info("host.stop peer=%s", peer_id_of(key_pair))


async def _close_connections(network) -> None:
    """Close every connection of ``network`` (a libp2p Swarm): Yamux says GO_AWAY, the socket
    closes, so each peer drops the connection at once instead of holding it until a timeout."""
    for peer, conns in list(network.connections.items()):
        for conn in list(conns):
            try:
                await conn.close()
            except Exception as exc:  # noqa: BLE001 - a connection already broken is closed enough
                log.debug("host.close_conn peer=%s error=%r", peer, exc)


def _new_libp2p_host(key_pair: KeyPair, maddrs: list, announce: list, *, dial_retries: int,
                     health_check_interval_s: float | None, batched: bool, max_peers: int = MAX_PEERS):
    """The libp2p host ``open_host`` runs (not started): TCP, Noise only (batched or libp2p's own),
    Yamux only, ``dial_retries`` extra dials per connect, busy connections kept, a peer store bounded
    by forgetting departed peers, and no stream handler's exception ending the host."""
    if batched:
        dataplane.check_version()
    noise = dataplane.BatchedNoiseTransport if batched else NoiseTransport
    peerstore = BoundedPeerStore(ID.from_pubkey(key_pair.public_key), max_peers)
    host = new_host(
        key_pair=key_pair,
        sec_opt={
            TProtocol(NOISE_PROTOCOL_ID): noise(
                key_pair, noise_privkey=create_x25519_key_pair().private_key
            )
        },
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=maddrs,
        transports=[SystemResolvingTCP()],  # /dns4 names as the system resolves them
        connection_config=_connection_config(health_check_interval_s),
        announce_addrs=announce or None,
        peerstore_opt=peerstore,
    )
    peerstore.watch(live_peers(host.get_network()))
    guard_handlers(host.get_network())
    # new_host takes no retry option; the swarm reads this attribute on every dial.
    host.get_network().retry_config = RetryConfig(max_retries=dial_retries)
    _keep_busy_connections(host.get_network())
    return host


INBOUND_CAP = 10_000_000


def _connection_config(health_check_interval_s: float | None) -> ConnectionConfig:
    # max_connections_per_peer=1: the swarm's dial waits for either that many connections or
    # its 250 ms happy-eyeballs delay, even with a single address; 1 makes connect ~5 ms.
    # Extra connections from a simultaneous dial are within the grace period and kept.
    # max_connections: libp2p 0.8.1 gives each inbound connection a slot of a limiter sized
    # max_connections - min_connections (default 250) and returns it only when the whole swarm
    # stops, so a stage refused every dial after its 250th coordinator. A large cap postpones
    # that leak far beyond a daemon's life (live connections are still few).
    if health_check_interval_s is None:
        return ConnectionConfig(max_connections_per_peer=1, max_connections=INBOUND_CAP)
    if not health_check_interval_s > 0:
        raise ConfigError(f"health_check_interval_s must be > 0, got {health_check_interval_s}")
    return ConnectionConfig(
        max_connections_per_peer=1,
        max_connections=INBOUND_CAP,
        enable_health_monitoring=True,
        health_initial_delay=health_check_interval_s,
        health_warmup_window=0.0,
        health_check_interval=health_check_interval_s,
        ping_timeout=min(5.0, health_check_interval_s),
        abort_connection_on_ping_failure=True,
    )


def _keep_busy_connections(network) -> None:
    """Never let libp2p's per-peer limit close a connection that carries streams.

    With ``max_connections_per_peer=1``, libp2p 0.8.1 closes a peer's surplus connection as soon as a
    newer one arrives, choosing among those past the 20 s grace period *whatever their streams*. A
    second connection from a known PeerId (a second process run with the same key, a coordinator
    restarted while its old connection lingers) thus cut every live session of the first at a stage.
    Surplus connections without streams are still trimmed as libp2p does; busy ones close when their
    peer closes them.
    """
    trim = network._trim_connections

    def trim_idle_only(peer_id) -> None:
        if any(_has_streams(c) for c in network.connections.get(peer_id, ())):
            log.debug("conn.keep peer=%s connections=%d: a busy connection is never trimmed", peer_id,
                      len(network.connections.get(peer_id, ())))
            return
        trim(peer_id)

    network._trim_connections = trim_idle_only


def _has_streams(conn) -> bool:
    try:
        return bool(conn.get_streams())
    except Exception:  # a connection closing under us: libp2p's own trim counts it as idle too
        return False


def _parse_listen_addr(addr: str) -> multiaddr.Multiaddr:
    try:
        maddr = multiaddr.Multiaddr(addr)
    except (ValueError, multiaddr.exceptions.Error) as e:
        raise ConfigError(f"listen address {addr!r} is not a multiaddr: {e}") from e
    names = [p.name for p in maddr.protocols()]
    if len(names) != 2 or names[0] not in ("ip4", "ip6") or names[1] != "tcp":
        raise ConfigError(f"listen address {addr} must be /ip4|ip6/<ip>/tcp/<port>")
    return maddr


def _parse_announce_addr(addr: str) -> multiaddr.Multiaddr:
    text = without_peer_id(addr)
    try:
        maddr = multiaddr.Multiaddr(text)
    except (ValueError, multiaddr.exceptions.Error) as e:
        raise ConfigError(f"announce address {addr!r} is not a multiaddr: {e}") from e
    protocols = [p.name for p in maddr.protocols()]
    if len(protocols) != 2 or protocols[0] not in ("ip4", "ip6", "dns4", "dns6") or protocols[1] != "tcp":
        raise ConfigError(f"announce address {addr!r} must be /ip4/H/tcp/P (or ip6/dns4/dns6)")
    return maddr


def _probe_bindable(maddr: multiaddr.Multiaddr, flag: str = "--listen") -> None:
    """Fail fast if a fixed TCP port is taken.

    libp2p binds listeners with SO_REUSEPORT (for hole punching), so a second libp2p host on
    the same port would *succeed* and silently share inbound connections. A probe socket with
    SO_REUSEADDR but without SO_REUSEPORT cannot bind a port someone listens on, while
    TIME_WAIT leftovers of a restarted node do not block it.
    """
    port = int(maddr.value_for_protocol("tcp"))
    if port == 0:
        return
    ip6 = maddr.value_for_protocol("ip6") if "ip6" in [p.name for p in maddr.protocols()] else None
    family, ip = (socket.AF_INET6, ip6) if ip6 else (socket.AF_INET, maddr.value_for_protocol("ip4"))
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as e:
            raise ListenError(str(maddr), e, flag) from None


def check_listen_addrs(addrs: Sequence[str], flag: str = "--listen") -> None:
    """Check, before any slow start-up work, that this node could listen on ``addrs``.

    Args:
        addrs: TCP multiaddrs (``/ip4/H/tcp/P``); port 0 always passes.
        flag: the command-line flag that named them, for the message.
    Raises:
        ConfigError: an address is malformed. ListenError: a fixed port is taken or the address is
            not local ("cannot listen on /ip4/127.0.0.1/tcp/4001: address already in use (pick
            another --listen, or stop the process using it)").
    """
    for addr in addrs:
        _probe_bindable(_parse_listen_addr(addr), flag)


LIBP2P_LOG_LEVEL: int | None = None  # set by the CLI: libp2p's own level (its import resets it to WARNING)


def _route_libp2p_logs() -> None:
    # `import libp2p` detaches its logger tree (propagate=False, no handlers) unless
    # LIBP2P_DEBUG is set, so its warnings bypass the daemon's logging config and land on
    # stderr via logging.lastResort. Route them through the standard tree instead.
    if not os.environ.get("LIBP2P_DEBUG"):
        logging.getLogger("libp2p").propagate = True
        if LIBP2P_LOG_LEVEL is not None:
            logging.getLogger("libp2p").setLevel(LIBP2P_LOG_LEVEL)
        # It pins itself to INFO and logs every cycle; we stop it (see open_host) anyway.
        logging.getLogger("libp2p.network.auto_connector").setLevel(logging.WARNING)


def _remote_peer_id(net_stream: INetStream) -> str:
    return net_stream.muxed_conn.peer_id.to_base58()


def is_unsupported_protocol(error: StreamFailure) -> bool:
    cause = error.__cause__
    if isinstance(cause, ProtocolNotSupportedError):
        return True
    # 0.8.1 folds the peer's "na" answers into a plain MultiselectClientError.
    return isinstance(cause, MultiselectClientError) and "not supported" in str(cause)


def dial_failure(error: BaseException, peer_id: str) -> str:
    """Why a dial failed, as the rest of a sentence about the peer, in words a user can act on:
    libp2p 0.8.1 says only "no addresses established a successful connection" and keeps each
    address's own error in the cause (a MultiError).

    Returns:
        "cannot be dialed: cannot resolve NAME: <the resolver's reason>" when a ``/dns4``, ``/dns6``
        or ``/dns`` name does not resolve (``swarm.transport.names``);
        "is not at that address: something answers there, but not as <peer_id> ..." when the
        address is reached but the key behind it is another (a wrong or stale ``/p2p/`` PeerId,
        e.g. a node that started again with a new key); "cannot be dialed from here: this process is
        out of file descriptors ..." when no socket could be opened (EMFILE, ENFILE: our fault, not the
        peer's); "is unreachable: nothing accepts connections there (...)" when the TCP connect failed;
        else "is unreachable: " and
        libp2p's own text with each address's error.
    """
    text = str(error) or type(error).__name__
    seen, todo, texts = set(), [error.__cause__], []  # every error below: the addresses' and what each wraps
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        texts.append(str(e))
        todo += [*getattr(e, "errors", ()), *getattr(e, "exceptions", ()), e.__cause__, e.__context__]
    unresolved = next((t for t in texts if t.startswith("cannot resolve ")), None)
    if unresolved is not None:
        return f"cannot be dialed: {unresolved.splitlines()[0][:200]}"
    if any("Too many open files" in t or "[Errno 23]" in t for t in texts):  # EMFILE / ENFILE: ours, not theirs
        return ("cannot be dialed from here: this process is out of file descriptors (EMFILE), so no socket could be "
                "opened and the peer may be fine (raise ulimit -n; swarm serve: lower --max-connections)")
    if any("failed to upgrade security" in t for t in texts):
        return (f"is not at that address: something answers there, but not as {peer_id[-8:]} (the Noise "
                "handshake failed), so the /p2p/ PeerId in the address is probably wrong or stale; a node started "
                "with a new key has a new PeerId: copy the address it prints now")
    tcp = next((t for t in texts if "Failed to open TCP stream" in t or "Connection refused" in t), None)
    if tcp is not None:
        return f"is unreachable: nothing accepts connections there ({tcp.splitlines()[0][:200]})"
    return f"is unreachable: {type(error).__name__}: {text}" + (f" ({texts[0][:300]})" if texts else "")

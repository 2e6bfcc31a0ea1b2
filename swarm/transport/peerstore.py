"""The node's libp2p peer store: bounded by forgetting departed peers, never the node itself.

Owns: ``BoundedPeerStore`` (libp2p's ``PeerStore``, its size limit applied to every entry it creates, evicting
neither this node nor connected peers) and ``guard_handlers`` (a stream handler's exception resets that stream
and is logged, never ends the host). Why: docs/architecture.md, "Notes by module".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore

log = logging.getLogger(__name__)

MAX_PEERS = 1000  # libp2p's own default
EVICT_TO = 0.9  # evict down to this fraction of max_peers, so a full store does not sort on every add


class BoundedPeerStore(PeerStore):
    """A PeerStore that holds at most ``max_peers`` entries of peers this node is not connected to.

    Past the limit, the departed peers heard of longest ago are forgotten first (their addresses,
    keys, protocols, records). This node's own entry and connected peers are never evicted, so the
    store may exceed the limit only by the peers connected right now.

    Args:
        own: this node's PeerId (its key pair lives here; identify and signed records read it).
        max_peers: entries kept; > 0.
        connected: ``connected(peer_id) -> bool`` (the network's live connections); set later
            with ``watch`` once the network exists. Until then every other peer counts as departed.
    Raises:
        ValueError: max_peers < 1.
    """

    def __init__(self, own: ID, max_peers: int = MAX_PEERS,
                 connected: Callable[[ID], bool] | None = None) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        super().__init__(max_peers=max_peers)
        self.own = own
        self.connected = connected or (lambda _peer_id: False)
        self.evicted = 0  # entries forgotten so far (diagnostics, tests)

    def watch(self, connected: Callable[[ID], bool]) -> None:
        """Spare the peers for which ``connected(peer_id)`` is true from eviction."""
        self.connected = connected

    def _enforce_peer_limit(self) -> None:
        if len(self.peer_data_map) <= self.max_peers:
            return
        keep = max(1, int(self.max_peers * EVICT_TO))
        departed = [(data.get_last_identified(), order, peer_id)
                    for order, (peer_id, data) in enumerate(self.peer_data_map.items())
                    if peer_id != self.own and not self._is_connected(peer_id)]
        departed.sort()  # heard of longest ago first; first added first among equals
        for _, _, peer_id in departed[:max(0, len(self.peer_data_map) - keep)]:
            self._forget(peer_id)
        if len(self.peer_data_map) > self.max_peers:
            log.debug("peerstore.over_limit entries=%d max_peers=%d: the rest are connected",
                      len(self.peer_data_map), self.max_peers)

    def _is_connected(self, peer_id: ID) -> bool:
        try:
            return bool(self.connected(peer_id))
        except Exception:  # noqa: BLE001 - a network closing under us: treat the peer as departed
            return False

    def _forget(self, peer_id: ID) -> None:
        self.peer_data_map.pop(peer_id, None)
        self.peer_record_map.pop(peer_id, None)
        self.addr_update_channels.pop(peer_id, None)
        self.evicted += 1

    def _bounded(self) -> None:
        if len(self.peer_data_map) > self.max_peers:
            self._enforce_peer_limit()

    # libp2p creates entries in all of these but enforces its limit only in add_addrs
    def add_addrs(self, peer_id, addrs, ttl: int = 0) -> None:
        super().add_addrs(peer_id, addrs, ttl)
        self._bounded()

    def add_pubkey(self, peer_id, pubkey) -> None:
        super().add_pubkey(peer_id, pubkey)
        self._bounded()

    def add_protocols(self, peer_id, protocols) -> None:
        super().add_protocols(peer_id, protocols)
        self._bounded()

    def set_protocols(self, peer_id, protocols) -> None:
        super().set_protocols(peer_id, protocols)
        self._bounded()

    def put(self, peer_id, key, val) -> None:
        super().put(peer_id, key, val)
        self._bounded()

    def record_latency(self, peer_id, RTT: float) -> None:  # noqa: N803 - libp2p's parameter name
        super().record_latency(peer_id, RTT)
        self._bounded()

    def consume_peer_record(self, envelope, ttl: int) -> bool:
        accepted = super().consume_peer_record(envelope, ttl)
        self._bounded()
        return accepted

    def clear_peerdata(self, peer_id: ID) -> None:
        if peer_id == self.own:  # the node's key pair: identify and signed records need it
            return
        super().clear_peerdata(peer_id)


StreamHandlerFn = Callable[[object], Awaitable[None]]


def guard_handlers(network) -> None:
    """Make an exception escaping any stream handler of ``network`` (a libp2p Swarm: identify, the
    DHT, relay, ping and swarm's own protocols) reset that stream and log it, instead of ending the
    connection's task tree and with it the host. Cancellation passes through."""
    inner: StreamHandlerFn = network.common_stream_handler

    async def guarded(net_stream) -> None:
        try:
            await inner(net_stream)
        except Exception:  # root of an inbound stream's task: report, never take the host down
            log.exception("stream.handler_failed peer=%s protocol=%s", _peer_of(net_stream),
                          _protocol_of(net_stream))
            try:
                await net_stream.reset()
            except Exception as exc:  # noqa: BLE001 - a stream already broken is reset enough
                log.debug("stream.reset_failed error=%r", exc)

    network.set_stream_handler(guarded)


def _peer_of(net_stream) -> str:
    try:
        return net_stream.muxed_conn.peer_id.to_base58()
    except Exception:  # noqa: BLE001 - for a log line only
        return "?"


def _protocol_of(net_stream) -> str:
    try:
        return str(net_stream.get_protocol())
    except Exception:  # noqa: BLE001 - for a log line only
        return "?"


def live_peers(network) -> Callable[[ID], bool]:
    """``connected(peer_id)`` for ``BoundedPeerStore.watch``: the peer has a connection in ``network``."""
    return lambda peer_id: bool(network.connections.get(peer_id))


__all__ = ["MAX_PEERS", "BoundedPeerStore", "guard_handlers", "live_peers"]

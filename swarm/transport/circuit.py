"""Circuit relay v2 for swarm nodes: serving as a relay, reserving on one, dialing through one.

Owns: circuit addresses (``is_circuit``, ``circuit_addr``, ``relay_part``), ``RelayService`` (libp2p 0.8.1's hop
service without data or time caps, closing only its own circuit), ``CircuitClient`` (relayed connections,
``/p2p-circuit`` dials, DCUtR, ``keep_reservation``) and ``check_version``. Why: docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from importlib.metadata import version as _dist_version

import multiaddr
import trio

from swarm.addrs import peer_id_from_addr
from swarm.errors import ConfigError, SwarmError

log = logging.getLogger(__name__)

PINNED_LIBP2P = "0.8.1"
HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/stop"
READ_BYTES = 256 * 1024
RESERVATION_TTL_S = 3600  # a relay's reservations; clients renew well before the end
RENEW_MARGIN_S = 300  # renew a reservation this long before it expires
MAX_RESERVATIONS = 1024
MAX_CIRCUITS_PER_PEER = 1024
DCUTR_DIAL_TIMEOUT_S = 2
MAX_RETRY_S = 10.0  # longest wait between attempts to reserve again on a relay that is gone


class RelayError(SwarmError):
    """A relay could not be reached, refused a reservation, or a circuit could not be opened."""


def check_version() -> None:
    """Refuse a libp2p other than the pinned one (``RelayService`` overrides a private method).

    Raises:
        ConfigError: another libp2p version is installed.
    """
    got = _dist_version("libp2p")
    if got != PINNED_LIBP2P:
        raise ConfigError(f"swarm's relay support is pinned to libp2p {PINNED_LIBP2P}, found {got}: "
                          f"install libp2p=={PINNED_LIBP2P}")


def is_circuit(addr: str) -> bool:
    """True for a ``.../p2p/<relay>/p2p-circuit/p2p/<peer>`` address."""
    return "/p2p-circuit" in addr


def circuit_addr(relay_addr: str, peer_id: str) -> str:
    """The address at which ``peer_id`` is reachable through the relay at ``relay_addr``.

    Raises:
        ConfigError: ``relay_addr`` is not a direct multiaddr ending in ``/p2p/<relay PeerId>``.
    """
    relay_id = peer_id_from_addr(relay_addr)
    if is_circuit(relay_addr) or not relay_id:
        raise ConfigError(f"a relay address is a direct multiaddr ending in /p2p/<PeerId>, got {relay_addr!r}")
    return f"{relay_addr}/p2p-circuit/p2p/{peer_id}"


def relay_part(addr: str) -> str:
    """The relay's own address inside a circuit address (``addr`` before ``/p2p-circuit``)."""
    return addr.split("/p2p-circuit", 1)[0]


def _limits():
    from libp2p.relay.circuit_v2.resources import RelayLimits

    # duration 0: no deadline on a circuit. data is never checked (see RelayService._relay_data).
    return RelayLimits(duration=0, data=0, max_circuit_conns=MAX_CIRCUITS_PER_PEER,
                       max_reservations=MAX_RESERVATIONS, reservation_ttl=RESERVATION_TTL_S)


def _service_class():
    """``RelayService``, built on first use so importing this module does not import libp2p's relay."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol

    class RelayService(CircuitV2Protocol):
        """libp2p's circuit relay v2 service with a data plane's limits (see the module docstring)."""

        async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None, circuit_data_limit=None) -> None:
            # Copy one direction of one circuit until its source ends; then close this circuit's
            # two streams (and no other circuit's: libp2p 0.8.1 looked them up by peer).
            try:
                while True:
                    data = await src_stream.read(READ_BYTES)
                    if not data:
                        break
                    await dst_stream.write(data)
            except Exception as e:  # a reset or closed end: the circuit is over
                log.debug("relay.circuit_end peer=%s reason=%r", peer_id, e)
            finally:
                for stream in (src_stream, dst_stream):
                    with trio.move_on_after(1.0):
                        try:
                            await stream.close()
                        except Exception:
                            pass

    return RelayService


class CircuitClient:
    """A node's side of circuit relay v2: accept relayed connections, dial circuit addresses,
    hold reservations. Built by ``open_host``; reached as ``SwarmHost.circuits``.

    Args:
        host: the libp2p host. nursery: where the services run (the SwarmHost's).
        hop: also serve as a relay for others (``swarm relay``).
        hole_punch: run DCUtR (False: relayed connections stay relayed).
    """

    def __init__(self, host, hop: bool = False, hole_punch: bool = True) -> None:
        from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
        from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
        from libp2p.relay.circuit_v2.transport import CircuitV2Transport

        check_version()
        self.host = host
        self.hop = hop
        cls = _service_class() if hop else CircuitV2Protocol
        self.protocol = cls(host, limits=_limits(), allow_hop=hop)
        # STOP only: dialing through a relay must not also take a reservation there (CLIENT would)
        self.transport = CircuitV2Transport(host, self.protocol, RelayConfig(roles=RelayRole.STOP))
        self.reserved: dict[str, str] = {}  # relay addr -> our circuit addr, while a reservation holds
        # connections seen direct (a connection's addresses never change): ``orphaned`` looks at them no more.
        # Read afresh every 0.5 s for every connection, their addresses cost 12% of the CPU of 25 DHT
        # nodes per process with ~100 connections each (issue 31, bench/dht_scale.py under py-spy)
        self._direct: weakref.WeakSet = weakref.WeakSet()
        # hole punching on every relayed connection (libp2p drives it by itself); a 2 s dial
        # timeout: the first dial of a punch goes to the peer's private address, and with the
        # default 10 s it waited that out before every punch through two NATs (issue 15)
        from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

        self.dcutr = DCUtRProtocol(host, dial_timeout=DCUTR_DIAL_TIMEOUT_S) if hole_punch else None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the relay protocol service (STOP handler; HOP too for a relay) and DCUtR until cancelled."""
        from libp2p.tools.anyio_service import background_trio_service

        async with background_trio_service(self.protocol):
            await self.protocol.event_started.wait()
            if self.dcutr is None:
                task_status.started()
                await self._prune_orphans()
            async with background_trio_service(self.dcutr):
                await self.dcutr.event_started.wait()
                task_status.started()
                await self._prune_orphans()

    async def _prune_orphans(self, every_s: float = 0.5) -> None:
        """Close connections that only ran through relays this node lost (forever, every ``every_s``).

        libp2p 0.8.1 keeps such a connection listed and writes into it without an error when the
        relay is gone, so a hop on it would swallow frames until a timeout; closed, its streams
        fail at once and the ring heals (measured in the NAT lab, issue 15)."""
        network = self.host.get_network()
        while True:
            await trio.sleep(every_s)
            for peer_id in list(getattr(network, "connections", {}) or {}):
                try:
                    if self.orphaned(peer_id):
                        log.info("relay.circuit_lost peer=%s: its relay is gone, closing it", peer_id)
                        await network.close_peer(peer_id)
                except Exception as e:  # noqa: BLE001 - a connection closing meanwhile
                    log.debug("relay.prune_failed peer=%s error=%r", peer_id, e)

    async def dial(self, addr: str) -> None:
        """Open a relayed connection to the peer of the circuit address ``addr``.

        Raises:
            RelayError: the relay is unreachable, the peer holds no reservation there, or the
                relay or the peer refused the circuit.
        """
        from libp2p.peer.id import ID

        relay_id = ID.from_base58(peer_id_from_addr(relay_part(addr)))
        network = self.host.get_network()
        for attempt in (1, 2):
            if not network.get_connections(relay_id):
                network.unblock_peer(relay_id)  # libp2p refuses a peer that failed a dial for 60 s
            try:
                await self.transport.dial(multiaddr.Multiaddr(addr))
                return
            except Exception as e:  # the library raises ConnectionError, RelayConnectionError, ...
                if attempt == 1 and network.get_connections(relay_id):
                    # a connection to the relay that libp2p still lists can be dead (the relay
                    # restarted): drop it and dial the relay afresh, once
                    log.info("relay.redial relay=%s reason=%r", relay_id, e)
                    await network.close_peer(relay_id)
                    continue
                raise RelayError(f"cannot open a circuit to {addr}: {e}") from e

    async def reserve(self, relay_addr: str, timeout_s: float = 10.0) -> float:
        """Make (or renew) a reservation on the relay at ``relay_addr``; return its expiry (unix s).

        Raises:
            RelayError: the relay cannot be dialed, does not serve relay v2, or refused.
        """
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import info_from_p2p_addr

        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
        except Exception as e:
            raise ConfigError(f"not a relay multiaddr with /p2p/<PeerId>: {relay_addr!r} ({e})") from e
        relay_id = ID.from_base58(str(info.peer_id))
        network = self.host.get_network()
        try:
            with trio.fail_after(timeout_s):
                if not network.get_connections(relay_id):
                    network.unblock_peer(relay_id)  # libp2p refuses a peer that failed a dial for 60 s
                    await self.host.connect(info)
                stream = await self.host.new_stream(relay_id, [TProtocol(HOP_PROTOCOL)])
                try:
                    ok = await self.transport._make_reservation(stream, relay_id)  # pinned: see check_version
                finally:
                    with trio.move_on_after(1.0):
                        await stream.close()
        except trio.TooSlowError:
            raise RelayError(f"relay {relay_addr} did not answer a reservation within {timeout_s:.0f} s") from None
        except Exception as e:
            raise RelayError(f"cannot reach relay {relay_addr}: {type(e).__name__}: {e}") from e
        if not ok:
            raise RelayError(f"relay {relay_addr} refused the reservation (not a relay, or full)")
        return float(self.transport._reservations.get(relay_id, time.time() + RESERVATION_TTL_S))

    def orphaned(self, peer_id) -> bool:
        """True when every connection to ``peer_id`` (a libp2p ID) is relayed, through relays this
        node no longer has a connection to (so those circuits are dead, whatever libp2p lists)."""
        from libp2p.peer.id import ID

        network = self.host.get_network()
        conns = network.get_connections(peer_id)
        if not conns:
            return False
        me = self.host.get_id().to_base58()
        for conn in conns:
            if conn in self._direct:
                return False
            try:
                addrs = [str(a) for a in conn.get_transport_addresses()]
            except Exception:
                return False
            circuits = [a for a in addrs if "/p2p-circuit" in a]
            if not circuits:
                # remembered only once libp2p set the connection's own addresses: until then it
                # answers with the peerstore's addresses of the peer, direct ones even for a relayed
                # connection (0.8.1's SwarmConn.get_transport_addresses; the version is pinned)
                if getattr(conn, "_actual_transport_addresses", None):
                    self._direct.add(conn)
                return False  # a direct connection
            relays = {peer_id_from_addr(relay_part(a)) for a in circuits}
            # libp2p 0.8.1 tags an inbound relayed connection with our own PeerId as the relay's:
            # such a relay cannot be named, and the connection is left alone
            if relays & {"", me} or any(network.get_connections(ID.from_base58(r)) for r in relays):
                return False
        return True

    def connected(self, relay_addr: str) -> bool:
        """True while a connection to the relay is open."""
        from libp2p.peer.id import ID

        return bool(self.host.get_network().get_connections(ID.from_base58(peer_id_from_addr(relay_addr))))

    async def keep_reservation(self, relay_addr: str, my_peer_id: str, *, check_s: float = 0.25,
                               retry_s: float = 0.5, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Hold a reservation on ``relay_addr`` until cancelled: reserve, report the circuit
        address to ``task_status``, then renew ``RENEW_MARGIN_S`` before expiry, and at once
        when the connection to the relay is gone, e.g. after a relay restart (again after
        ``retry_s``, doubling up to ``MAX_RETRY_S``, until it works).

        Raises:
            RelayError / ConfigError: the first reservation failed (before started).
        """
        addr = circuit_addr(relay_addr, my_peer_id)
        expires = await self.reserve(relay_addr)
        self.reserved[relay_addr] = addr
        log.info("relay.reserved relay=%s circuit=%s ttl_s=%.0f", relay_addr, addr, expires - time.time())
        task_status.started(addr)
        failures, delay = 0, retry_s
        try:
            while True:
                while self.connected(relay_addr) and time.time() < expires - RENEW_MARGIN_S:
                    await trio.sleep(check_s)
                lost = not self.connected(relay_addr)
                if lost and self.reserved.pop(relay_addr, None) is not None:
                    log.warning("relay.connection_lost relay=%s: reserving again", relay_addr)
                try:
                    expires = await self.reserve(relay_addr)
                except SwarmError as e:
                    (log.warning if failures in (0, 5, 20) or failures % 100 == 0 else log.debug)(
                        "relay.reserve_failed relay=%s error=%s; retrying in %.1f s (failure %d)", relay_addr, e,
                        delay, failures + 1)
                    await trio.sleep(delay)
                    failures, delay = failures + 1, min(MAX_RETRY_S, delay * 2)
                    continue
                failures, delay = 0, retry_s
                self.reserved[relay_addr] = addr
                log.info("relay.%s relay=%s", "reserved_again" if lost else "renewed", relay_addr)
        finally:
            self.reserved.pop(relay_addr, None)


async def hold_reservations(circuits: CircuitClient, relays: Sequence[str], my_peer_id: str,
                            task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Keep a reservation on each relay (``CircuitClient.keep_reservation``) until cancelled;
    ``task_status.started`` gets the circuit addresses, in the order of ``relays``.

    Raises:
        RelayError / ConfigError: a first reservation failed (names the relay and why).
    """
    async with trio.open_nursery() as nursery:
        addrs = [await nursery.start(circuits.keep_reservation, r, my_peer_id) for r in relays]
        task_status.started(addrs)

"""DHT membership: a swarm node on py-libp2p's Kademlia DHT, announcing and reading stage records.

Owns: pinning the swarm's own DHT protocol id, building ``libp2p.kad_dht.KadDHT`` with strict
validation and the stage-record validator, joining through bootstrap nodes (with one clear error
when none answers), announcing (``put_value`` of the signed record + ``provide`` of the model id),
reading fresh, validated, de-duplicated records, and timing round trips to peers.
May import: stdlib, trio, multiaddr, libp2p, ``swarm.errors``, ``swarm.transport``,
``swarm.discovery.records``. No torch.

Facts of libp2p 0.8.1's DHT this module designs around (measured on loopback, issue 14):
- the wire protocol is always ``/ipfs/kad/1.0.0`` (``protocol_prefix`` is ignored), so a swarm
  DHT would merge with any IPFS peer it meets: ``pin_protocol`` sets the module-level protocol id
  of every kad_dht module to ``/swarm/kad/1.0.0`` before a DHT is built, and refuses any other
  library version (the patch is tested against this version);
- with ``strict_validation=False`` unregistered namespaces are accepted unvalidated: swarm runs
  strict, with only ``/swarm-stage/`` registered;
- reads are local-first and stale (``get_value`` returns a local copy unvalidated;
  ``find_providers`` never asks the network once it has a local answer), and network answers
  hold duplicates: every read here sets the local entry aside, queries, validates, de-duplicates,
  and puts the entry back only when the network had nothing (a server node keeps serving it).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import version as _dist_version

import multiaddr
import trio

from swarm.discovery.records import NAMESPACE, RecordInvalid, StageRecord, open_record, record_key, select_record
from swarm.errors import ConfigError, SwarmError

log = logging.getLogger(__name__)

NETWORK_FALLBACK_S = 1.0  # longest network read of one record its owner did not give us, in seconds

PROTOCOL_ID = "/swarm/kad/1.0.0"
PINNED_LIBP2P = "0.8.1"
PING_PROTOCOL = "/ipfs/ping/1.0.0"
ALL_STAGES_KEY = hashlib.sha256(b"swarm/all-stages/1").hexdigest()  # every stage provides it: `swarm peers`
_KAD_MODULES = ("common", "kad_dht", "provider_store", "value_store", "peer_routing")


class DiscoveryError(SwarmError):
    """The DHT could not be joined or read (no bootstrap answered, a query failed)."""


def pin_protocol() -> str:
    """Make every kad_dht module of libp2p speak ``PROTOCOL_ID`` instead of ``/ipfs/kad/1.0.0``.

    Idempotent; must run before a ``KadDHT`` is built.

    Returns:
        The protocol id now in force.
    Raises:
        ConfigError: the installed libp2p is not the pinned version (the patch targets its
            module layout; another version must be re-checked, not trusted).
    """
    import importlib

    installed = _dist_version("libp2p")
    if installed != PINNED_LIBP2P:
        raise ConfigError(f"swarm's DHT protocol patch is pinned to libp2p {PINNED_LIBP2P}; "
                          f"libp2p {installed} is installed (pip install libp2p=={PINNED_LIBP2P})")
    for name in _KAD_MODULES:
        module = importlib.import_module(f"libp2p.kad_dht.{name}")
        if not hasattr(module, "PROTOCOL_ID"):
            raise ConfigError(f"libp2p.kad_dht.{name} has no PROTOCOL_ID: the pinned layout changed")
        module.PROTOCOL_ID = PROTOCOL_ID
    # routine stream closes log as warnings; never louder than the caller set libp2p
    logging.getLogger("libp2p.kad_dht").setLevel(max(logging.ERROR, logging.getLogger("libp2p").getEffectiveLevel()))
    return PROTOCOL_ID


def _validator(clock: Callable[[], float], accept_models: frozenset[str] | None):
    from libp2p.records.validator import NamespacedValidator, Validator

    class StageRecordValidator(Validator):
        """libp2p's Validator over ``open_record``/``select_record`` (runs on every put and get)."""

        def validate(self, key: str, value: bytes) -> None:
            open_record(key, value, now=clock(), accept_models=accept_models)

        def select(self, key: str, values: list[bytes]) -> int:
            return select_record(key, values, now=clock())

    return NamespacedValidator({NAMESPACE: StageRecordValidator()}, strict_validation=True)


def parse_bootstrap(addr: str):
    """Parse a bootstrap multiaddr into a libp2p PeerInfo.

    Raises:
        ConfigError: not a multiaddr ending in ``/p2p/<PeerId>``.
    """
    from libp2p.peer.peerinfo import info_from_p2p_addr

    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as e:  # multiaddr raises several unrelated types on bad text
        raise ConfigError(f"--bootstrap {addr!r} is not a multiaddr with /p2p/<PeerId> "
                          f"(e.g. /ip4/10.0.0.5/tcp/4001/p2p/12D3KooW...): {e}") from None


class SwarmDHT:
    """A running DHT node; get one from ``open_dht``.

    Args:
        host: the node's SwarmHost. dht: the running KadDHT. bootstrap: PeerInfos joined through.
        clock: unix time source (validation of expiry).
    """

    def __init__(self, host, dht, bootstrap: list, clock: Callable[[], float]):
        self.host, self.dht, self.bootstrap, self.clock = host, dht, bootstrap, clock

    @property
    def server(self) -> bool:
        from libp2p.kad_dht.kad_dht import DHTMode

        return self.dht.mode == DHTMode.SERVER

    async def rejoin(self, timeout_s: float = 5.0) -> int:
        """Reconnect to bootstrap nodes we lost (e.g. one restarted), or that dropped out of the
        routing table (a failed query can evict them, and lookups then have nobody to ask);
        returns how many answer."""
        ok = 0
        for info in self.bootstrap:
            if self.host.libp2p_host.get_network().get_connections(info.peer_id) \
                    and self.dht.routing_table.peer_in_table(info.peer_id):
                ok += 1
                continue
            try:
                await _join_one(self.host, self.dht, info, timeout_s)
                ok += 1
            except DiscoveryError as e:
                log.info("dht.rejoin_failed peer=%s error=%s", info.peer_id, e)
        return ok

    async def announce(self, value: bytes, model_id: str, timeout_s: float = 10.0) -> None:
        """Publish a signed record under its PeerId key and provide its model id and the all-stages key.

        Args:
            value: output of ``sign_record`` (validated here before anything is sent).
            model_id: 64-hex model id the record names.
        Raises:
            RecordInvalid: the value does not validate (never published).
            DiscoveryError: the DHT did not finish within ``timeout_s``.
        """
        key = record_key(self.host.peer_id)
        open_record(key, value, now=self.clock())
        try:
            with trio.fail_after(timeout_s):
                await self.dht.put_value(key, value)
                await self.dht.provide(model_id)
                await self.dht.provide(ALL_STAGES_KEY)
        except trio.TooSlowError:
            raise DiscoveryError(f"announcing on the DHT took over {timeout_s} s") from None
        except ValueError as e:  # libp2p refuses to replace a newer local value
            raise DiscoveryError(f"the DHT refused the record: {e}") from e

    async def find_records(self, model_id: str | None = None, *, timeout_s: float = 5.0) -> list[StageRecord]:
        """Read the current stage records of a model (or of every model), validated and de-duplicated.

        Providers are hints; each provider's signed record is fetched and checked
        (``open_record``), and a record for another model than ``model_id`` is dropped.

        Args:
            model_id: 64-hex model id, or None for every stage that announces (at most the 20
                providers a DHT node keeps per key).
            timeout_s: deadline for the whole read, in seconds.
        Returns:
            Records sorted by PeerId; empty when none is found.
        """
        provider_key = model_id if model_id is not None else ALL_STAGES_KEY
        peers: list[str] = []  # the lookup ran out of time: nobody to ask
        with trio.move_on_after(timeout_s):
            peers = await self._fresh_providers(provider_key)
        records: dict[str, StageRecord] = {}

        async def one(peer_id: str) -> None:
            # the stage itself holds its latest record: one request to it; the network only if it
            # does not answer the DHT protocol (a client-mode stage) or cannot be dialed, and then
            # briefly: a stage that left keeps records on the DHT nodes until they expire, and
            # lookups through peers that left cost a failed dial each
            value = await self._value_from_owner(peer_id)
            if value is None:
                with trio.move_on_after(NETWORK_FALLBACK_S):
                    value = await self._fresh_value(record_key(peer_id))
            if value is None:
                return
            try:
                record = open_record(record_key(peer_id), value, now=self.clock())
            except RecordInvalid as e:
                log.info("dht.record_rejected peer=%s reason=%s", peer_id, e)
                return
            if model_id is None or record.model_id == model_id:
                records[peer_id] = record
            else:
                log.info("dht.record_rejected peer=%s reason=other-model model=%s", peer_id, record.model_id[:16])

        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for peer_id in sorted(set(peers)):
                    nursery.start_soon(one, peer_id)
        return [records[p] for p in sorted(records)]

    async def _value_from_owner(self, peer_id: str, timeout_s: float = 2.0) -> bytes | None:
        """GET_VALUE of a stage's record from the stage itself (libp2p 0.8.1's
        ``ValueStore._get_from_peer``; the version is pinned by ``pin_protocol``)."""
        from libp2p.peer.id import ID

        if peer_id == self.host.peer_id:
            got = self.dht.value_store.get(record_key(peer_id).encode())
            return got.value if got is not None else None
        try:
            with trio.move_on_after(timeout_s):
                return await self.dht.value_store._get_from_peer(ID.from_base58(peer_id), record_key(peer_id).encode())
        except Exception as e:  # unreachable, or it does not serve the DHT: the caller asks the network
            log.debug("dht.owner_get_failed peer=%s error=%r", peer_id, e)
        return None

    async def _fresh_providers(self, key: str) -> list[str]:
        from libp2p.kad_dht.kad_dht import _encode_key

        store = self.dht.provider_store
        kb = _encode_key(key)
        saved = store.providers.pop(kb, None)
        try:
            found = await self.dht.find_providers(key, count=64)
        finally:
            if saved:  # keep serving what we held; fresher network entries win
                merged = store.providers.setdefault(kb, {})
                for pid, rec in saved.items():
                    merged.setdefault(pid, rec)
        lh = self.host.libp2p_host
        peerstore, network = lh.get_peerstore(), lh.get_network()
        for info in found:  # so the owners can be asked directly
            if not info.addrs or info.peer_id == lh.get_id():
                continue
            if not network.get_connections(info.peer_id):
                # as for a hop (``Host.open_stream``): dial where the provider says it is now. libp2p
                # dials one address per peer and keeps a peer whose dial failed on a 60 s negative
                # cache, so a stage restarted under its key on a new port would not be asked for its
                # record until then (one failed ring dial to its old address is enough)
                peerstore.clear_addrs(info.peer_id)
                network.unblock_peer(info.peer_id)
            peerstore.add_addrs(info.peer_id, info.addrs, 600)
        ids = {str(p.peer_id) for p in found}
        if saved:
            ids |= set(saved)
        return sorted(ids)

    async def _fresh_value(self, key: str) -> bytes | None:
        store = self.dht.value_store.store
        kb = key.encode()
        saved = store.pop(kb, None)
        try:
            value = await self.dht.get_value(key)
        except Exception as e:  # a query failing on a peer is a missing record, not a crash
            log.info("dht.get_failed key=%s error=%r", key, e)
            value = None
        if value is None and saved is not None:
            store[kb] = saved
            value = saved[0].value
        return value

    async def rtt_ms(self, addr: str, rounds: int = 3, timeout_s: float = 3.0) -> float | None:
        """Median-free minimum round trip to a peer over the libp2p ping protocol, in milliseconds.

        Dials ``addr`` (an existing connection is reused), then times ``rounds`` 32-byte echoes on
        one stream and returns the smallest. None when the peer cannot be reached in time.
        """
        from swarm.errors import StageLost

        try:
            with trio.fail_after(timeout_s):
                stream = await self.host.open_raw_stream(addr, PING_PROTOCOL)
                best = float("inf")
                try:
                    for _ in range(rounds):
                        payload = secrets.token_bytes(32)
                        start = time.perf_counter()
                        await stream.write(payload)
                        got = b""
                        while len(got) < 32:
                            chunk = await stream.read(32 - len(got))
                            if not chunk:
                                raise StageLost("ping stream closed")
                            got += chunk
                        if got != payload:
                            raise StageLost("ping echo mismatch")
                        best = min(best, (time.perf_counter() - start) * 1000)
                finally:
                    with trio.move_on_after(1):
                        await stream.close()
                return best
        except (trio.TooSlowError, SwarmError, OSError, Exception) as e:  # noqa: BLE001 - any failure = unreachable
            log.info("dht.rtt_failed addr=%s error=%r", addr, e)
            return None


def _skip_client_peers(dht) -> None:
    """Keep client-mode peers out of the routing table.

    libp2p 0.8.1 adds every peer that opens a DHT stream to us (``add_peer(...,
    skip_server_mode_check=True)`` in the inbound handler), so coordinators and ``swarm peers``
    runs, which only query, end up in server nodes' tables and are handed out as "closer peers"
    long after they left: every later lookup then dials them in vain. The inbound path now adds a
    peer only when identify says it serves ``PROTOCOL_ID``. Pinned with the protocol id (same
    library version) and tested.
    """
    original = dht.add_peer
    peerstore = dht.host.get_peerstore()

    async def add_peer(peer_id, *, skip_server_mode_check: bool = False) -> bool:
        if skip_server_mode_check:
            try:
                protocols = peerstore.get_protocols(peer_id) or []
            except Exception:  # not in the peerstore yet: identify has not run, do not trust it
                protocols = []
            if PROTOCOL_ID not in [str(p) for p in protocols]:
                return False
        return await original(peer_id, skip_server_mode_check=skip_server_mode_check)

    dht.add_peer = add_peer


async def _join_one(host, dht, info, timeout_s: float) -> None:
    from libp2p.custom_types import TProtocol

    try:
        with trio.fail_after(timeout_s):
            lh = host.libp2p_host
            lh.get_network().unblock_peer(info.peer_id)
            await lh.connect(info)
            stream = await lh.new_stream(info.peer_id, [TProtocol(PROTOCOL_ID)])
            await stream.close()
            # it just negotiated the DHT protocol with us: a server, whatever identify says yet
            await dht.routing_table.add_peer(info.peer_id, skip_server_mode_check=True)
    except trio.TooSlowError:
        raise DiscoveryError(f"bootstrap {info.peer_id} did not answer within {timeout_s} s") from None
    except Exception as e:  # libp2p's dial and negotiation errors share no base class
        from libp2p.host.exceptions import StreamFailure

        from swarm.transport.host import dial_failure, is_unsupported_protocol

        if isinstance(e, StreamFailure) and is_unsupported_protocol(e):
            raise DiscoveryError(f"bootstrap {info.peer_id} does not serve the swarm DHT ({PROTOCOL_ID})") from None
        raise DiscoveryError(f"bootstrap {info.peer_id} {dial_failure(e, str(info.peer_id))}") from None


@asynccontextmanager
async def open_dht(host, *, server: bool, bootstrap: Sequence[str] = (), timeout_s: float = 10.0,
                   clock: Callable[[], float] = time.time,
                   accept_models: frozenset[str] | None = None) -> AsyncIterator[SwarmDHT]:
    """Run a swarm DHT node on ``host`` for the duration of the block.

    Args:
        host: a running ``SwarmHost``.
        server: serve the DHT to others (reachable stages, bootstrap nodes), and answer dial-backs
            (``swarm.discovery.reach``); False = client mode (coordinators, servers of the API,
            stages that cannot be dialed).
        bootstrap: multiaddrs of bootstrap nodes; a node with none starts a new swarm.
        timeout_s: deadline per bootstrap join, in seconds.
        clock: unix time (record expiry).
        accept_models: model ids this node stores records for (None: any).
    Yields:
        The SwarmDHT.
    Raises:
        ConfigError: a bootstrap address is malformed, or the libp2p version is not the pinned one.
        DiscoveryError: bootstrap addresses were given and none could be joined (the message
            names each address and why).
    """
    pin_protocol()
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.tools.anyio_service import background_trio_service

    infos = [parse_bootstrap(a) for a in bootstrap]
    if server:  # joining nodes ask a server node whether the swarm can dial them
        from swarm.discovery.reach import serve_dialback

        serve_dialback(host)
    dht = KadDHT(host.libp2p_host, DHTMode.SERVER if server else DHTMode.CLIENT,
                 validator=_validator(clock, accept_models), validator_changed=True, strict_validation=True)
    _skip_client_peers(dht)
    error: DiscoveryError | None = None
    async with background_trio_service(dht):
        failures = []
        for addr, info in zip(bootstrap, infos):
            try:
                await _join_one(host, dht, info, timeout_s)
            except DiscoveryError as e:
                failures.append(f"{addr}: {e}")
        if infos and len(failures) == len(infos):
            # raised after the service stops, so the caller sees it bare, not in an exception group
            error = DiscoveryError("cannot join the swarm, no bootstrap node answered: " + "; ".join(failures))
        else:
            for line in failures:
                log.warning("dht.bootstrap_failed %s", line)
            log.info("dht.start mode=%s bootstrap=%d/%d", "server" if server else "client",
                     len(infos) - len(failures), len(infos))
            yield SwarmDHT(host, dht, infos, clock)
    if error is not None:
        raise error

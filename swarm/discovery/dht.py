"""DHT membership: a swarm node on py-libp2p's Kademlia DHT, announcing and reading stage records.

Owns: ``pin_protocol`` (``/swarm/kad/1.0.0``), ``open_dht`` -> ``SwarmDHT`` (strict validation, the join, the
clock offset, counted announces, ``read_records``, ``ping_ms``) and ``ProofBoard`` (fraud proofs in
``PROOF_SLOTS`` slots per accused). No torch. The libp2p facts it works around: docs/architecture.md.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import version as _dist_version

import multiaddr
import trio

from swarm.discovery.lookup import ALPHA, lookup
from swarm.discovery.providers import (QUERY_TIMEOUT_S, SETTLE_GRACE_S, SETTLE_QUORUM, ask_each_once,
                                      bound_provider_store, gather_settled, lookup_providers)
from swarm.discovery.records import NAMESPACE, RecordInvalid, StageRecord, open_record, record_key, select_record
from swarm.errors import ConfigError, StageLost, SwarmError
from swarm.files import write_atomic

log = logging.getLogger(__name__)

RETRY_AFTER_S = 0.25  # pause before the one retry of a store or provide a node did not acknowledge
BOOTSTRAP_REQUESTS = 4  # value requests one reader keeps in flight to the bootstrap nodes
NETWORK_READ_S = 30.0  # safety bound on a network read of one record, in seconds: the lookup ends itself when it
# converges (each request bounded by lookup.QUERY_TIMEOUT_S); a bound of 1 s cut reads of records that exist
# once the bootstrap node was down (4 of 100 at 200 hosts, issue 45)
GET_ENOUGH = 3  # valid copies a read collects before it stops asking (the highest seq of them wins)
PEER_CACHE_SIZE = 32  # DHT servers a node remembers for joining when no bootstrap node answers
JOIN_LOOKUP_S = 10.0  # longest self-lookup a joining node runs to fill its routing table, in seconds
JOIN_ATTEMPTS = 3  # rounds of joins through every address given before a node gives up
JOIN_BACKOFF_S = 1.0  # pause before the second round of joins, doubled each round, plus up to half again (jitter)
JOIN_GRACE_S = 0.3  # once one node of a round of joins answered, the others' joins get this long more, in seconds
# requests in flight in a provider lookup of a node that joined without a bootstrap node (go-libp2p-kad-dht's
# default concurrency): it walks to a key's holders from wherever its peer cache put it, not from a bootstrap
# node holding every provider, and the fastest of more dials sets each step (issue 31's simulator, seed 2:
# routes during the bootstrap outage p50 / max 1.58 / 2.97 s with 3, 1.36 / 2.19 s with 10; all routes' p99
# 2.53 / 2.03 s)
OUTAGE_READ_ALPHA = 10

PROTOCOL_ID = "/swarm/kad/1.0.0"
PINNED_LIBP2P = "0.8.1"
PING_PROTOCOL = "/ipfs/ping/1.0.0"
PROOF_NAMESPACE = "swarm-proof"
PROOF_SLOTS = 8  # proofs kept per accused PeerId at each node, first stored kept (see the module docstring)
ALL_STAGES_KEY = hashlib.sha256(b"swarm/all-stages/1").hexdigest()  # every stage provides it: `swarm peers`
PLACEMENT_SHARDS = 16  # provider keys per model that placement reads besides the model's own (issue 31)
_KAD_MODULES = ("common", "kad_dht", "provider_store", "value_store", "peer_routing")


def placement_shard(start: int, num_layers: int) -> int:
    """The placement shard of a block starting at layer ``start`` of ``num_layers``: ``start``'s
    share of ``[0, L)`` in ``PLACEMENT_SHARDS`` equal parts, in ``[0, PLACEMENT_SHARDS)``."""
    return min(PLACEMENT_SHARDS - 1, max(0, start) * PLACEMENT_SHARDS // max(1, num_layers))


def placement_key(model_id: str, shard: int) -> str:
    """The provider key of one placement shard of a model (64 hex): every stage of ``model_id``
    whose block starts in that shard provides it, besides ``model_id`` itself.

    Why: a DHT node keeps ``MAX_PROVIDERS_PER_KEY`` (256) providers per key, so a read of the model
    key shows at most 256 of a model's stages, the most recently refreshed. That is plenty for a
    route and keeps it fast, but a stage choosing its block from 256 of 1,000 stages sees a quarter
    of the swarm's capacity (issue 31's simulator: 0.93 of the LP bound seeing 256, 0.99 seeing
    all). Placement reads every shard too (``SwarmDHT.read_records(placement=True)``), so it sees
    up to ``(PLACEMENT_SHARDS + 1) * 256`` stages.
    """
    return hashlib.sha256(f"swarm/placement/1/{model_id}/{int(shard)}".encode()).hexdigest()


class DiscoveryError(SwarmError):
    """The DHT could not be joined or read (no bootstrap answered, a query failed)."""


class JoinFailed(DiscoveryError):
    """One bootstrap node (or known peer) could not be joined.

    Attributes:
        transient: True when trying again later may succeed (no answer in time, nothing accepting
            connections yet: a busy or restarting node); False when it cannot (another key is at
            that address, it does not serve the swarm DHT).
    """

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


class RecordRefused(DiscoveryError):
    """Every remote DHT node asked to store this node's record refused it (or could not be reached).

    Attributes:
        asked: how many nodes were asked.
    """

    def __init__(self, asked: int):
        super().__init__(f"none of the {asked} DHT node(s) asked stored the record")
        self.asked = asked


def pin_protocol() -> str:
    """Make every kad_dht module of libp2p speak ``PROTOCOL_ID`` instead of ``/ipfs/kad/1.0.0``.

    Idempotent; must run before a ``KadDHT`` is built.

    Returns:
        The protocol id now in force.
    Raises:
        ConfigError: the installed libp2p is not the pinned version (the patch targets its
            module layout; another version must be re-checked, not trusted).
    """
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

    class ProofValidator(Validator):
        """Fraud proofs in the slots of ``/swarm-proof/<accused>`` (``proof_key``): a node stores only a proof
        whose signatures, openings and binding check (``swarm.proofs.check_proof``: no weights) and that
        accuses the key's PeerId. A slot keeps the proof stored first (select 0: the stored one), so that
        no later proof, a flood of framings included, pushes a stored one out; a second proof goes to
        another slot (``ProofBoard.publish``)."""

        def validate(self, key: str, value: bytes) -> None:
            check_proof_value(key, value)

        def select(self, key: str, values: list[bytes]) -> int:
            return 0

    return NamespacedValidator({NAMESPACE: StageRecordValidator(), PROOF_NAMESPACE: ProofValidator()},
                               strict_validation=True)


def proof_key(peer_id: str, slot: int = 0) -> str:
    """The DHT key of slot ``slot`` (0 .. ``PROOF_SLOTS`` - 1) of the fraud proofs against a PeerId:
    ``/swarm-proof/<peer_id>`` for slot 0 (where a single proof always lived), ``/swarm-proof/<peer_id>/<slot>``."""
    return f"/{PROOF_NAMESPACE}/{peer_id}" + (f"/{slot}" if slot else "")


def check_proof_value(key: str, value: bytes) -> dict:
    """The proof stored at ``key``, checked without weights (``swarm.proofs.check_proof``).

    Raises:
        ProofRefused: it does not check, or accuses another PeerId than the key names (any slot).
    """
    from swarm import proofs

    proof = proofs.decode(value)
    proofs.check_proof(proof)
    if key not in {proof_key(proof["accused"], slot) for slot in range(PROOF_SLOTS)}:
        raise proofs.refused("malformed", f"a proof against {proof['accused']} stored under {key}")
    return proof


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


@dataclass(frozen=True)
class ReadReport:
    """What one read of the DHT found besides the live records it returns.

    Attributes:
        providers: how many PeerIds the DHT named as providers of the key read.
        dropped: ``(peer_id, kind, reason)`` for each provider whose record was not returned;
            kind is ``"no-record"`` (none found: it never published one, or it was refused),
            ``"expired"``, ``"other-model"``, or a ``RecordInvalid.kind``.
    """

    providers: int = 0
    dropped: tuple[tuple[str, str, str], ...] = ()

    def describe(self) -> str:
        """One line for an error or a footer: what the providers that are not listed were."""
        if not self.providers:
            return "the DHT names no provider of it"
        if not self.dropped:
            return f"the DHT named {self.providers} provider(s), all listed"
        kinds: dict[str, list[tuple[str, str]]] = {}
        for peer_id, kind, reason in self.dropped:
            kinds.setdefault(kind, []).append((peer_id, reason))
        words = {"expired": "record(s) expired (stages that left, or whose clock is behind)",
                 "no-record": "without a record (left long ago, or their records were refused)",
                 "other-model": "record(s) for another model",
                 "future": "record(s) expiring too far out (a clock ahead of the swarm's)"}
        parts = []
        for kind, items in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            peer_id, reason = items[0]
            parts.append(f"{len(items)} {words.get(kind, 'record(s) refused')} (e.g. ..{peer_id[-8:]}: {reason})")
        return f"the DHT named {self.providers} provider(s): " + "; ".join(parts)


class SwarmDHT:
    """A running DHT node; get one from ``open_dht``.

    Args:
        host: the node's SwarmHost. dht: the running KadDHT. bootstrap: PeerInfos joined through.
        clock: the swarm's unix time as this node knows it (``swarm.discovery.clock.SwarmClock``):
            record expiries are stamped and checked with it.
        bootstrap_addrs: the multiaddrs of ``bootstrap`` (the clock is measured against them).
    """

    def __init__(self, host, dht, bootstrap: list, clock: Callable[[], float], bootstrap_addrs: Sequence[str] = ()):
        self.host, self.dht, self.bootstrap, self.clock = host, dht, bootstrap, clock
        self.bootstrap_addrs = tuple(bootstrap_addrs)
        self.bootstrap_slots = trio.CapacityLimiter(BOOTSTRAP_REQUESTS)  # requests in flight to a bootstrap node
        self.proofs = ProofBoard(self)  # the fraud proofs' slots
        self.table_filled = trio.Event()  # the join's self-lookup ended (``fill_table``), or none runs
        # PeerIds of the nodes that named providers of a key this node read, most recent last: its
        # peer cache leads with them (``_keep_peers``), so that through a bootstrap outage its first
        # lookup starts at nodes holding the model's providers (issue 31's simulator)
        self.holders: dict[str, None] = {}
        self.read_alpha = ALPHA  # requests in flight in a provider lookup (``OUTAGE_READ_ALPHA``: see there)

    @property
    def server(self) -> bool:
        from libp2p.kad_dht.kad_dht import DHTMode

        return self.dht.mode == DHTMode.SERVER

    async def sync_clock(self, max_age_s: float = 0.0, addrs: Sequence[str] | None = None) -> None:
        """``swarm.discovery.clock.sync_offset`` against ``addrs`` (multiaddrs with ``/p2p/``; default every
        bootstrap node; at a join, those that answered it); a measurement younger than ``max_age_s`` is kept."""
        from swarm.discovery.clock import sync_offset

        await sync_offset(self.clock, self.host, self.bootstrap_addrs if addrs is None else tuple(addrs), max_age_s)

    def describe_clock(self) -> str:
        """How this node's clock relates to the swarm's, for messages."""
        describe = getattr(self.clock, "describe", None)
        return describe() if describe else "this node's clock is taken as the swarm's"

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

    async def join_late(self, late: Sequence[tuple[str, object]], timeout_s: float) -> None:
        """Join through bootstrap nodes that had not answered when ``open_dht`` joined through known
        peers instead (``_join_any``): each that answers within ``timeout_s`` becomes one of this
        node's bootstrap nodes (asked first by its lookups, its clock measured against them), and
        provider lookups run with ``ALPHA`` requests in flight again."""
        async def one(addr: str, info) -> None:
            try:
                await _join_one(self.host, self.dht, info, timeout_s)
            except DiscoveryError as e:
                log.warning("dht.late_bootstrap_failed %s: %s", addr, e)
                return
            if all(i.peer_id != info.peer_id for i in self.bootstrap):
                self.bootstrap.append(info)
                self.bootstrap_addrs += (addr,)
            self.read_alpha = ALPHA  # a bootstrap node to read from again
            log.info("dht.late_bootstrap_joined %s", addr)

        async with trio.open_nursery() as nursery:
            for addr, info in late:
                nursery.start_soon(one, addr, info)
        if any(a in self.bootstrap_addrs for a, _ in late):
            await self.sync_clock()

    async def fill_table(self, timeout_s: float = JOIN_LOOKUP_S) -> int:
        """Look up this node's own PeerId (Kademlia's join): the nodes met on the way enter the routing
        table, and learn of this node as it asks them. Returns the routing table's size after.

        ``open_dht`` runs it in the background for a server node (``table_filled`` is set when it
        ends): every request of it dials a node this one has not met (>= 250 ms each, issue 31), so
        it took 4.5 s of a 6 s join at 20 nodes, and nothing needs it first: puts and reads run
        their own lookups from the bootstrap nodes.
        """
        start = time.monotonic()
        try:
            with trio.move_on_after(timeout_s):
                try:
                    found = await lookup(self.dht, self.host.libp2p_host.get_id().to_bytes(), protocol_id=PROTOCOL_ID,
                                         seeds=[i.peer_id for i in self.bootstrap])
                    log.info("dht.table_filled asked=%d failed=%d table=%d took_s=%.2f", found.asked, found.failed,
                             self.dht.routing_table.size(), time.monotonic() - start)
                except Exception as e:  # a failed self-lookup leaves a thinner table, not a failed join
                    log.info("dht.fill_table_failed error=%r", e)
        finally:
            self.table_filled.set()
        return self.dht.routing_table.size()

    async def announce(self, value: bytes, model_id: str, timeout_s: float = 10.0) -> int:
        """Publish a signed record under its PeerId key and provide its model id, its placement shard
        (``placement_key`` of its block's start) and the all-stages key.

        Args:
            value: output of ``sign_record`` (validated here before anything is sent).
            model_id: 64-hex model id the record names.
        Returns:
            How many remote DHT nodes stored the record (0 when none was there to ask).
        Raises:
            RecordInvalid: the value does not validate (never published).
            RecordRefused: remote DHT nodes were asked and none stored it (clients cannot find it).
            DiscoveryError: the DHT did not finish within ``timeout_s``.
        """
        key = record_key(self.host.peer_id)
        record = open_record(key, value, now=self.clock())
        tally = [0, 0]  # remote nodes that stored the record, nodes asked: kept when time runs out
        with trio.move_on_after(timeout_s) as scope:
            try:
                await self._put(key, value, tally)
                await self._provide(model_id)
                await self._provide(placement_key(model_id, placement_shard(record.layers[0], record.num_layers)))
                await self._provide(ALL_STAGES_KEY)
            except ValueError as e:  # libp2p refuses to replace a newer local value
                raise DiscoveryError(f"the DHT refused the record: {e}") from e
        stored, asked = tally
        if scope.cancelled_caught and not stored:
            raise DiscoveryError(f"announcing on the DHT took over {timeout_s} s")
        if asked and not stored:
            raise RecordRefused(asked)
        return stored

    async def spread(self, kb: bytes, send, tally: list[int] | None = None) -> None:
        """Run ``send(peer) -> bool`` at the bootstrap nodes at once and at the closest nodes to
        ``kb`` once the network lookup names them (each node once, ``QUERY_TIMEOUT_S`` each),
        counting ``[succeeded, asked]`` into ``tally`` as they finish.

        The bootstrap nodes are always asked: libp2p's lookup returns the closest nodes it heard
        of, also those that left (routing tables keep them for hours), so after enough churn the
        "closest" can all be gone and the value would live nowhere a reader looks.
        """
        tally = tally if tally is not None else [0, 0]
        me = self.host.libp2p_host.get_id()
        network = self.host.libp2p_host.get_network()
        boot_ids = {info.peer_id for info in self.bootstrap}
        asked: set = {me}

        async def one(peer) -> None:
            tally[1] += 1
            for attempt in range(2):  # a busy libp2p node resets requests beyond 12 in flight: once more
                try:
                    with trio.move_on_after(QUERY_TIMEOUT_S):
                        if await send(peer):
                            tally[0] += 1
                            return
                except Exception as e:  # a node failing the request is one not stored at, not a crash
                    log.debug("dht.send_failed peer=%s error=%r", peer, e)
                if attempt or not (peer in boot_ids or self.dht.routing_table.peer_in_table(peer)) \
                        or not network.get_connections(peer):  # not a server we still reach: no use asking again
                    return
                await trio.sleep(RETRY_AFTER_S)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_each_once, [info.peer_id for info in self.bootstrap], asked, one)
            nursery.start_soon(ask_each_once, await self.closest_nodes(kb), asked, one)

    async def rtt_ms(self, addr: str, rounds: int = 3, timeout_s: float = 3.0) -> float | None:
        """``ping_ms`` from this node (tests stand a table in for it here)."""
        return await ping_ms(self.host, addr, rounds, timeout_s)

    async def closest_nodes(self, key: bytes, on_answer: Callable[[object], None] | None = None, *,
                            alpha: int = ALPHA) -> list:
        """The (up to) k DHT nodes closest to ``key`` that answer, nearest first: an iterative lookup
        (``swarm.discovery.lookup``, ``alpha`` requests in flight) from this node's routing table and
        the bootstrap nodes; ``on_answer(peer_id)`` for each node as it answers."""
        found = await lookup(self.dht, key, protocol_id=PROTOCOL_ID, alpha=alpha,
                             seeds=[i.peer_id for i in self.bootstrap], on_answer=on_answer)
        return list(found.closest)

    async def get_value(self, key: str, *, enough: int = GET_ENOUGH, timeout_s: float = NETWORK_READ_S) -> bytes | None:
        """The best valid value of ``key``: asked of the nodes closest to it, found by iterative lookup.

        Every value, this node's own copy included, passes the DHT's validator on this read (for
        a stage record ``open_record`` in swarm time: signature, key, and its own expiry), so an
        expired or forged value is never returned, whatever a node stored. The lookup stops once
        ``enough`` valid copies arrived; the one with the highest ``seq`` wins.

        Args:
            key: the DHT key (``/swarm-stage/<PeerId>``, ``/swarm-proof/<PeerId>``).
            enough: valid copies to collect before the lookup stops (it stops at its end otherwise).
            timeout_s: deadline for the whole read, in seconds; copies found by then count.
        Returns:
            The value, or None when no valid one was found in time.
        """
        kb = key.encode()
        found: list[bytes] = []

        def accept(value: bytes) -> bool:
            if not self._valid(key, value):
                return False
            found.append(value)
            return True

        with trio.move_on_after(timeout_s):
            try:
                await lookup(self.dht, kb, protocol_id=PROTOCOL_ID, seeds=[i.peer_id for i in self.bootstrap],
                             accept=accept, enough=enough)
            except Exception as e:  # a lookup failing on the way is fewer copies, not a failed read
                log.info("dht.get_failed key=%s error=%r", key, e)
        local = self.dht.value_store.store.get(kb)
        if local is not None:
            accept(local[0].value)
        if not found:
            return None
        return found[self.dht.validator.select(key, found)]

    async def _put(self, key: str, value: bytes, tally: list[int]) -> None:
        """libp2p 0.8.1's ``KadDHT.put_value`` (store locally, then at remote nodes), through
        ``spread`` and counting the nodes that stored the value (the library only logs it)."""
        kb = key.encode()
        store = self.dht.value_store
        old = store.get(kb)
        if old is not None and old.value != value and self.dht.validator.select(key, [value, old.value]) != 0:
            raise ValueError("Refusing to replace newer value with the older one")
        store.put(kb, value)
        store.local_keys.discard(kb)  # republished by its owner (see _provide), never by the library

        async def send(peer) -> bool:
            # a node that holds this very value already (an announce retried, or a node that
            # fetched it on a read) refuses it like a worse one: then ask what it holds
            return await store._store_at_peer(peer, kb, value) or await store._get_from_peer(peer, kb) == value

        await self.spread(kb, send, tally)

    async def _provide(self, key: str) -> None:
        """libp2p 0.8.1's ``ProviderStore.provide`` (a local entry, then ADD_PROVIDER at remote
        nodes) through ``spread``.

        The key is not left to the library to republish (nor is ``_put``'s record): the stage's
        ``Announcer`` republishes both every ``announce_interval_s``, well within their lifetime.
        The library republishes a key it was never told about the republish of at its first
        maintenance cycle, 600 s after start: a lookup and ADD_PROVIDER (or PUT) at 20 nodes per
        key, at every node at once where nodes started together (issue 31: 200 hosts on loopback
        collapsed into timeouts there), for records the owner refreshes anyway."""
        from libp2p.kad_dht.kad_dht import _encode_key
        from libp2p.peer.peerinfo import PeerInfo

        kb = _encode_key(key)
        store = self.dht.provider_store
        lh = self.host.libp2p_host
        store.add_provider(kb, PeerInfo(lh.get_id(), list(lh.get_addrs())))
        await self.spread(kb, lambda peer: store._send_add_provider(peer, kb))

    async def find_records(self, model_id: str | None = None, *, timeout_s: float = 5.0,
                           placement: bool = False) -> list[StageRecord]:
        """Read the current stage records of a model (or of every model): ``read_records`` without the report."""
        return (await self.read_records(model_id, timeout_s=timeout_s, placement=placement))[0]

    async def read_records(self, model_id: str | None = None, *, timeout_s: float = 5.0,
                           quorum: float = SETTLE_QUORUM,
                           on_record: Callable[[StageRecord], Awaitable[None]] | None = None,
                           enough: Callable[[], bool] | None = None,
                           grace_s: float = SETTLE_GRACE_S,
                           settle_s: float | None = None,
                           placement: bool = False) -> tuple[list[StageRecord], ReadReport]:
        """Read the current stage records of a model (or of every model), validated and de-duplicated.

        Providers are hints; each provider's signed record is fetched and checked
        (``open_record``), and a record for another model than ``model_id`` is dropped. However
        many providers left before (their entries stay on DHT nodes until ``PROVIDER_TTL_S``
        after their last refresh), every provider named is asked, concurrently; the read returns
        ``SETTLE_GRACE_S`` after ``SETTLE_QUORUM`` of them answered (``gather_settled``), so the
        slowest few (crashed owners, far relays) do not set its time.

        Args:
            model_id: 64-hex model id, or None for every stage that announces (at most
                ``MAX_PROVIDERS_PER_KEY`` per DHT node).
            timeout_s: deadline for the whole read, in seconds.
            quorum: share of the providers whose answers the read waits for (then ``SETTLE_GRACE_S``
                more); a route needs the near stages, a census (``swarm peers``) wants them all.
            on_record: awaited with each valid record as it arrives, inside that provider's share
                of the read (the quorum counts it finished after it): a client probes a stage
                on the connection the read just opened instead of after the whole read.
            enough: checked as providers finish; once true the read ends ``grace_s`` later, as at
                the quorum (``gather_settled``).
            grace_s: seconds the read waits for the rest after the quorum or ``enough``.
            settle_s: end the provider lookup this long after the first node naming providers
                (``lookup_providers``; ``PROVIDERS_SETTLE_S`` for a route); None: run it to the end,
                as a census must (a provider whose ADD_PROVIDER missed the bootstrap nodes is only
                on the closest nodes).
            placement: also read the providers of every placement shard of ``model_id``
                (``placement_key``; one lookup after another, each within ``timeout_s``) and ask
                each PeerId named once: a stage choosing or checking its block sees up to
                ``PLACEMENT_SHARDS + 1`` times the 256 providers a node keeps per key. Routes do
                not (17 lookups instead of one, and up to 17 times the record reads).
        Returns:
            (records sorted by PeerId, empty when none is found; the ReadReport saying what the
            other providers were).
        """
        provider_key = model_id if model_id is not None else ALL_STAGES_KEY
        # the lookup may run out of time (nodes that left cost a failed dial each): keep what arrived
        keys = [provider_key]
        if placement and model_id is not None:
            keys += [placement_key(model_id, s) for s in range(PLACEMENT_SHARDS)]
        peers = await self._fresh_providers(keys, timeout_s, settle_s)
        records: dict[str, StageRecord] = {}
        dropped: dict[str, tuple[str, str]] = {}

        async def one(peer_id: str) -> None:
            # the stage itself holds its latest record: one request to it; the network only if it
            # does not answer the DHT protocol (a client-mode stage) or cannot be dialed, and then
            # briefly: a stage that left keeps records on the DHT nodes until they expire, and
            # lookups through peers that left cost a failed dial each
            dropped[peer_id] = ("no-record", "no record found in time")
            value = await self._value_from_owner(peer_id)
            from_owner = value is not None
            if value is None:
                value = await self._fresh_value(record_key(peer_id))
            if value is None:
                dropped[peer_id] = ("no-record", "no record on the DHT")
                return
            try:
                record = open_record(record_key(peer_id), value, now=self.clock())
            except RecordInvalid as e:
                log.info("dht.record_rejected peer=%s reason=%s", peer_id, e)
                reason = str(e).replace(f"record of {peer_id} ", "")
                if e.kind in ("expired", "future") and from_owner:
                    reason += " though the stage itself answered (its clock or ours is off)"
                dropped[peer_id] = (e.kind, reason)
                return
            if model_id is None or record.model_id == model_id:
                records[peer_id] = record
                del dropped[peer_id]
                if on_record is not None:
                    await on_record(record)
            else:
                dropped[peer_id] = ("other-model", f"model {record.model_id[:16]}")
                log.info("dht.record_rejected peer=%s reason=other-model model=%s", peer_id, record.model_id[:16])

        with trio.move_on_after(timeout_s):
            # not waiting for the slowest few percent (crashed owners, far relays): gather_settled
            await gather_settled([functools.partial(one, peer_id) for peer_id in peers], quorum=quorum,
                                 enough=enough, grace_s=grace_s)
        report = ReadReport(len(peers), tuple((p, *dropped[p]) for p in sorted(dropped)))
        return [records[p] for p in sorted(records)], report

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

    async def _fresh_providers(self, keys: str | Sequence[str], timeout_s: float,
                               settle_s: float | None = None) -> list[str]:
        """PeerIds of the providers of ``keys`` (one key or several) found within ``timeout_s`` per key
        (``lookup_providers``), their addresses put in the peerstore once every lookup ended, so their
        owners can be asked directly.

        Several keys are looked up one after the other: 17 concurrent lookups from one fresh node
        (a placement read) made a placing stage miss live stages' records on loopback (the two ring
        tests that place a stage, run as a pair: a failure in 13 of 21 runs; 0 of 8 with the lookups
        in sequence). The cause was not pinned down (concurrent dials of the same nodes are suspect).
        """
        from libp2p.kad_dht.kad_dht import _encode_key

        found: dict = {}
        first = [i.peer_id for i in self.bootstrap]
        for key in ([keys] if isinstance(keys, str) else keys):
            with trio.move_on_after(timeout_s):
                await lookup_providers(self.dht, _encode_key(key), found,
                                       functools.partial(self.closest_nodes, alpha=self.read_alpha), first=first,
                                       settle_s=settle_s, holders=self.holders)
        for peer_id in list(self.holders)[:-PEER_CACHE_SIZE]:
            del self.holders[peer_id]
        lh = self.host.libp2p_host
        peerstore, network = lh.get_peerstore(), lh.get_network()
        for info in found.values():
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
        return sorted(found)

    async def _from_bootstrap(self, key: str, timeout_s: float) -> list[bytes]:
        """The values of ``key`` the bootstrap nodes hold (asked at once, ``timeout_s`` each; a node
        that is unreachable or holds none adds nothing)."""
        kb = key.encode()
        values: list[bytes] = []

        async def from_peer(peer_id) -> None:
            try:
                # a libp2p node resets requests beyond 12 in flight: a read of many records queues here
                async with self.bootstrap_slots:
                    with trio.move_on_after(timeout_s):
                        got = await self.dht.value_store._get_from_peer(peer_id, kb)
                        if got is not None:
                            values.append(got)
            except Exception as e:  # unreachable or not serving: another node may hold it
                log.debug("dht.get_failed key=%s peer=%s error=%r", key, peer_id, e)

        async with trio.open_nursery() as nursery:
            for info in self.bootstrap:
                nursery.start_soon(from_peer, info.peer_id)
        return values

    async def _fresh_value(self, key: str) -> bytes | None:
        """The best valid value of ``key`` that the bootstrap nodes (asked first, where every
        announce stores it) or else the nodes closest to it hold (``get_value``: this node's own
        copy counts only when valid)."""
        values = await self._from_bootstrap(key, QUERY_TIMEOUT_S)
        if not any(self._valid(key, v) for v in values):
            got = await self.get_value(key)
            if got is not None:
                values.append(got)
        if not values:
            return None
        return values[select_record(key, values, now=self.clock())]

    def _valid(self, key: str, value: bytes) -> bool:
        try:
            open_record(key, value, now=self.clock())
        except RecordInvalid:
            return False
        return True

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
        raise JoinFailed(f"bootstrap {info.peer_id} did not answer within {timeout_s} s", transient=True) from None
    except Exception as e:  # libp2p's dial and negotiation errors share no base class
        from libp2p.host.exceptions import StreamFailure

        from swarm.transport.host import dial_failure, is_unsupported_protocol

        if isinstance(e, StreamFailure) and is_unsupported_protocol(e):
            raise JoinFailed(f"bootstrap {info.peer_id} does not serve the swarm DHT ({PROTOCOL_ID})",
                             transient=False) from None
        why = dial_failure(e, str(info.peer_id))
        # a wrong key, or a name that does not exist, stays so: no rounds of retries (a resolver
        # that said "try again" is the exception)
        lasting = why.startswith("is not at that address") or (
            why.startswith("cannot be dialed: cannot resolve") and "Temporary failure" not in why)
        raise JoinFailed(f"bootstrap {info.peer_id} {why}", transient=not lasting) from None


def peer_cache_path():
    """Where a stage or a client keeps the DHT servers it met: ``dht-peers.json`` in the cache root."""
    from swarm.config import cache_root

    return cache_root() / "dht-peers.json"


def load_peer_cache(path) -> list[str]:
    """The multiaddrs (with ``/p2p/<PeerId>``) a peer cache file holds; [] when it is missing or unreadable.

    A cache is a hint, never a reason to fail: a corrupt file is logged and ignored.
    """
    try:
        with open(path, encoding="utf-8") as f:
            addrs = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        log.warning("dht.peer_cache_unreadable path=%s error=%r", path, e)
        return []
    if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
        log.warning("dht.peer_cache_unreadable path=%s error=not a list of multiaddr strings", path)
        return []
    return addrs


def save_peer_cache(path, addrs: Sequence[str]) -> None:
    """Write ``addrs`` (at most ``PEER_CACHE_SIZE``) to the peer cache file atomically."""
    write_atomic(path, json.dumps(list(addrs)[:PEER_CACHE_SIZE], indent=1) + "\n")


def peer_cache_order(table: Iterable, holders: Iterable) -> list:
    """The order a peer cache keeps DHT servers in: ``holders`` (the nodes that named providers of
    the keys this node read, given oldest first) newest first, then the rest of ``table`` (the
    routing table's servers) in its order, each once. A node joining through its cache during a
    bootstrap outage then has the model key's holders in its table, and its first lookup asks them
    first (issue 31's simulator: 1.5-2 s of such a route was the walk towards them)."""
    return list(dict.fromkeys([*reversed(list(holders)), *table]))


def _server_addrs(host, dht, holders: Iterable = ()) -> list[str]:
    """Full multiaddrs of the DHT servers a peer cache keeps: ``holders`` (PeerId strings, as in
    ``SwarmDHT.holders``) first, then the routing table's (``peer_cache_order``)."""
    from libp2p.peer.id import ID

    peerstore = host.libp2p_host.get_peerstore()
    table = [str(p) for p in dht.routing_table.get_peer_ids()]
    out = []
    for peer in peer_cache_order(table, holders):
        try:
            peer_id = ID.from_base58(peer)
            addrs = peerstore.addrs(peer_id)
        except Exception:  # no address kept for it any more
            continue
        if addrs:
            # the peerstore keeps some addresses with the PeerId on (those a join was given)
            addr, suffix = str(addrs[0]), f"/p2p/{peer_id}"
            out.append(addr if addr.endswith(suffix) else addr + suffix)
    return out


async def _join_any(host, dht, known: Sequence[tuple[str, object]], timeout_s: float,
                    failures: list[str], transient: list[bool] | None = None, *,
                    fallback: Sequence[tuple[str, object]] = (),
                    fallback_failures: list[str] | None = None) -> tuple[list, list, list]:
    """Join through each ``(multiaddr, PeerInfo)`` of ``known`` (the bootstrap nodes) and of
    ``fallback`` (known peers, the peer cache) at once, ``timeout_s`` each.

    A bootstrap node that answers ends the known peers' joins (they were a hedge) and gives the
    other bootstrap nodes ``JOIN_GRACE_S`` more. A known peer that answers first gives every
    join still running ``JOIN_GRACE_S`` more, and then the round ends: a crashed bootstrap node,
    which accepts connections and never answers, no longer holds a start for its whole
    ``timeout_s`` (issue 31's simulator: 1.0 s of waiting before the cache was tried was most of a
    client's route during a bootstrap outage). Bootstrap nodes still joining then are returned,
    for the caller to keep joining in the background (``SwarmDHT.join_late``).

    Each failure adds a line to ``failures`` (``fallback_failures`` for ``fallback``'s) and, when
    ``transient`` is given, whether trying again may help (``JoinFailed.transient``).

    Returns:
        (the ``known`` entries that answered, the ``fallback`` entries that answered, the ``known``
        entries still joining when the round ended), each in the order given.
    """
    done: dict[int, bool] = {}  # id(PeerInfo) -> answered
    pending = len(known) + len(fallback)
    grace = False
    hedge = trio.CancelScope()  # the known peers' joins

    async def one(addr: str, info, nursery, into: list[str], primary: bool) -> None:
        nonlocal pending, grace
        try:
            await _join_one(host, dht, info, timeout_s)
            done[id(info)] = True
            if primary:
                hedge.cancel()
            if not grace:
                grace = True
                nursery.start_soon(_cancel_after, JOIN_GRACE_S, nursery.cancel_scope)
        except DiscoveryError as e:
            done[id(info)] = False
            into.append(f"{addr}: {e}")
            if transient is not None:
                transient.append(getattr(e, "transient", False))
        finally:
            pending -= 1
            if not pending:  # every join ended: no grace to wait out
                nursery.cancel_scope.cancel()

    async def hedged(nursery) -> None:
        with hedge:
            async with trio.open_nursery() as inner:
                for addr, info in fallback:
                    inner.start_soon(one, addr, info, nursery, fallback_failures if fallback_failures is not None
                                     else failures, False)

    async with trio.open_nursery() as nursery:
        for addr, info in known:
            nursery.start_soon(one, addr, info, nursery, failures, True)
        if fallback:
            nursery.start_soon(hedged, nursery)
        if not pending:
            nursery.cancel_scope.cancel()
    return ([x for x in known if done.get(id(x[1]))], [x for x in fallback if done.get(id(x[1]))],
            [x for x in known if id(x[1]) not in done])


async def _push_protocols(host, timeout_s: float = 2.0) -> None:
    """Send identify push (libp2p's ``/ipfs/id/push/1.0.0``) to every peer this host is connected to,
    so they see that it now serves ``PROTOCOL_ID``.

    A stage dials a bootstrap node for its dial-back check before it joins the DHT; identify ran on
    that connection while the DHT handler was not registered yet, the bootstrap node kept that
    protocol list, and ``_skip_client_peers`` then kept the stage out of its routing table for
    good. No other node learned of the stage through it, so when the bootstrap node went away each
    stage knew only itself (found by a fresh user's check of issue 31's outage; reproduced with two
    ``swarm stage`` processes). Bounded by ``timeout_s``; a peer that misses it learns on its next
    identify."""
    from libp2p.identity.identify_push.identify_push import push_identify_to_peers

    lh = host.libp2p_host
    if lh.get_connected_peers():
        with trio.move_on_after(timeout_s):
            await push_identify_to_peers(lh)


def _own_refresh(dht, made: list) -> None:
    """Replace libp2p 0.8.1's routing table refresh (``KadDHT.refresh_routing_table``, run by its
    maintenance loop at start and every 600 s): a self-lookup with 10 queries in flight, then one
    lookup of a random key per non-empty bucket. At start it duplicated the join's own self-lookup
    (``SwarmDHT.fill_table``); every 600 s it ran at every node that started together at once. Now
    the start's is skipped and the later ones are ``fill_table`` of the node in ``made`` (3 in
    flight, bounded by ``JOIN_LOOKUP_S``): the table's far buckets are filled by the lookups of a
    stage's announces (four keys every ``announce_interval_s``) and of its reads instead. Counted
    with 9 nodes joining: 9 self-lookups and 2 bucket lookups by the library on top of the joins'
    own 8 (issue 31, the 200-host bench's CPU)."""

    async def refresh_routing_table() -> None:
        if made:
            await made[0].fill_table()

    dht.refresh_routing_table = refresh_routing_table


def _keep_peers(peer_cache, host, dht, holders: Iterable = ()) -> None:
    """Write the DHT servers of the routing table to ``peer_cache`` (None: no cache), ``holders``
    first (``_server_addrs``); a cache that cannot be written is a missed hint, not a failure
    (logged), and so is a table that is empty by now (the file is left as it was)."""
    if peer_cache is None:
        return
    addrs = _server_addrs(host, dht, holders)
    if not addrs:
        return
    try:
        save_peer_cache(peer_cache, addrs)
    except OSError as e:
        log.warning("dht.peer_cache_unwritable path=%s error=%r", peer_cache, e)


async def _cancel_after(seconds: float, scope: trio.CancelScope) -> None:
    await trio.sleep(seconds)
    scope.cancel()


@asynccontextmanager
async def open_dht(host, *, server: bool, bootstrap: Sequence[str] = (), timeout_s: float = 10.0,
                   clock: Callable[[], float] | None = None, sync_clock: bool = True,
                   accept_models: frozenset[str] | None = None, peers: Sequence[str] = (),
                   peer_cache=None, join_attempts: int = JOIN_ATTEMPTS,
                   join_backoff_s: float = JOIN_BACKOFF_S) -> AsyncIterator[SwarmDHT]:
    """Run a swarm DHT node on ``host`` for the duration of the block.

    Args:
        host: a running ``SwarmHost``.
        server: serve the DHT to others (reachable stages, bootstrap nodes), and answer dial-backs
            (``swarm.discovery.reach``); False = client mode (coordinators, servers of the API,
            stages that cannot be dialed).
        bootstrap: multiaddrs of bootstrap nodes; a node with none starts a new swarm. All are
            joined at once; any one that answers is enough.
        timeout_s: deadline per bootstrap join, in seconds.
        clock: this machine's unix time (default ``swarm.discovery.clock.local_clock``).
        sync_clock: measure this node's offset from the bootstrap nodes once joined and stamp and
            check record expiries in that corrected time (``SwarmClock``); False uses ``clock``
            as it is (tests that move time by hand). Server nodes answer others' time requests.
        accept_models: model ids this node stores records for (None: any).
        peers: multiaddrs of any other swarm DHT servers (stages) this node knows: joined
            through at the same time as the bootstrap nodes, as a hedge (``_join_any``: the first
            bootstrap node to answer ends these joins; a known peer answering first ends the round
            ``JOIN_GRACE_S`` later, and bootstrap nodes still joining then are joined in the
            background). Issue 31: during a bootstrap outage no new node could join.
        peer_cache: a file of DHT servers this node met before (``load_peer_cache``, the nodes that
            held the keys it read first): joined through as ``peers`` are (not read when no
            bootstrap node is given), and rewritten with the servers of its routing table once
            joined and again on the way out. None: no cache.
        join_attempts: rounds of joins (bootstrap nodes, ``peers`` and the cache) before
            giving up, while some failure may pass (``JoinFailed.transient``: no answer in time,
            nothing accepting connections); >= 1.
        join_backoff_s: pause before the second round, in seconds; doubled each round, plus a
            random share of up to half again so that nodes that failed together retry apart.
    Yields:
        The SwarmDHT.
    Raises:
        ConfigError: a bootstrap address is malformed, or the libp2p version is not the pinned one.
        DiscoveryError: bootstrap addresses were given and none of them, of ``peers`` or of the
            peer cache could be joined in ``join_attempts`` rounds (the message names each address
            and why).
        ValueError: ``join_attempts`` < 1 or ``join_backoff_s`` < 0.
    """
    if join_attempts < 1:
        raise ValueError(f"join_attempts must be >= 1, got {join_attempts}")
    if join_backoff_s < 0:
        raise ValueError(f"join_backoff_s must be >= 0 s, got {join_backoff_s}")
    pin_protocol()
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.tools.anyio_service import background_trio_service

    from swarm.discovery.clock import SwarmClock, local_clock, serve_time

    infos = [parse_bootstrap(a) for a in bootstrap]
    # a node given no bootstrap node starts a swarm of its own: its cache (of some other swarm, maybe) is not read
    cached = list(dict.fromkeys([*peers, *(load_peer_cache(peer_cache) if peer_cache is not None and infos else [])]))
    cached_infos = []
    boot_ids = {info.peer_id for info in infos}
    for addr in cached:
        try:
            info = parse_bootstrap(addr)
        except ConfigError as e:  # a stale or hand-edited entry: the others may still answer
            log.warning("dht.peer_cache_entry_skipped addr=%s error=%s", addr, e)
            continue
        if info.peer_id not in boot_ids:  # joined through as a bootstrap node already (one dial per node)
            cached_infos.append((addr, info))
    clock = clock or local_clock
    if sync_clock:
        clock = SwarmClock(clock)
    if server:  # joining nodes ask a server node whether the swarm can dial them, and its time
        from swarm.discovery.reach import serve_dialback

        serve_dialback(host)
        serve_time(host, clock)
    dht = KadDHT(host.libp2p_host, DHTMode.SERVER if server else DHTMode.CLIENT,
                 validator=_validator(clock, accept_models), validator_changed=True, strict_validation=True)
    _skip_client_peers(dht)
    bound_provider_store(dht.provider_store)
    made: list[SwarmDHT] = []  # the node, once joined
    _own_refresh(dht, made)
    error: DiscoveryError | None = None
    async with background_trio_service(dht) as manager:
        if server:  # peers met before the DHT handler existed (the dial-back check) learn it serves the DHT
            await _push_protocols(host)
        for attempt in range(1, join_attempts + 1):
            # every bootstrap node and every known peer at once (one busy or gone costs its timeout, not
            # the sum of all); a bootstrap node answering ends the known peers' joins
            failures: list[str] = []
            transient: list[bool] = []
            others: list[str] = []
            primary = list(zip(bootstrap, infos))
            joined, via_known, late = await _join_any(host, dht, primary, timeout_s, failures, transient,
                                                      fallback=cached_infos, fallback_failures=others)
            all_failed = bool(infos) and not joined
            through, through_addrs = infos, list(bootstrap)
            if cached_infos and (all_failed or not infos):
                if via_known:
                    if late:  # slow, or crashed with its port still open: keep trying it in the background
                        log.info("dht.joined_before_bootstrap through=%d/%d known peers; still joining %d "
                                 "bootstrap node(s)%s", len(via_known), len(cached_infos), len(late),
                                 "; " + "; ".join(failures) if failures else "")
                    else:
                        log.warning("dht.joined_without_bootstrap through=%d/%d known peers; bootstrap: %s",
                                    len(via_known), len(cached_infos), "; ".join(failures) or "none given")
                    through, through_addrs = [i for _, i in via_known], [a for a, _ in via_known]
                    joined, all_failed, failures = via_known, False, []
                else:
                    all_failed = True
                    failures.append("no known peer answered either: " + "; ".join(others))
            if not all_failed or attempt == join_attempts or not any(transient):
                break
            # a bootstrap node answering many joins at once misses some (issue 31: 60 of 199 nodes
            # joining through one node on 2 cores); nodes that failed together retry apart (jitter)
            pause_s = join_backoff_s * 2 ** (attempt - 1) * (1 + random.random() / 2)
            log.info("dht.join_retry attempt=%d/%d pause_s=%.2f failures=%s", attempt, join_attempts, pause_s,
                     "; ".join(failures))
            await trio.sleep(pause_s)
        if all_failed and attempt > 1:
            failures.append(f"{attempt} rounds of joins")
        if all_failed:
            # raised after the service stops, so the caller sees it bare, not in an exception group
            head = "no bootstrap node answered: " if infos else "no bootstrap node given, and "
            error = DiscoveryError("cannot join the swarm, " + head + "; ".join(failures))
        else:
            for line in failures:
                log.warning("dht.bootstrap_failed %s", line)
            log.info("dht.start mode=%s bootstrap=%d/%d", "server" if server else "client",
                     len(infos) - len(failures), len(infos))
            node = SwarmDHT(host, dht, through, clock, through_addrs)
            made.append(node)
            if through is not infos:  # joined through known peers: no bootstrap node to read from
                node.read_alpha = OUTAGE_READ_ALPHA
                if late:
                    manager.run_task(node.join_late, late, timeout_s, name="swarm-dht-late-bootstrap")
            await node.sync_clock(addrs=[a for a, _ in joined])
            if through and server:
                # in the background, bounded by JOIN_LOOKUP_S: start-up does not wait for it. A client
                # is in no one's table (``_skip_client_peers``): its own lookups start at the bootstrap
                manager.run_task(node.fill_table, name="swarm-dht-join-lookup")
            else:
                node.table_filled.set()
            _keep_peers(peer_cache, host, dht, node.holders)
            try:
                yield node
            finally:
                # again on the way out: a client's table held only the bootstrap nodes when it joined
                # (it runs no self-lookup), so its cache could not carry it through their outage; its
                # lookups since met the servers near the keys it read (issue 31's simulator)
                _keep_peers(peer_cache, host, dht, node.holders)
    if error is not None:
        raise error


async def ping_ms(host, addr: str, rounds: int = 3, timeout_s: float = 3.0) -> float | None:
    """Median-free minimum round trip from ``host`` (a SwarmHost) to a peer over the libp2p ping protocol, in
    milliseconds.

    Dials ``addr`` (an existing connection is reused), then times ``rounds`` 32-byte echoes on
    one stream and returns the smallest. None when the peer cannot be reached in time.
    """
    try:
        with trio.fail_after(timeout_s):
            stream = await host.open_raw_stream(addr, PING_PROTOCOL)
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


class ProofBoard:
    """The fraud proofs' slots on the DHT of ``node`` (a ``SwarmDHT``; the module docstring says how
    slots are filled and read): ``publish`` a proof, ``read_all`` / ``read_one`` the proofs against a PeerId."""

    def __init__(self, node: SwarmDHT):
        self.node = node

    async def publish(self, value: bytes, accused: str, timeout_s: float = 10.0) -> int:
        """Put a fraud proof (``swarm.proofs.encode``) in a slot of ``/swarm-proof/<accused>`` (checked here first)
        at this node, the bootstrap nodes and the nodes closest to the accused's slot 0: at each, in the
        first slot (``proof_key``) that is free or holds this very proof; a node whose ``PROOF_SLOTS``
        slots hold other proofs does not store it.

        Returns:
            How many remote DHT nodes stored it (or held it already).
        Raises:
            ProofRefused: the proof does not check (never published).
        """
        check_proof_value(proof_key(accused), value)
        keys = [proof_key(accused, slot).encode() for slot in range(PROOF_SLOTS)]
        tally = [0, 0]
        with trio.move_on_after(timeout_s):
            store = self.node.dht.value_store
            for kb in keys:  # this node's own copy: the first free slot, or the one holding it
                held = store.get(kb)
                if held is None:
                    store.put(kb, value)
                if held is None or held.value == value:
                    break

            async def send(peer) -> bool:
                for kb in keys:
                    if await store._store_at_peer(peer, kb, value):
                        return True
                    held = await store._get_from_peer(peer, kb)
                    if held == value:
                        return True
                    if held is None:  # refused and holds nothing there: it does not take the proof at all
                        return False
                log.info("dht.proof_slots_full accused=%s peer=%s slots=%d", accused, peer, PROOF_SLOTS)
                return False

            await self.node.spread(keys[0], send, tally)
        log.info("dht.proof_published accused=%s stored=%d asked=%d", accused, *tally)
        return tally[0]

    async def read_all(self, peer_id: str, timeout_s: float = 3.0) -> list[bytes]:
        """The distinct proofs against ``peer_id`` that check without weights, from the slots of this node's
        store and of the bootstrap nodes' (where every publish stores them); [] when none.

        A node fills its slots in order (``publish``), so each node's slots are read until the
        first empty one: one request per node when there is no proof, the common case.
        """
        keys = [proof_key(peer_id, slot) for slot in range(PROOF_SLOTS)]
        found: list[tuple[int, bytes]] = []  # (slot, value)
        for slot, key in enumerate(keys):
            local = self.node.dht.value_store.store.get(key.encode())
            if local is None:
                break
            found.append((slot, local[0].value))

        async def from_peer(peer) -> None:
            for slot, key in enumerate(keys):
                try:
                    async with self.node.bootstrap_slots:  # a libp2p node resets requests beyond 12 in flight
                        got = await self.node.dht.value_store._get_from_peer(peer, key.encode())
                except Exception as e:  # unreachable or not serving: another node may hold it
                    log.debug("dht.get_failed key=%s peer=%s error=%r", key, peer, e)
                    return
                if got is None:
                    return
                found.append((slot, got))

        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for info in self.node.bootstrap:
                    nursery.start_soon(from_peer, info.peer_id)
        out: dict[bytes, None] = {}
        for slot, v in sorted(found, key=lambda sv: sv[0]):
            if v in out:
                continue
            try:
                check_proof_value(keys[slot], v)
                out[v] = None
            except SwarmError as e:
                log.info("dht.proof_rejected accused=%s reason=%s", peer_id, e)
        return list(out)

    async def read_one(self, peer_id: str, timeout_s: float = 3.0) -> bytes | None:
        """The first of ``read_all``: a proof against ``peer_id`` that checks without weights; None when
        there is none (``swarm peers``: whether any proof is published)."""
        proofs = await self.read_all(peer_id, timeout_s)
        return proofs[0] if proofs else None

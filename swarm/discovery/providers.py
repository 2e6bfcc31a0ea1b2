"""Provider records of the swarm's DHT: a store that stale entries cannot fill, and a lookup without side effects.

Owns: ``bound_provider_store`` (the provider store every swarm DHT node runs), ``lookup_providers`` (the lookup
readers use) and ``ask_each_once`` (a fan-out asking each node of a lookup once). No torch. What libp2p 0.8.1
does instead, and the store's policy: docs/architecture.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

import trio

from swarm.discovery.records import MAX_TTL_S

log = logging.getLogger(__name__)

PROVIDER_TTL_S = MAX_TTL_S  # an entry not refreshed this long is dropped, in seconds of the storing node
MAX_PROVIDERS_PER_KEY = 256  # per key and node; a GET_PROVIDERS answer of 256 stays far below 4 MiB
ESTABLISHED_GAP_S = 30.0  # a provider seen again this long after it was first seen is established, in seconds
FIRST_SEEN_KEPT = 8192  # (key, provider) pairs whose first sighting a node remembers, evicted ones included
QUERY_TIMEOUT_S = 3.0  # one GET_PROVIDERS request to one node
PROVIDERS_SETTLE_S = 0.1  # a read keeps listening this long after the first node that names providers


def bound_provider_store(store, clock: Callable[[], float] = time.time) -> None:
    """Replace ``add_provider`` and ``get_providers`` of one libp2p ``ProviderStore`` (0.8.1).

    After this the store keeps, per key, at most ``MAX_PROVIDERS_PER_KEY`` entries, each at most
    ``PROVIDER_TTL_S`` after its last refresh; a newcomer to a full key evicts the least recently
    refreshed entry among those not yet established, and only when every entry is established the
    least recently refreshed of all. Established: announced again at least ``ESTABLISHED_GAP_S``
    after the node first saw it (the first sightings of the last ``FIRST_SEEN_KEPT`` pairs are
    remembered, also past an eviction), as a live stage re-provides every announce interval. So a
    flood of throw-away PeerIds announced once evicts only its own kind and newcomers, never a stage
    that has kept announcing (issue 45: 300 fake providers in 49 s pushed the one live stage out of
    every node's 256), and a newcomer pushed out gets back in, established, at its next announce.
    The DHT's ADD_PROVIDER and GET_PROVIDERS handlers and ``provide`` call these two methods, so the
    policy holds for what a node stores, serves and announces.

    Args:
        store: ``KadDHT.provider_store``.
        clock: seconds, for receipt times (the library's own expiry sweep compares them with
            ``time.time()``, so keep that scale).
    """
    from libp2p.kad_dht.provider_store import ProviderRecord
    from libp2p.peer.peerinfo import PeerInfo

    def fresh(key: bytes) -> dict:
        entries = store.providers.get(key)
        if entries is None:
            return {}
        now = clock()
        for peer_id in [p for p, rec in entries.items() if now - rec.timestamp > PROVIDER_TTL_S]:
            del entries[peer_id]
        if not entries:
            del store.providers[key]
        return entries

    first_seen: OrderedDict[tuple[bytes, str], float] = OrderedDict()

    def established(key: bytes, peer_id: str, refreshed: float) -> bool:
        return refreshed - first_seen.get((key, peer_id), refreshed) >= ESTABLISHED_GAP_S

    def add_provider(key: bytes, provider) -> None:
        if not provider or not provider.peer_id:
            return
        entries = fresh(key)
        store.providers[key] = entries
        peer_id, now = str(provider.peer_id), clock()
        first_seen.setdefault((key, peer_id), now)
        first_seen.move_to_end((key, peer_id))
        while len(first_seen) > FIRST_SEEN_KEPT:
            first_seen.popitem(last=False)
        if peer_id not in entries and len(entries) >= MAX_PROVIDERS_PER_KEY:
            newer = [p for p in entries if not established(key, p, entries[p].timestamp)]
            oldest = min(newer or entries, key=lambda p: entries[p].timestamp)
            del entries[oldest]
            log.info("providers.evicted key=%s peer=%s", key.hex()[:16], oldest)
        entries[peer_id] = ProviderRecord(provider_info=provider, timestamp=now)

    def get_providers(key: bytes) -> list:
        return [PeerInfo(rec.peer_id, rec.addresses) for rec in fresh(key).values()]

    store.add_provider = add_provider
    store.get_providers = get_providers


async def ask_each_once(peers, asked: set, ask: Callable[[object], Awaitable[None]]) -> None:
    """Run ``ask(peer)`` concurrently for each of ``peers`` not yet in ``asked``, and wait for them all.

    A DHT lookup asks the bootstrap nodes and then the closest nodes the network lookup names; the
    two lists overlap, and each node is asked once.

    Args:
        peers: libp2p peer IDs.
        asked: the peers asked so far, shared by the calls of one lookup; updated in place.
        ask: the query of one peer; it bounds its own time.
    """
    async with trio.open_nursery() as nursery:
        for peer in peers:
            if peer not in asked:
                asked.add(peer)
                nursery.start_soon(ask, peer)


SETTLE_QUORUM = 0.9  # a fan-out of reads or probes stops waiting once this share has finished ...
SETTLE_GRACE_S = 0.3  # ... and this many seconds more have passed (the rest are the slowest or gone)


async def gather_settled(jobs: list[Callable[[], Awaitable[None]]], *, quorum: float = SETTLE_QUORUM,
                         grace_s: float = SETTLE_GRACE_S, enough: Callable[[], bool] | None = None) -> int:
    """Run ``jobs`` concurrently; return when all have finished, or ``grace_s`` after ``quorum`` of them did.

    A fan-out to hundreds of stages otherwise waits for its slowest member: a stage that crashed
    answers nothing until the job's own deadline (seconds), and one behind a relay on another
    continent takes several round trips to dial. Found by the swarm simulator (issue 31): a cold
    route over 200 stages spent 2 s in RTT probes and about 4 s reading records, nearly all of it
    waiting for the last few percent. Jobs still running then are cancelled; each job bounds its
    own time and records its own result.

    Args:
        jobs: async callables without arguments.
        quorum: share of jobs (0-1] after whose completion the grace period starts.
        grace_s: seconds to wait for the rest after the quorum, >= 0.
        enough: checked after each job finishes; once true, the grace period starts as at the
            quorum (a route has enough once the stages heard cover every layer a few times).
    Returns:
        How many jobs finished.
    """
    if not jobs:
        return 0
    need = max(1, math.ceil(quorum * len(jobs)))
    finished = 0
    settling = False

    async with trio.open_nursery() as nursery:
        async def run(job) -> None:
            nonlocal finished, settling
            await job()
            finished += 1
            if finished == len(jobs):
                nursery.cancel_scope.cancel()  # all answered: no grace to wait out
            elif not settling and (finished >= need or (enough is not None and enough())):
                settling = True
                nursery.start_soon(settle)

        async def settle() -> None:
            await trio.sleep(grace_s)
            nursery.cancel_scope.cancel()

        for job in jobs:
            nursery.start_soon(run, job)
    return finished


async def lookup_providers(dht, key: bytes, found: dict, find_closest, first: Iterable = (), *,
                           settle_s: float | None = None, holders: dict | None = None) -> None:
    """Collect the providers of ``key`` into ``found`` (``{peer_id str: PeerInfo}``), as they arrive.

    Asks, concurrently and each under ``QUERY_TIMEOUT_S``: the nodes in ``first`` (e.g. the
    bootstrap nodes: answers even while the network lookup below is still dialing nodes that
    left), then the closest nodes to the key that the network lookup finds (where ADD_PROVIDER
    put them). This node's own entries are included. Nothing is stored: a provider heard of is
    never re-served with a fresh timestamp. The caller bounds the whole lookup with a deadline;
    what arrived before it stays in ``found``.

    With ``settle_s``, the lookup ends ``settle_s`` after the first answer that names a provider
    (every node holding the key holds the same recent providers, up to ``MAX_PROVIDERS_PER_KEY``):
    a cold client then waits for one answer, not for the network lookup's end (issue 31: 2.7 s in
    a healthy swarm with libp2p's lock-step rounds, up to the read's deadline with departed nodes
    in routing tables).

    Args:
        dht: a running libp2p ``KadDHT`` (0.8.1: ``ProviderStore._get_providers_from_peer_with_closers``).
        key: the encoded provider key.
        found: filled in place; an entry with addresses is never replaced by one without.
        find_closest: ``await find_closest(key, on_answer)`` -> the nodes closest to ``key`` (libp2p
            IDs), calling ``on_answer(peer_id)`` as each node of the lookup answers: that node is
            asked for providers at once, so the read need not wait for the lookup's end
            (``SwarmDHT.closest_nodes``, the swarm's own iterative lookup). It replaced libp2p's
            ``find_closest_peers_network``, whose rounds each wait for their slowest request, a
            departed node's costing the library's query timeout: issue 31's simulator, joined
            through a peer cache during a bootstrap outage (no bootstrap node to name providers
            first), missed every provider within the read's deadline with it.
        first: libp2p peer IDs to ask before the lookup finishes.
        settle_s: seconds to keep listening after the first provider arrives (None: until the
            lookup and its queries end).
        holders: when given, the PeerId (str) of each node that named providers is moved to its
            end (an insertion-ordered dict used as a set, most recent last): the nodes a peer
            cache should lead with (``SwarmDHT.holders``).
    """
    store = dht.provider_store
    me = dht.host.get_id()
    asked: set = {me}

    def keep(info) -> None:
        peer_id = str(info.peer_id)
        if peer_id not in found or (info.addrs and not found[peer_id].addrs):
            found[peer_id] = info

    for info in store.get_providers(key):
        keep(info)

    async with trio.open_nursery() as nursery:
        settling = False

        async def settle() -> None:
            await trio.sleep(settle_s)
            nursery.cancel_scope.cancel()

        async def ask(peer) -> None:
            nonlocal settling
            with trio.move_on_after(QUERY_TIMEOUT_S):
                providers, _ = await store._get_providers_from_peer_with_closers(peer, key)
                for info in providers:
                    keep(info)
                if providers and holders is not None:
                    holders.pop(str(peer), None)
                    holders[str(peer)] = None
                if providers and settle_s is not None and not settling:
                    settling = True
                    nursery.start_soon(settle)

        def answered(peer) -> None:  # a node of the lookup answered: ask it for providers now
            if peer not in asked:
                asked.add(peer)
                nursery.start_soon(ask, peer)

        nursery.start_soon(ask_each_once, list(first), asked, ask)
        try:
            closest = await find_closest(key, answered)
        except Exception as e:  # a lookup failing on the way is fewer providers, not a failed read
            log.info("providers.lookup_failed key=%s error=%r", key.hex()[:16], e)
            closest = []
        nursery.start_soon(ask_each_once, closest, asked, ask)

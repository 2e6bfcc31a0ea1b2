"""The iterative Kademlia lookup of the swarm's DHT: the k nodes closest to a key, and the values they hold.

Owns: ``lookup`` (Kademlia's: ``alpha`` queries in flight until the k closest nodes heard of have answered),
``ask`` (libp2p's GET_VALUE, serving as FIND_VALUE and FIND_NODE) and ``distance``. ``swarm.discovery.dht`` puts
at and reads from the nodes it finds. Why libp2p's own lookup will not do: docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import trio

log = logging.getLogger(__name__)

K = 20  # nodes a put stores at and a lookup converges on: libp2p's BUCKET_SIZE, the paper's k
ALPHA = 3  # requests in flight per lookup (the paper's alpha)
QUERY_TIMEOUT_S = 3.0  # one request to one node, dial included
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # libp2p's MAX_DHT_MESSAGE_SIZE
ADDR_TTL_S = 600  # how long addresses heard in an answer stay in the peerstore
TABLE_OFFER_GRACE_S = 0.05  # a lookup's routing table offers still running at its end get this long, in seconds


def distance(key: bytes, peer_id) -> int:
    """libp2p 0.8.1's Kademlia distance from a key to a node: XOR of SHA-256(key) and SHA-256(PeerId bytes).

    Args:
        key: the DHT key as bytes (a record key's UTF-8 text, an encoded provider key, a PeerId's bytes).
        peer_id: a libp2p ``ID``.
    """
    return int.from_bytes(hashlib.sha256(key).digest(), "big") ^ int.from_bytes(
        hashlib.sha256(peer_id.to_bytes()).digest(), "big")


class AskFailed(Exception):
    """A node did not answer a lookup request (unreachable, reset the stream, timed out, garbled)."""


@dataclass(frozen=True)
class Answer:
    """One node's answer: the value it holds for the key (None: none) and the closer nodes it named."""

    value: bytes | None
    closer: tuple  # PeerInfo


async def ask(host, protocol_id: str, peer_id, key: bytes, timeout_s: float = QUERY_TIMEOUT_S) -> Answer:
    """Send one GET_VALUE for ``key`` to ``peer_id`` and read its answer (libp2p 0.8.1's wire format).

    Addresses of the closer nodes named go into the peerstore, so the lookup can dial them.

    Args:
        host: the libp2p host (``SwarmHost.libp2p_host``).
        protocol_id: the DHT protocol (``swarm.discovery.dht.PROTOCOL_ID``).
        peer_id: libp2p ``ID`` of the node asked.
        key: the key, at most 128 bytes (the server resets longer ones).
        timeout_s: deadline for dial, request and answer, in seconds.
    Returns:
        The Answer.
    Raises:
        AskFailed: no well-formed answer within ``timeout_s``.
    """
    import varint
    from libp2p.kad_dht.pb.kademlia_pb2 import Message
    from libp2p.kad_dht.utils import maybe_consume_signed_record
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from libp2p.peer.peerstore import env_to_send_in_RPC
    from libp2p.utils.varint import read_varint_prefixed_bytes_limited
    from multiaddr import Multiaddr

    stream = None
    try:
        with trio.fail_after(timeout_s):
            stream = await host.new_stream(peer_id, [protocol_id])
            request = Message()
            request.type = Message.MessageType.GET_VALUE
            request.key = key
            request.senderRecord, _ = env_to_send_in_RPC(host)
            body = request.SerializeToString()
            await stream.write(varint.encode(len(body)) + body)
            response = Message()
            response.ParseFromString(await read_varint_prefixed_bytes_limited(stream, MAX_MESSAGE_BYTES))
    except trio.TooSlowError:
        raise AskFailed(f"{peer_id} did not answer within {timeout_s} s") from None
    except Exception as e:  # dial, negotiation, reset and parse errors share no base class in libp2p
        raise AskFailed(f"{peer_id}: {e!r}") from None
    finally:
        if stream is not None:
            with trio.move_on_after(1):
                try:
                    await stream.close()
                except Exception:  # closing a stream the peer reset: nothing to do
                    pass
    if response.type != Message.MessageType.GET_VALUE:
        raise AskFailed(f"{peer_id} answered a GET_VALUE with message type {response.type}")
    maybe_consume_signed_record(response, host, peer_id)  # its signed addresses, when it sent them
    me = host.get_id()
    peerstore = host.get_peerstore()
    closer = []
    for entry in response.closerPeers:
        try:
            other = ID(entry.id)
            addrs = [Multiaddr(a) for a in entry.addrs]
        except Exception:  # one malformed entry: skip it, keep the rest of the answer
            continue
        if other == me:
            continue
        if addrs:
            peerstore.add_addrs(other, addrs, ADDR_TTL_S)
        closer.append(PeerInfo(other, addrs))
    value = response.record.value if response.HasField("record") and response.record.value else None
    return Answer(value, tuple(closer))


@dataclass(frozen=True)
class Lookup:
    """What one lookup found.

    Attributes:
        closest: up to k nodes that answered, nearest to the key first (where a put stores).
        values: the values accepted, in the order they arrived, with the node that gave each.
        asked: requests sent. failed: of those, how many got no answer.
    """

    closest: tuple
    values: tuple[tuple[object, bytes], ...]
    asked: int
    failed: int


async def lookup(dht, key: bytes, *, protocol_id: str, k: int = K, alpha: int = ALPHA, seeds: Iterable = (),
                 accept: Callable[[bytes], bool] | None = None, enough: int = 0,
                 query_timeout_s: float = QUERY_TIMEOUT_S,
                 on_answer: Callable[[object], None] | None = None) -> Lookup:
    """Find the ``k`` nodes closest to ``key`` (and, with ``accept``, the values they hold) by iterative lookup.

    Starts from the ``k`` closest nodes of this node's routing table plus ``seeds`` (e.g. the
    bootstrap nodes, so a node whose table is empty can still look up). Keeps ``alpha`` requests
    in flight, each to the nearest node of the shortlist not yet asked; a node's answer adds the
    nodes it names to the shortlist, a node that fails leaves it. Ends when the ``k`` nearest
    nodes of the shortlist have all answered (Kademlia's termination), or once ``enough`` values
    were accepted (``enough`` > 0). The caller bounds the time.

    Args:
        dht: a running libp2p ``KadDHT`` (its host, routing table).
        key: the DHT key as bytes, at most 128.
        protocol_id: the DHT protocol to speak.
        k, alpha: Kademlia's parameters.
        seeds: libp2p peer IDs to ask besides the routing table's nearest.
        accept: a value check (e.g. the record validator); None ignores values (a node lookup).
        enough: stop after this many accepted values; 0: run the lookup to its end.
        query_timeout_s: deadline per request, in seconds.
        on_answer: called with each node's peer ID as it answers, while the lookup goes on (a
            provider read asks it for providers at once: the last nodes to answer are the nearest).
    Returns:
        The Lookup.
    """
    from libp2p.peer.peerinfo import PeerInfo

    host = dht.host
    me = host.get_id()
    start = list(dht.routing_table.find_local_closest_peers(key, k)) + list(seeds)
    if len(set(start) - {me}) < k:  # a node that just joined: its connections are all it knows
        start += [p for p in host.get_connected_peers() if dht.routing_table.peer_in_table(p)]
    values: list[tuple[object, bytes]] = []

    async with trio.open_nursery() as offers:
        async def query(peer_id):
            try:
                answer = await ask(host, protocol_id, peer_id, key, query_timeout_s)
            except AskFailed as e:
                log.debug("lookup.ask_failed key=%s error=%s", key[:16], e)
                return None
            if answer.value is not None and accept is not None and accept(answer.value):
                values.append((peer_id, answer.value))
            # it serves the DHT: a candidate for our routing table (whose rules decide)
            try:
                addrs = host.get_peerstore().addrs(peer_id)
            except Exception:  # libp2p raises when the peerstore has no entry: nothing to dial it at
                addrs = []
            if addrs:
                offers.start_soon(_add_to_table, dht, PeerInfo(peer_id, addrs))
            return [info.peer_id for info in answer.closer]

        walked = await walk(start, query, lambda p: distance(key, p), k=k, alpha=alpha, me=me,
                            done=(lambda: len(values) >= enough) if enough else None, on_answer=on_answer)
        # table offers still pending get TABLE_OFFER_GRACE_S: an offer to a bucket with room ends at
        # once (cancelled outright, the offers of the last answers, the nodes nearest the key, never
        # ran, and a client's peer cache lacked the servers it met); one pinging a full bucket's
        # oldest entry is not worth waiting for
        offers.cancel_scope.deadline = min(offers.cancel_scope.deadline, trio.current_time() + TABLE_OFFER_GRACE_S)
    log.debug("lookup.done key=%s asked=%d failed=%d heard=%d values=%d", key[:16], walked.asked, walked.failed,
              walked.heard, len(values))
    return Lookup(walked.closest, tuple(values), walked.asked, walked.failed)


@dataclass(frozen=True)
class Walk:
    """What ``walk`` did: ``closest`` (up to k nodes that answered, nearest first), requests
    ``asked``, of those ``failed``, and nodes ``heard`` of."""

    closest: tuple
    asked: int
    failed: int
    heard: int


async def walk(start: Iterable, query: Callable[[object], Awaitable[Iterable | None]],
               distance_of: Callable[[object], int], *, k: int = K, alpha: int = ALPHA, me: object = None,
               done: Callable[[], bool] | None = None,
               on_answer: Callable[[object], None] | None = None) -> Walk:
    """Kademlia's iterative walk (Maymounkov & Mazieres 2002, section 2.3), whatever a node and a
    request are: ``alpha`` requests in flight, each to the nearest node of the shortlist (the ``k``
    nearest heard of that did not fail) not yet asked, the next sent as soon as one ends (no
    lock-step rounds); ends when the shortlist has all answered, or once ``done()`` is true.

    ``lookup`` runs it over libp2p (``ask``); the swarm simulator (``bench/swarm_sim.py``) runs it
    over its network model, so both measure the same algorithm.

    Args:
        start: the nodes to begin from (any hashable ids).
        query: ``await query(node)`` -> the nodes it names (closer to the key), or None when it
            did not answer; it bounds its own time.
        distance_of: a node's distance to the key (smaller is nearer).
        k, alpha: Kademlia's parameters.
        me: the node walking, never asked nor counted when a start or an answer names it (other
            nodes' answers name it: it is in their tables).
        done: checked before each step: true ends the walk (a lookup that has enough values).
        on_answer: called with each node as it answers, before the nodes it named are heard of.
    Returns:
        The Walk.
    """
    dist: dict = {}  # every node heard of -> its distance to the key
    asked: set = set()
    answered: set = set()
    failed: set = set()

    def hear(node) -> None:
        if node not in dist and node != me:
            dist[node] = distance_of(node)

    for node in start:
        hear(node)
    send, receive = trio.open_memory_channel(math.inf)

    async def one(node) -> None:
        await send.send((node, await query(node)))

    def shortlist() -> list:
        return sorted((p for p in dist if p not in failed), key=dist.__getitem__)[:k]

    in_flight = 0
    async with trio.open_nursery() as nursery:
        while True:
            if done is not None and done():
                nursery.cancel_scope.cancel()
                break
            waiting = [p for p in shortlist() if p not in asked]
            while waiting and in_flight < alpha:
                node = waiting.pop(0)
                asked.add(node)
                in_flight += 1
                nursery.start_soon(one, node)
            if not in_flight:
                break  # the k nearest heard of have all answered
            node, closer = await receive.receive()
            in_flight -= 1
            if closer is None:
                failed.add(node)
                continue
            answered.add(node)
            if on_answer is not None:
                on_answer(node)
            for other in closer:
                hear(other)
    return Walk(tuple(sorted(answered, key=dist.__getitem__)[:k]), len(asked), len(failed), len(dist))


async def _add_to_table(dht, info) -> None:
    """Offer a node that answered the DHT protocol to the routing table (a full bucket pings its
    oldest entry first, so this is bounded and never fails the lookup)."""
    with trio.move_on_after(QUERY_TIMEOUT_S):
        try:
            await dht.routing_table.add_peer(info)
        except Exception as e:  # a table that will not take it: the lookup goes on without
            log.debug("lookup.table_add_failed peer=%s error=%r", info.peer_id, e)

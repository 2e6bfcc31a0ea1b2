"""The peer store keeps the node's own records, stays bounded by forgetting departed peers, and no
stream handler's exception ends the host (issue 45, item 1). The 5,000-visitor soak is
``bench/peer_churn.py``."""

from __future__ import annotations

import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.stream_muxer.exceptions import MuxedStreamReset

from swarm.errors import ConfigError, StageLost
from swarm.transport import open_host
from swarm.transport.peerstore import BoundedPeerStore
from tests.support.transport import ECHO, echo, trio_test

pytestmark = pytest.mark.ring

PING = "/ipfs/ping/1.0.0"


def _peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


async def _visit(addr: str, protocol: str = PING) -> None:
    """A fresh PeerId connects (both sides identify each other), pings, and leaves."""
    async with open_host(create_new_key_pair()) as visitor:
        stream = await visitor.open_raw_stream(addr, protocol, timeout_s=5)
        if protocol == PING:
            await stream.write(b"p" * 32)
            assert await stream.read(32) == b"p" * 32
        await stream.close()


async def _serves(addr: str) -> None:
    async with open_host(create_new_key_pair()) as client:
        stream = await client.open_stream(addr, ECHO, timeout_s=5)
        await stream.send({"still": "serving"})
        assert (await stream.recv(timeout_s=5))["still"] == "serving"
        await stream.aclose()


@trio_test
async def test_more_distinct_visitors_than_max_peers_leave_the_node_serving() -> None:
    max_peers = 4
    async with open_host(create_new_key_pair(), max_peers=max_peers) as node:
        node.set_handler(ECHO, echo)
        store = node.libp2p_host.get_peerstore()
        own = node.libp2p_host.get_id()
        for _ in range(3 * max_peers):  # libp2p's PeerStore evicted the node's own entry at max_peers + 1
            await _visit(node.addrs()[0])
        await trio.sleep(0.2)  # identify of the last visitors may still be landing
        assert store.pubkey(own) == node.key_pair.public_key  # identify reads it
        assert store.privkey(own) == node.key_pair.private_key
        assert len(store.peer_ids()) <= max_peers + 1  # + the node: departed visitors were forgotten
        assert store.evicted >= 2 * max_peers
        await _serves(node.addrs()[0])
        await _visit(node.addrs()[0])  # identify answers a new visitor


@trio_test
async def test_an_exception_in_a_libp2p_handler_resets_that_stream_only() -> None:
    failing = "/swarm-test/raises/1"

    async def raises(net_stream) -> None:
        raise RuntimeError("handler bug")

    async with open_host(create_new_key_pair()) as node:
        node.set_handler(ECHO, echo)
        node.libp2p_host.set_stream_handler(TProtocol(failing), raises)  # not through set_handler's guard
        for _ in range(2):
            async with open_host(create_new_key_pair()) as visitor:
                # the reset may reach the visitor while it still negotiates, or on its first read (where
                # Yamux may report the stream's end as EOF when the reset and the close race)
                with pytest.raises((StageLost, StreamReset, MuxedStreamReset, StreamEOF)):
                    stream = await visitor.open_raw_stream(node.addrs()[0], failing, timeout_s=5)
                    with trio.fail_after(5):
                        await stream.read(1)
        await _serves(node.addrs()[0])
        await _visit(node.addrs()[0])


def test_eviction_spares_the_node_and_connected_peers_and_forgets_the_oldest_departed() -> None:
    own_key, live = create_new_key_pair(), _peer()
    own = ID.from_pubkey(own_key.public_key)
    store = BoundedPeerStore(own, max_peers=10)
    store.add_key_pair(own, own_key)
    store.watch(lambda peer_id: peer_id == live)
    store.add_protocols(live, ["/ipfs/id/1.0.0"])
    departed = []
    for i in range(30):
        key = create_new_key_pair()
        peer = ID.from_pubkey(key.public_key)
        store.add_pubkey(peer, key.public_key)  # no addresses, as identify leaves some
        store.peer_data_map[peer].last_identified = int(time.time()) - 1000 + i
        departed.append(peer)
    kept = set(store.peer_ids())
    assert own in kept and live in kept
    assert len(kept) <= 10
    assert kept - {own, live} <= set(departed[-8:])  # the newest departed are the ones kept
    store.clear_peerdata(own)  # libp2p code clearing "a peer" never takes the node's keys
    assert store.privkey(own) is not None


def test_max_peers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_peers"):
        BoundedPeerStore(_peer(), max_peers=0)


@trio_test
async def test_open_host_refuses_max_peers_below_one() -> None:
    with pytest.raises(ConfigError, match="max_peers"):
        async with open_host(create_new_key_pair(), max_peers=0):
            pass

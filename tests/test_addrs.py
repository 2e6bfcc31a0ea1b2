"""swarm.addrs.peer_id_from_addr: the PeerId a multiaddr names, read without libp2p."""

from __future__ import annotations

import pytest

from swarm.addrs import peer_id_from_addr, without_peer_id

PEER, RELAY = "12D3KooWPeer", "12D3KooWRelay"


@pytest.mark.parametrize("addr, want", [
    (f"/ip4/10.0.0.5/tcp/4001/p2p/{PEER}", PEER),
    (f"/ip6/::1/tcp/4001/p2p/{PEER}", PEER),
    (f"/p2p/{PEER}", PEER),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}", PEER),  # the peer behind the relay
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit", RELAY),  # the relay part of a circuit address
    (f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}/extra", PEER),  # only the PeerId's own component
    ("/ip4/1.2.3.4/tcp/1", ""),  # names no PeerId
    ("/ip4/1.2.3.4/tcp/1/p2p/", ""),
    ("", ""),
])
def test_peer_id_from_addr(addr, want):
    assert peer_id_from_addr(addr) == want


@pytest.mark.parametrize("addr, want", [
    (f"/ip4/10.0.0.5/tcp/4001/p2p/{PEER}", "/ip4/10.0.0.5/tcp/4001"),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}", "/ip4/1.2.3.4/tcp/1"),  # the relay's
    ("/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.4/tcp/1"),
    (f"/p2p/{PEER}", ""),
])
def test_without_peer_id(addr, want):
    assert without_peer_id(addr) == want

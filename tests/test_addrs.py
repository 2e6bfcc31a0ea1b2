"""swarm.addrs.peer_id_from_addr: the PeerId a multiaddr names, read without libp2p."""

from __future__ import annotations

import pytest

from swarm.addrs import current_addr, peer_id_from_addr, without_peer_id

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


OLD, NEW = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}", f"/ip4/127.0.0.1/tcp/4711/p2p/{PEER}"


@pytest.mark.parametrize("addr, announced, want", [
    (OLD, [OLD], OLD),  # still listens where it was dialed
    (OLD, [NEW], NEW),  # restarted on a new port of the same host: hand on the new one
    (OLD, [f"/ip4/10.0.0.9/tcp/5000/p2p/{PEER}", NEW], NEW),  # the same host's, not the first
    (OLD, [f"/ip4/10.0.0.9/tcp/5000/p2p/{PEER}"], OLD),  # another host (a port forward, a NAT): cannot tell
    (OLD, [], OLD),  # an older stage that does not say
    (f"/ip4/127.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}", [NEW], f"/ip4/127.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"),
    ("/ip4/127.0.0.1/tcp/4001", ["/ip4/127.0.0.1/tcp/4711"], "/ip4/127.0.0.1/tcp/4711"),
])
def test_current_addr(addr, announced, want):
    assert current_addr(addr, announced) == want

"""Host names in multiaddrs resolve as the system resolves them (``/etc/hosts`` included), and a name
that does not resolve says so (issue 45, item 14)."""

from __future__ import annotations

import socket
import time

import multiaddr
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm.discovery.dht import DiscoveryError, open_dht
from swarm.errors import StageLost
from swarm.transport import open_host
from swarm.transport.names import NameNotResolved, resolve_tcp
from tests.support.transport import ECHO, echo, trio_test

pytestmark = pytest.mark.ring

UNRESOLVABLE = "nosuch.invalid"  # RFC 2606: .invalid never resolves


def loopback_names() -> list[str]:
    """Every name /etc/hosts gives 127.0.0.1 ("localhost" at least)."""
    names = {"localhost"}
    try:
        with open("/etc/hosts") as f:
            for line in f:
                fields = line.split("#", 1)[0].split()
                if fields and fields[0] == "127.0.0.1":
                    names.update(fields[1:])
    except OSError:
        pass
    return sorted(n for n in names if socket.gethostbyname(n) == "127.0.0.1")


@trio_test
async def test_names_from_etc_hosts_are_dialed_at_once() -> None:
    async with open_host(create_new_key_pair()) as node:
        node.set_handler(ECHO, echo)
        for name in loopback_names()[:3]:
            for kind in ("dns4", "dns"):
                addr = node.addrs()[0].replace("/ip4/127.0.0.1/", f"/{kind}/{name}/")
                async with open_host(create_new_key_pair()) as dialer:  # no connection to reuse
                    t0 = time.monotonic()
                    stream = await dialer.open_stream(addr, ECHO, timeout_s=5)  # libp2p 0.8.1: 14 s, unreachable
                    await stream.send({"via": addr})
                    assert (await stream.recv(timeout_s=5))["via"] == addr
                    assert time.monotonic() - t0 < 2, addr
                    await stream.aclose()


@trio_test
async def test_a_name_that_does_not_resolve_says_so() -> None:
    async with open_host(create_new_key_pair()) as node, open_host(create_new_key_pair()) as dialer:
        port_and_peer = node.addrs()[0].split("/tcp/", 1)[1]
        for kind in ("dns4", "dns6", "dns"):
            name = UNRESOLVABLE if kind != "dns6" else "localhost"  # /etc/hosts has no IPv6 localhost here
            if kind == "dns6" and _resolves(name, socket.AF_INET6):
                continue
            addr = f"/{kind}/{name}/tcp/{port_and_peer}"
            with pytest.raises(StageLost, match=f"cannot resolve {name}"):
                await dialer.open_stream(addr, ECHO, timeout_s=5)


@trio_test
async def test_resolve_keeps_the_rest_of_the_address() -> None:
    tail = "/tcp/4001/p2p/12D3KooWGUPmjNVmG9huP3jJ1yWP3t4NWqF8i8TBqQuJGkRK3xbA"
    assert await resolve_tcp(multiaddr.Multiaddr("/dns4/localhost" + tail)) == [
        multiaddr.Multiaddr("/ip4/127.0.0.1" + tail)]
    assert await resolve_tcp(multiaddr.Multiaddr("/ip4/10.1.2.3" + tail)) == [multiaddr.Multiaddr("/ip4/10.1.2.3" + tail)]
    with pytest.raises(NameNotResolved, match=f"cannot resolve {UNRESOLVABLE} to an IPv4 address") as info:
        await resolve_tcp(multiaddr.Multiaddr(f"/dns4/{UNRESOLVABLE}" + tail))
    assert info.value.name == UNRESOLVABLE


@trio_test
async def test_joining_through_a_named_bootstrap_node() -> None:
    async with open_host(create_new_key_pair()) as boot, open_dht(boot, server=True, sync_clock=False):
        named = boot.addrs()[0].replace("/ip4/127.0.0.1/", "/dns4/localhost/")
        async with open_host(create_new_key_pair()) as client:
            async with open_dht(client, server=False, bootstrap=[named], sync_clock=False, timeout_s=5):
                pass
        bad = boot.addrs()[0].replace("/ip4/127.0.0.1/", f"/dns4/{UNRESOLVABLE}/")
        async with open_host(create_new_key_pair()) as client:
            t0 = time.monotonic()
            with pytest.raises(DiscoveryError, match=f"cannot resolve {UNRESOLVABLE}"):
                async with open_dht(client, server=False, bootstrap=[bad], sync_clock=False, timeout_s=5):
                    pass
            assert time.monotonic() - t0 < 3  # no rounds of retries for a name that does not exist


def _resolves(name: str, family: int) -> bool:
    try:
        return bool(socket.getaddrinfo(name, None, family))
    except socket.gaierror:
        return False

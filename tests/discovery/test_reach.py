"""discovery/reach.py on loopback: the dial-back that picks a stage's DHT mode."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm.discovery.dht import open_dht
from swarm.discovery.reach import MAX_PORTS, PROTOCOL_ID, check_reachable, tcp_ports
from swarm.transport.host import open_host
from tests.support.net import free_port
from tests.support.transport import run



def test_tcp_ports_of_multiaddrs():
    assert tcp_ports(["/ip4/1.2.3.4/tcp/4001/p2p/QmX", "/ip4/1.2.3.4/tcp/4001", "/ip6/::1/tcp/5",
                      "/ip4/1.2.3.4/udp/9", "garbage", "/dns4/a.example/tcp/7"]) == [4001, 5, 7]


@pytest.mark.ring
def test_dial_back_tells_reachable_from_unreachable():
    async def main():
        async with AsyncExitStack() as stack:
            boot_host = await stack.enter_async_context(open_host(create_new_key_pair()))
            await stack.enter_async_context(open_dht(boot_host, server=True))
            boot = boot_host.addrs()[0]
            me = await stack.enter_async_context(open_host(create_new_key_pair()))
            port = int(me.addrs()[0].split("/tcp/")[1].split("/")[0])

            got = await check_reachable(me, [boot], me.addrs())
            assert got.reachable is True and got.observed_ip == "127.0.0.1" and got.ports == ((port, "ok"),)
            assert got.asked == boot and got.reason == ""

            # the IP an address names is ignored: the dial goes where the request came from
            # (a node cannot make the swarm dial third parties)
            got = await check_reachable(me, [boot], [f"/ip4/10.255.255.1/tcp/{port}"])
            assert got.reachable is True and got.ports == ((port, "ok"),)

            closed = free_port()
            got = await check_reachable(me, [boot], [f"/ip4/127.0.0.1/tcp/{closed}"])
            assert got.reachable is False and got.ports == ((closed, "refused"),)
            assert f"127.0.0.1:{closed} (refused)" in got.reason and boot in got.reason

            # one port reachable is enough
            got = await check_reachable(me, [boot], [f"/ip4/127.0.0.1/tcp/{closed}"] + me.addrs())
            assert got.reachable is True and dict(got.ports) == {closed: "refused", port: "ok"}

    run(main, timeout_s=60)


@pytest.mark.ring
def test_unknown_when_no_node_can_answer():
    async def main():
        async with AsyncExitStack() as stack:
            me = await stack.enter_async_context(open_host(create_new_key_pair()))
            plain = await stack.enter_async_context(open_host(create_new_key_pair()))  # serves no dial-back
            got = await check_reachable(me, [plain.addrs()[0]], me.addrs(), timeout_s=5)
            assert got.reachable is None and "does not serve the dial-back" in got.reason
            got = await check_reachable(me, [plain.addrs()[0]], ["/ip4/127.0.0.1/udp/9"])
            assert got.reachable is None and "no TCP port" in got.reason

    run(main, timeout_s=60)


@pytest.mark.ring
def test_malformed_requests_get_an_error_and_the_server_stays_up():
    async def main():
        async with AsyncExitStack() as stack:
            boot_host = await stack.enter_async_context(open_host(create_new_key_pair()))
            await stack.enter_async_context(open_dht(boot_host, server=True))
            boot = boot_host.addrs()[0]
            me = await stack.enter_async_context(open_host(create_new_key_pair()))
            for bad in ({"type": "dialback", "ports": [0]}, {"type": "dialback", "ports": list(range(1, MAX_PORTS + 2))},
                        {"type": "dialback", "ports": "80"}, {"type": "dialback", "ports": [True]}, {"type": "x"}):
                stream = await me.open_stream(boot, PROTOCOL_ID, timeout_s=5)
                await stream.send(bad)
                answer = await stream.recv(timeout_s=5)
                assert answer["type"] == "error" and "1 to 8 TCP ports" in answer["reason"], (bad, answer)
                await stream.aclose()
            assert (await check_reachable(me, [boot], me.addrs())).reachable is True

    run(main, timeout_s=60)

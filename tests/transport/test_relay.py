"""The delaying relay preserves bytes and order and adds at least its delay each way."""

from __future__ import annotations

import pytest
import trio

from swarm.transport.relay import open_relay, relay_addr, target_of
from tests.support.transport import trio_test


async def echo_server(task_status=trio.TASK_STATUS_IGNORED):
    async def handler(stream):
        async with stream:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)

    await trio.serve_tcp(handler, 0, host="127.0.0.1", task_status=task_status)  # loopback only


@pytest.mark.ring
@trio_test
async def test_bytes_order_and_delay() -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(echo_server)
        port = listeners[0].socket.getsockname()[1]
        async with open_relay("127.0.0.1", port, delay_ms=40) as relay:
            stream = await trio.open_tcp_stream("127.0.0.1", relay.port)
            payload = bytes(range(256)) * 1000
            t0 = trio.current_time()
            await stream.send_all(payload)
            got = b""
            while len(got) < len(payload):
                got += await stream.receive_some(65536)
            rtt = trio.current_time() - t0
            assert got == payload
            assert rtt >= 0.080  # 40 ms each way, a lower bound (never a speed claim)
            await stream.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.ring
@trio_test
async def test_rate_limit_serialises() -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(echo_server)
        port = listeners[0].socket.getsockname()[1]
        async with open_relay("127.0.0.1", port, delay_ms=0, rate_mbps=8) as relay:  # 1 MB/s each way
            stream = await trio.open_tcp_stream("127.0.0.1", relay.port)
            t0 = trio.current_time()
            await stream.send_all(b"x" * 200_000)
            got = 0
            while got < 200_000:
                got += len(await stream.receive_some(65536))
            assert trio.current_time() - t0 >= 0.2  # 200 kB at 1 MB/s, at least once
            await stream.aclose()
        nursery.cancel_scope.cancel()


def test_addr_rewrite() -> None:
    a = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWabc"
    assert relay_addr(a, 5000) == "/ip4/127.0.0.1/tcp/5000/p2p/12D3KooWabc"
    assert target_of(a) == ("127.0.0.1", 4001)


@pytest.mark.ring
@trio_test
async def test_redial_when_the_old_path_died() -> None:
    """A connection whose relay went away is replaced by a dial over the new address."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from swarm.transport import open_host

    from tests.support.transport import ECHO, echo

    async with open_host(create_new_key_pair()) as a, open_host(create_new_key_pair()) as b:
        a.set_handler(ECHO, echo)
        target = target_of(a.addrs()[0])
        async with open_relay(*target, delay_ms=1) as first:
            s = await b.open_stream(relay_addr(a.addrs()[0], first.port), ECHO, timeout_s=5)
            await s.send({"n": 1})
            assert (await s.recv(timeout_s=5))["n"] == 1
        async with open_relay(*target, delay_ms=1) as second:
            with trio.fail_after(10):
                s2 = await b.open_stream(relay_addr(a.addrs()[0], second.port), ECHO, timeout_s=5)
            await s2.send({"n": 2})
            assert (await s2.recv(timeout_s=5))["n"] == 2

"""The delaying relay preserves bytes and order and adds at least its delay each way."""

from __future__ import annotations

import trio

from swarm.transport.relay import open_relay, relay_addr, target_of

from .util import trio_test


async def echo_server(task_status=trio.TASK_STATUS_IGNORED):
    async def handler(stream):
        async with stream:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)

    await trio.serve_tcp(handler, 0, host="127.0.0.1", task_status=task_status)  # loopback only


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

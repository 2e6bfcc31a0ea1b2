"""Link emulation for benchmarks: a delaying (and optionally rate-limited) TCP relay on loopback.

Owns: ``DelayRelay`` (a TCP proxy on 127.0.0.1 to one target, each piece of data held a fixed one-way delay each
way and, with ``rate_mbps``, serialised at that rate; order kept, never looked into) and ``relay_addr`` (a
stage's multiaddr through a relay). These machines have no kernel netem.
"""

from __future__ import annotations

import logging
import math
from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator

import trio

log = logging.getLogger(__name__)

READ_BYTES = 64 * 1024


class DelayRelay:
    """Forward connections from ``listen_port`` (127.0.0.1) to ``target_host:target_port``.

    Args:
        target_host, target_port: where to forward (loopback only in tests and benchmarks).
        delay_ms: one-way delay added in each direction, in milliseconds.
        rate_mbps: optional bandwidth cap per direction per connection, in megabits per second.
    Use ``async with open_relay(...) as relay`` and dial ``relay.port``.
    """

    def __init__(self, target_host: str, target_port: int, delay_ms: float, rate_mbps: float | None = None):
        if delay_ms < 0 or (rate_mbps is not None and rate_mbps <= 0):
            raise ValueError(f"bad link settings: delay_ms={delay_ms} rate_mbps={rate_mbps}")
        self.target = (target_host, target_port)
        self.delay_s = delay_ms / 1000
        self.rate_bytes_per_s = rate_mbps * 1e6 / 8 if rate_mbps else math.inf
        self.port = 0
        self.connections = 0

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        try:
            upstream = await trio.open_tcp_stream(*self.target)
        except OSError as exc:
            log.info("relay.dial_failed target=%s:%d error=%s", *self.target, exc)
            await client.aclose()
            return
        async with client, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(self._pipe, client, upstream, nursery.cancel_scope)
            nursery.start_soon(self._pipe, upstream, client, nursery.cancel_scope)

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
        """Copy src -> dst, each piece released ``delay_s`` after it arrived (FIFO, rate-limited)."""
        send, recv = trio.open_memory_channel[tuple[float, bytes] | None](math.inf)

        async def reader() -> None:
            try:
                while data := await src.receive_some(READ_BYTES):
                    await send.send((trio.current_time() + self.delay_s, data))
            except trio.BrokenResourceError:
                pass
            await send.send(None)

        async with trio.open_nursery() as inner:
            inner.start_soon(reader)
            link_free = 0.0  # when the emulated link finishes sending what it holds
            async for item in recv:
                if item is None:
                    break
                due, data = item
                if self.rate_bytes_per_s != math.inf:
                    link_free = max(due, link_free) + len(data) / self.rate_bytes_per_s
                    due = link_free
                await trio.sleep_until(due)
                try:
                    await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            inner.cancel_scope.cancel()
        scope.cancel()  # one side ended: close both


@asynccontextmanager
async def open_relay(target_host: str, target_port: int, delay_ms: float,
                     rate_mbps: float | None = None) -> AsyncIterator[DelayRelay]:
    """Run a DelayRelay on 127.0.0.1 (port chosen by the kernel) for the duration of the block."""
    relay = DelayRelay(target_host, target_port, delay_ms, rate_mbps)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, relay._handle, 0, host="127.0.0.1"))
        relay.port = listeners[0].socket.getsockname()[1]
        log.info("relay.start port=%d target=%s:%d delay_ms=%.1f", relay.port, target_host, target_port, delay_ms)
        try:
            yield relay
        finally:
            nursery.cancel_scope.cancel()


def relay_addr(addr: str, port: int) -> str:
    """Rewrite ``/ip4/H/tcp/P/p2p/ID`` to ``/ip4/127.0.0.1/tcp/<port>/p2p/ID`` (dial through a relay)."""
    parts = addr.split("/")
    if len(parts) < 7 or parts[1] != "ip4" or parts[3] != "tcp" or parts[5] != "p2p":
        raise ValueError(f"expected /ip4/H/tcp/P/p2p/ID, got {addr!r}")
    parts[2], parts[4] = "127.0.0.1", str(port)
    return "/".join(parts)


def target_of(addr: str) -> tuple[str, int]:
    """(host, port) of an ``/ip4/H/tcp/P/...`` multiaddr."""
    parts = addr.split("/")
    return parts[2], int(parts[4])

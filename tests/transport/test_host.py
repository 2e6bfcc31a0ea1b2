"""Real py-libp2p hosts on loopback: framed exchange, limits, faults, and Noise-only security."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import msgpack
import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from swarm.addrs import without_peer_id
from swarm.errors import ConfigError, FrameTooLarge, HopTimeout, ProtocolError, StageLost, StreamClosed
from swarm.transport import FramedStream, SwarmHost, open_host
from tests.support.transport import ECHO, echo, run, trio_test

pytestmark = pytest.mark.ring

SINK = "/swarm-test/sink/1"


@asynccontextmanager
async def two_hosts() -> AsyncIterator[tuple[SwarmHost, SwarmHost]]:
    async with open_host(create_new_key_pair()) as a, open_host(create_new_key_pair()) as b:
        yield a, b


class Sink:
    """A handler that records every frame and the error that ended the stream."""

    def __init__(self) -> None:
        self.frames: list[dict] = []
        self.error: Exception | None = None
        self.done = trio.Event()

    async def __call__(self, stream: FramedStream) -> None:
        try:
            while True:
                self.frames.append(await stream.recv())
        except (StreamClosed, ProtocolError) as e:
            self.error = e
        finally:
            self.done.set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@trio_test
async def test_frames_both_ways_with_peer_ids_and_bound_addrs() -> None:
    async with two_hosts() as (a, b):
        a.set_handler(ECHO, echo)
        b.set_handler(ECHO, echo)
        for addr in a.addrs():
            assert addr.startswith("/ip4/127.0.0.1/tcp/") and addr.endswith(f"/p2p/{a.peer_id}")
            assert "/tcp/0/" not in addr
        ab = await b.open_stream(a.addrs()[0], ECHO, timeout_s=5)
        ba = await a.open_stream(b.addrs()[0], ECHO, timeout_s=5)
        assert (ab.remote_peer_id, ab.protocol_id) == (a.peer_id, ECHO)
        assert ba.remote_peer_id == b.peer_id
        await ab.send({"hello": "from b", "raw": b"\x00\x01"})
        await ba.send({"hello": "from a"})
        got_b = await ab.recv(timeout_s=5)
        got_a = await ba.recv(timeout_s=5)
        assert got_b == {"hello": "from b", "raw": b"\x00\x01", "server_saw_peer": b.peer_id}
        assert got_a == {"hello": "from a", "server_saw_peer": a.peer_id}
        await ab.aclose()
        await ba.aclose()


@pytest.mark.serial
@trio_test
async def test_16mib_round_trip_is_fast() -> None:
    async with two_hosts() as (a, b):
        a.set_handler(ECHO, echo)
        s = await b.open_stream(a.addrs()[0], ECHO, timeout_s=5)
        blob = bytes(range(256)) * (16 * 4096)  # 16 MiB
        t0 = time.monotonic()
        await s.send({"blob": blob}, timeout_s=5)
        back = await s.recv(timeout_s=5)
        elapsed = time.monotonic() - t0
        assert back["blob"] == blob
        assert elapsed < 4.0, f"16 MiB round trip took {elapsed:.2f}s"
        await s.aclose()


@trio_test
async def test_order_preserved_and_concurrent_senders_do_not_interleave() -> None:
    sink = Sink()
    async with two_hosts() as (a, b):
        a.set_handler(SINK, sink)
        s = await b.open_stream(a.addrs()[0], SINK, timeout_s=5)

        async def sender(tag: int) -> None:
            for i in range(15):
                # Sizes straddle Yamux's 64 KiB chunking so interleaving would corrupt frames.
                await s.send({"tag": tag, "i": i, "pad": bytes(50_000 + 37_000 * tag)}, timeout_s=5)

        async with trio.open_nursery() as nursery:
            for tag in range(6):
                nursery.start_soon(sender, tag)
        await s.aclose()
        await sink.done.wait()
    assert isinstance(sink.error, StreamClosed)
    assert len(sink.frames) == 6 * 15
    for tag in range(6):
        mine = [f for f in sink.frames if f["tag"] == tag]
        assert [f["i"] for f in mine] == list(range(15))
        assert all(len(f["pad"]) == 50_000 + 37_000 * tag for f in mine)


@trio_test
async def test_eof_after_queued_frames() -> None:
    sink = Sink()
    async with two_hosts() as (a, b):
        a.set_handler(SINK, sink)
        s = await b.open_stream(a.addrs()[0], SINK, timeout_s=5)
        for i in range(3):
            await s.send({"i": i})
        await s.aclose()
        await sink.done.wait()
    assert [f["i"] for f in sink.frames] == [0, 1, 2]
    assert isinstance(sink.error, StreamClosed) and "closed the stream" in str(sink.error)


@trio_test
async def test_closed_flag_when_peer_ends_the_stream() -> None:
    async def close_at_once(stream: FramedStream) -> None:
        await stream.recv()

    async with two_hosts() as (a, b):
        a.set_handler(SINK, close_at_once)
        s = await b.open_stream(a.addrs()[0], SINK, timeout_s=5)
        assert not s.closed
        await s.send({"hello": 1})
        with pytest.raises(StreamClosed):
            await s.recv(timeout_s=5)
        assert s.closed


@trio_test
async def test_receiver_refuses_oversized_declared_length_and_resets() -> None:
    sink = Sink()
    async with two_hosts() as (a, b):
        a.set_handler(SINK, sink, max_frame_bytes=1 << 20)
        s = await b.open_stream(a.addrs()[0], SINK, timeout_s=5)
        await s.send({"ok": 1})
        await s.raw.write(struct.pack(">I", 0xFFFF_0000))  # declares ~4 GiB, sends no body
        await sink.done.wait()
        assert isinstance(sink.error, FrameTooLarge) and "4294901760" in str(sink.error)
        assert sink.frames == [{"ok": 1}]
        with pytest.raises(StreamClosed):  # the receiver reset the stream
            await s.recv(timeout_s=5)


@trio_test
async def test_sender_side_too_large_writes_nothing() -> None:
    async with two_hosts() as (a, b):
        a.set_handler(ECHO, echo)
        s = await b.open_stream(a.addrs()[0], ECHO, timeout_s=5, max_frame_bytes=1024)
        with pytest.raises(FrameTooLarge):
            await s.send({"x": bytes(2048)})
        await s.send({"x": 1})  # still usable: nothing partial was written
        assert (await s.recv(timeout_s=5))["x"] == 1


@pytest.mark.parametrize(
    "body", [b"\xc1\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb({"a": 1}) + b"extra"]
)
@trio_test
async def test_malformed_frames_are_protocol_errors(body: bytes) -> None:
    sink = Sink()
    async with two_hosts() as (a, b):
        a.set_handler(SINK, sink)
        s = await b.open_stream(a.addrs()[0], SINK, timeout_s=5)
        await s.raw.write(struct.pack(">I", len(body)) + body)
        await sink.done.wait()
    assert type(sink.error) is ProtocolError, sink.error


@trio_test
async def test_recv_deadline_is_hop_timeout() -> None:
    async with two_hosts() as (a, b):
        a.set_handler(SINK, Sink())
        s = await b.open_stream(a.addrs()[0], SINK, timeout_s=5)
        t0 = time.monotonic()
        with pytest.raises(HopTimeout):
            await s.recv(timeout_s=0.2)
        assert time.monotonic() - t0 < 1.0


@trio_test
async def test_unknown_protocol_is_protocol_error() -> None:
    async with two_hosts() as (a, b):
        with pytest.raises(ProtocolError, match="does not speak"):
            await b.open_stream(a.addrs()[0], "/swarm-test/nobody/1", timeout_s=5)


@trio_test
async def test_failing_handler_resets_only_its_stream() -> None:
    async def broken(stream: FramedStream) -> None:
        await stream.recv()
        raise RuntimeError("handler bug")

    async with two_hosts() as (a, b):
        a.set_handler("/swarm-test/broken/1", broken)
        a.set_handler(ECHO, echo)
        s = await b.open_stream(a.addrs()[0], "/swarm-test/broken/1", timeout_s=5)
        await s.send({"x": 1})
        with pytest.raises(StreamClosed):
            await s.recv(timeout_s=5)
        s2 = await b.open_stream(a.addrs()[0], ECHO, timeout_s=5)
        await s2.send({"y": 2})
        assert (await s2.recv(timeout_s=5))["y"] == 2


@trio_test
async def test_unreachable_peer_is_stage_lost_then_redial_works() -> None:
    async with two_hosts() as (a, b):
        a.set_handler(ECHO, echo)
        dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{a.peer_id}"
        t0 = time.monotonic()
        with pytest.raises((StageLost, HopTimeout)) as info:
            await b.open_stream(dead, ECHO, timeout_s=3)
        assert time.monotonic() - t0 < 3.5
        assert isinstance(info.value, StageLost) and dead in str(info.value)
        # The failed dial put a.peer_id in libp2p's 60 s negative cache; open_stream clears it.
        s = await b.open_stream(a.addrs()[0], ECHO, timeout_s=3)
        await s.send({"back": True})
        assert (await s.recv(timeout_s=5))["back"] is True


@trio_test
async def test_dial_deadline_is_hop_timeout() -> None:
    async with two_hosts() as (a, b):
        # A listening socket that never answers the handshake: TCP connects, Noise stalls.
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(4)
            addr = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{a.peer_id}"
            t0 = time.monotonic()
            with pytest.raises(HopTimeout, match="timed out after 0.5s"):
                await b.open_stream(addr, ECHO, timeout_s=0.5)
            assert time.monotonic() - t0 < 1.5


@trio_test
async def test_bad_dial_addr_is_config_error() -> None:
    async with open_host(create_new_key_pair()) as a:
        with pytest.raises(ConfigError, match="p2p"):
            await a.open_stream("/ip4/127.0.0.1/tcp/1", ECHO, timeout_s=1)
        with pytest.raises(ConfigError):
            await a.open_stream("not a multiaddr", ECHO, timeout_s=1)


@trio_test
async def test_port_in_use_is_config_error() -> None:
    async with open_host(create_new_key_pair()) as a:
        taken = without_peer_id(a.addrs()[0])
        # libp2p listens with SO_REUSEPORT, so without our probe this would silently succeed.
        with pytest.raises(ConfigError, match=f"cannot listen on {taken}: address already in use"):
            async with open_host(create_new_key_pair(), [taken]):
                pass
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen(1)
        addr = f"/ip4/127.0.0.1/tcp/{plain.getsockname()[1]}"
        with pytest.raises(ConfigError, match="already in use"):
            async with open_host(create_new_key_pair(), [addr]):
                pass


@pytest.mark.parametrize("addr", ["/ip4/127.0.0.1/udp/0/quic-v1", "/dns4/localhost/tcp/0", "junk"])
@trio_test
async def test_bad_listen_addr_is_config_error(addr: str) -> None:
    with pytest.raises(ConfigError):
        async with open_host(create_new_key_pair(), [addr]):
            pass


@trio_test
async def test_plaintext_only_peer_is_refused_noise_peer_accepted() -> None:
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    plain_kp = create_new_key_pair()
    plaintext_host = new_host(
        key_pair=plain_kp,
        sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(plain_kp)},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        listen_addrs=listen,
    )
    async with two_hosts() as (ours, noise_client), plaintext_host.run(listen):
        ours.set_handler(ECHO, echo)
        target = info_from_p2p_addr(multiaddr.Multiaddr(ours.addrs()[0]))
        with pytest.raises(Exception) as info:  # libp2p's SwarmDialAllFailedError
            with trio.fail_after(5):
                await plaintext_host.connect(target)
        assert "secure protocol" in repr(info.value.__cause__) or "security" in repr(info.value.__cause__)
        assert not ours.libp2p_host.get_network().get_connections(plaintext_host.get_id())
        # Control: a Noise peer connects and talks.
        s = await noise_client.open_stream(ours.addrs()[0], ECHO, timeout_s=5)
        await s.send({"noise": True})
        assert (await s.recv(timeout_s=5))["noise"] is True


@pytest.mark.slow
def test_more_than_250_sequential_inbound_connections() -> None:
    """libp2p 0.8.1 never returns an inbound connection's limiter slot; a stage must still accept
    connection 251 and beyond (it refused every dial after its 250th coordinator).

    256 connections, each a fresh one (the dialer closes it before the next): 8 dialers at once,
    32 in turn each, since closing one costs libp2p ~0.2 s of sleeps (sequential: ~60 s)."""
    run(_many_inbound, timeout_s=90)


INBOUND = 256
DIALERS = 8


async def _many_inbound() -> None:
    done: list[int] = []
    async with open_host(create_new_key_pair()) as a, AsyncExitStack() as stack:
        a.set_handler(ECHO, echo)
        peer = a.libp2p_host.get_id()
        dialers = [await stack.enter_async_context(open_host(create_new_key_pair())) for _ in range(DIALERS)]

        async def dial_in_turn(b: SwarmHost, first: int) -> None:
            network = b.libp2p_host.get_network()
            for i in range(first, INBOUND, DIALERS):
                s = await b.open_stream(a.addrs()[0], ECHO, timeout_s=5)
                await s.send({"i": i})
                assert (await s.recv(timeout_s=5))["i"] == i
                await s.aclose()
                await network.close_peer(peer)
                assert not network.get_connections(peer)  # the next dial is a new inbound connection
                done.append(i)

        async with trio.open_nursery() as nursery:
            for first, b in enumerate(dialers):
                nursery.start_soon(dial_in_turn, b, first)
    assert sorted(done) == list(range(INBOUND))


@trio_test
async def test_a_closed_host_leaves_no_connection_behind_at_its_peer() -> None:
    """A client that runs again with the same key (``swarm coordinate`` with its node key, a test's
    coordinator) gets a new connection each time: the host it closed must close its connections, or
    the peer holds them all and refuses the 9th (libp2p 0.8.1's per-peer limit is 8)."""
    key = create_new_key_pair()
    async with open_host(create_new_key_pair()) as a:
        a.set_handler(ECHO, echo)
        network = a.libp2p_host.get_network()
        for i in range(10):
            async with open_host(key) as b:
                s = await b.open_stream(a.addrs()[0], ECHO, timeout_s=5)
                await s.send({"i": i})
                assert (await s.recv(timeout_s=5))["i"] == i
            with trio.fail_after(5):
                while network.get_connections(b.libp2p_host.get_id()):
                    await trio.sleep(0.02)

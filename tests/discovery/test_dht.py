"""discovery/dht.py on loopback: the pinned protocol id, joining, announcing, fresh validated reads."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm.addrs import without_peer_id
from swarm.discovery import dht as dht_mod
from swarm.discovery.dht import (PLACEMENT_SHARDS, DiscoveryError, load_peer_cache, open_dht,
                                 pin_protocol, placement_key, placement_shard, save_peer_cache)
from swarm.discovery.records import record_key
from swarm.errors import ConfigError
from swarm.transport.host import open_host
from swarm.transport.identity import peer_id_of
from tests.support.dht import MODEL, OTHER, signed_record
from tests.support.transport import run

def test_protocol_is_pinned_in_every_kad_module():
    import libp2p.kad_dht.common as common
    import libp2p.kad_dht.kad_dht as kad
    import libp2p.kad_dht.peer_routing as routing
    import libp2p.kad_dht.provider_store as providers
    import libp2p.kad_dht.value_store as values

    assert pin_protocol() == "/swarm/kad/1.0.0"
    for module in (common, kad, routing, providers, values):
        assert module.PROTOCOL_ID == "/swarm/kad/1.0.0", module.__name__


def test_other_libp2p_version_is_refused(monkeypatch):
    monkeypatch.setattr(dht_mod, "_dist_version", lambda name: "0.9.0")
    with pytest.raises(ConfigError, match="pinned to libp2p 0.8.1"):
        pin_protocol()


async def _swarm(stack: AsyncExitStack, n_servers: int, client_clock=time.time):
    """A bootstrap node, n server nodes and one client node, all joined through the bootstrap."""
    keys = [create_new_key_pair() for _ in range(n_servers + 2)]
    hosts = [await stack.enter_async_context(open_host(k)) for k in keys]
    boot = await stack.enter_async_context(open_dht(hosts[0], server=True))
    addr = hosts[0].addrs()[0]
    servers = [await stack.enter_async_context(open_dht(h, server=True, bootstrap=[addr])) for h in hosts[1:-1]]
    client = await stack.enter_async_context(open_dht(hosts[-1], server=False, bootstrap=[addr], clock=client_clock))
    return keys, boot, servers, client


@pytest.mark.ring
def test_joins_run_no_library_refresh_and_the_periodic_one_is_our_self_lookup(monkeypatch):
    """libp2p's maintenance loop refreshes the routing table at start and every 600 s (a self-lookup
    of 10 queries in flight, then one per bucket): at start it duplicated the join's own self-lookup
    at every node. Joins run none of the library's lookups; its periodic refresh is ``fill_table``."""
    from libp2p.kad_dht.peer_routing import PeerRouting

    calls: list = []
    original = PeerRouting.find_closest_peers_network

    async def counted(self, key, *args, **kwargs):
        calls.append(key)
        return await original(self, key, *args, **kwargs)

    monkeypatch.setattr(PeerRouting, "find_closest_peers_network", counted)

    async def main():
        async with AsyncExitStack() as stack:
            _, boot, servers, client = await _swarm(stack, 3)
            for node in servers:
                await node.table_filled.wait()
            await trio.sleep(0.5)  # the maintenance loops' first round
            assert calls == []
            filled: list = []
            monkeypatch.setattr(type(servers[0]), "fill_table", lambda self: filled.append(self) or _done())
            await servers[0].dht.refresh_routing_table()
            assert filled == [servers[0]] and calls == []

    run(main, timeout_s=30)


async def _done() -> int:
    return 0


@pytest.mark.ring
def test_announce_and_find_fresh_records():
    async def main():
        async with AsyncExitStack() as stack:
            keys, boot, servers, client = await _swarm(stack, 3)
            await servers[0].announce(signed_record(keys[1], layers=(0, 3)), MODEL)
            await servers[1].announce(signed_record(keys[2], layers=(2, 5)), MODEL)
            await servers[2].announce(signed_record(keys[3], model=OTHER), OTHER)
            found = await client.find_records(MODEL)
            assert [(r.peer_id, r.layers) for r in found] == sorted(
                [(peer_id_of(keys[1]), (0, 3)), (peer_id_of(keys[2]), (2, 5))])
            assert [r.peer_id for r in await client.find_records(OTHER)] == [peer_id_of(keys[3])]
            assert len(await client.find_records(None)) == 3  # the all-stages key
            # the announcer republishes; the library's own republish (a lookup and 20 stores per key, at
            # every node at once 600 s after start) is left nothing: the record is held, not queued for it
            for node in servers:
                assert not node.dht.value_store.local_keys and not node.dht.provider_store.providing_keys
            assert servers[0].dht.value_store.get(record_key(peer_id_of(keys[1])).encode()) is not None
            # a republish with a higher seq is what the next read returns (no stale local copy)
            await servers[0].announce(signed_record(keys[1], layers=(0, 3), seq=2, state="draining"), MODEL)
            again = {r.peer_id: r for r in await client.find_records(MODEL)}
            assert again[peer_id_of(keys[1])].seq == 2 and again[peer_id_of(keys[1])].state == "draining"
    run(main, timeout_s=30)


def test_placement_shards_split_the_layers_evenly():
    assert [placement_shard(s, 80) for s in (0, 4, 5, 39, 40, 79)] == [0, 0, 1, 7, 8, 15]
    assert {placement_shard(s, 5) for s in range(5)} == {0, 3, 6, 9, 12}
    assert all(0 <= placement_shard(s, n) < PLACEMENT_SHARDS for n in (1, 7, 16, 80, 200) for s in range(n))
    keys = {placement_key("ab" * 32, i) for i in range(PLACEMENT_SHARDS)} | {placement_key("cd" * 32, 0)}
    assert len(keys) == PLACEMENT_SHARDS + 1 and all(len(k) == 64 for k in keys)


@pytest.mark.ring
def test_placement_reads_see_stages_the_model_key_does_not_name():
    async def main():
        async with AsyncExitStack() as stack:
            keys, boot, servers, client = await _swarm(stack, 2)
            await servers[0].announce(signed_record(keys[1], layers=(3, 5)), MODEL)
            shard_key = placement_key(MODEL, placement_shard(3, 5))
            assert peer_id_of(keys[1]) in await client._fresh_providers(shard_key, 5.0)  # announce provides it
            # a stage named only under its shard (the model key's 256 slots held by others)
            late = keys[2]
            await servers[1]._put(record_key(peer_id_of(late)), signed_record(late, layers=(0, 2)), [0, 0])
            await servers[1]._provide(placement_key(MODEL, placement_shard(0, 5)))
            assert [r.peer_id for r in await client.find_records(MODEL)] == [peer_id_of(keys[1])]
            seen = await client.find_records(MODEL, placement=True)
            assert sorted((r.peer_id, r.layers) for r in seen) == sorted(
                [(peer_id_of(keys[1]), (3, 5)), (peer_id_of(late), (0, 2))])
    run(main, timeout_s=30)


@pytest.mark.ring
def test_forged_and_expired_records_are_never_returned():
    async def main():
        async with AsyncExitStack() as stack:
            skew = [0.0]  # the client's clock runs ahead to see records expire without sleeping
            keys, boot, servers, client = await _swarm(stack, 3, client_clock=lambda: time.time() + skew[0])
            honest, forger = keys[1], keys[2]
            await servers[0].announce(signed_record(honest), MODEL)
            # the forger announces a record naming the honest stage's PeerId but signed by itself:
            # the validator refuses it on put, at every node, and on read
            with pytest.raises(Exception):
                await servers[1].dht.put_value(record_key(peer_id_of(honest)), signed_record(forger))
            # a record for another model provided under MODEL's key is dropped by the reader
            await servers[1].dht.put_value(record_key(peer_id_of(forger)), signed_record(forger, model=OTHER))
            await servers[1].dht.provide(MODEL)
            found = await client.find_records(MODEL)
            assert [r.peer_id for r in found] == [peer_id_of(honest)]
            # a record that expires is gone for readers even though remote nodes still hold it
            short = keys[3]
            await servers[2].announce(signed_record(short, ttl=60), MODEL)
            assert peer_id_of(short) in [r.peer_id for r in await client.find_records(MODEL)]
            skew[0] = 61.0
            assert [r.peer_id for r in await client.find_records(MODEL)] == [peer_id_of(honest)]
    run(main, timeout_s=30)


@pytest.mark.ring
def test_bootstrap_errors_are_one_clear_line():
    async def main():
        async with AsyncExitStack() as stack:
            host = await stack.enter_async_context(open_host(create_new_key_pair()))
            with pytest.raises(ConfigError, match="not a multiaddr"):
                async with open_dht(host, server=False, bootstrap=["/ip4/127.0.0.1/tcp/1"]):
                    pass
            dead = f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id_of(create_new_key_pair())}"
            with pytest.raises(DiscoveryError, match="no bootstrap node answered.*unreachable: nothing accepts"):
                async with open_dht(host, server=False, bootstrap=[dead], timeout_s=3):
                    pass
            # a live libp2p node that serves no swarm DHT (e.g. a plain stage or an IPFS peer)
            plain = await stack.enter_async_context(open_host(create_new_key_pair()))
            # its address with another PeerId (a stale copy, or a node restarted with a new key)
            stale = without_peer_id(plain.addrs()[0]) + "/p2p/" + peer_id_of(create_new_key_pair())
            with pytest.raises(DiscoveryError, match="is not at that address: .*Noise handshake failed.*PeerId"):
                async with open_dht(host, server=False, bootstrap=[stale], timeout_s=3):
                    pass
            with pytest.raises(DiscoveryError, match="does not serve the swarm DHT"):
                async with open_dht(host, server=False, bootstrap=[plain.addrs()[0]], timeout_s=3):
                    pass
    run(main, timeout_s=30)


@pytest.mark.ring
def test_rtt_to_a_peer():
    async def main():
        async with AsyncExitStack() as stack:
            keys, boot, servers, client = await _swarm(stack, 1)
            rtt = await client.rtt_ms(servers[0].host.addrs()[0])
            assert rtt is not None and 0 < rtt < 200
            assert await client.rtt_ms(f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id_of(create_new_key_pair())}", timeout_s=1) is None
    run(main, timeout_s=30)


@pytest.mark.ring
def test_announcer_republishes_draining_at_once_with_a_higher_seq():
    from swarm.discovery.announce import Announcer

    async def main():
        async with AsyncExitStack() as stack:
            keys, boot, servers, client = await _swarm(stack, 1)
            state = {"state": "online", "sessions": 0}
            pid = peer_id_of(keys[1])

            def snapshot():
                return dict(model_id=MODEL, model_name="m", num_layers=5, layers=(0, 3),
                            addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), **state)

            announcer = Announcer(servers[0], keys[1], snapshot, interval_s=30, ttl_s=60)
            async with trio.open_nursery() as nursery:
                await nursery.start(announcer.run)
                (first,) = await client.find_records(MODEL)
                assert first.state == "online" and first.expires_at > time.time() + 50
                state.update(state="draining", sessions=2)
                announcer.poke()  # no waiting for the 30 s tick
                with trio.fail_after(5):
                    while True:
                        (rec,) = await client.find_records(MODEL)
                        if rec.state == "draining":
                            break
                        await trio.sleep(0.05)
                assert rec.seq > first.seq and rec.sessions == 2
                nursery.cancel_scope.cancel()
    run(main, timeout_s=30)


@pytest.mark.ring
def test_clients_stay_out_of_routing_tables():
    """A client-mode node that queried the swarm is never handed out as a DHT peer (libp2p 0.8.1
    adds every peer opening a DHT stream; swarm keeps only those that serve the protocol)."""
    async def main():
        async with AsyncExitStack() as stack:
            keys, boot, servers, client = await _swarm(stack, 2)
            await servers[0].announce(signed_record(keys[1]), MODEL)
            assert await client.find_records(MODEL)
            client_id = client.host.libp2p_host.get_id()
            for node in (boot, *servers):
                assert not node.dht.routing_table.peer_in_table(client_id)
            assert boot.dht.routing_table.peer_in_table(servers[0].host.libp2p_host.get_id())
    run(main, timeout_s=30)


@pytest.mark.ring
def test_a_node_joins_through_known_peers_while_no_bootstrap_node_answers(tmp_path):
    """Issue 31: during a bootstrap outage no new node could join. A node that met the swarm before
    (its peer cache file) or knows any stage's address (``peers``) joins through those instead."""
    cache = tmp_path / "peers.json"
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id_of(create_new_key_pair())}"

    async def main(nursery):  # nursery: where the silent listener runs
        async with AsyncExitStack() as stack:
            keys = [create_new_key_pair() for _ in range(4)]
            hosts = [await stack.enter_async_context(open_host(k)) for k in keys]
            await stack.enter_async_context(open_dht(hosts[0], server=True))
            addr = hosts[0].addrs()[0]
            server = await stack.enter_async_context(open_dht(hosts[1], server=True, bootstrap=[addr]))
            async with open_dht(hosts[2], server=False, bootstrap=[addr], peer_cache=cache) as client:
                # a client joins with the bootstrap node alone in its table; its reads meet the others
                assert [a.rsplit("/", 1)[-1] for a in load_peer_cache(cache)] == [str(hosts[0].libp2p_host.get_id())]
                await client.find_records(MODEL)
            cached = load_peer_cache(cache)
            assert cached and all(a.count("/p2p/") == 1 for a in cached)  # the servers it met, full multiaddrs
            assert str(hosts[1].libp2p_host.get_id()) in {a.rsplit("/", 1)[-1] for a in cached}  # kept on the way out
            # the bootstrap address given is dead: the cached peers answer
            async with open_dht(hosts[3], server=False, bootstrap=[dead], peer_cache=cache, timeout_s=3) as node:
                assert node.bootstrap and str(node.bootstrap[0].peer_id) in {a.rsplit("/", 1)[-1] for a in cached}
            # no cache, but a stage's address
            async with open_dht(hosts[3], server=False, bootstrap=[dead], peers=[hosts[1].addrs()[0]],
                                timeout_s=3) as node:
                assert [str(i.peer_id) for i in node.bootstrap] == [str(server.host.libp2p_host.get_id())]
            # none answers: one clear error naming both
            dead2 = f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id_of(create_new_key_pair())}"
            with pytest.raises(DiscoveryError,
                               match="no bootstrap node answered: .*no known peer answered either"):
                async with open_dht(hosts[3], server=False, bootstrap=[dead], peers=[dead2], timeout_s=3):
                    pass
            # a crashed bootstrap node (connections accepted, never answered): the known peer, joined
            # through at the same time, is enough JOIN_GRACE_S after it answered, not after the
            # bootstrap node's whole join timeout
            listener = (await nursery.start(trio.serve_tcp, _silent, 0))[0]
            mute = f"/ip4/127.0.0.1/tcp/{listener.socket.getsockname()[1]}/p2p/{peer_id_of(create_new_key_pair())}"
            start = time.monotonic()
            async with open_dht(hosts[3], server=False, bootstrap=[mute], peers=[hosts[1].addrs()[0]],
                                timeout_s=8) as node:
                took_s = time.monotonic() - start
                assert [str(i.peer_id) for i in node.bootstrap] == [str(server.host.libp2p_host.get_id())]
            assert dht_mod.JOIN_GRACE_S <= took_s < 1.0, took_s  # 1.3 s and more while the cache waited 1 s

    async def outer():
        async with trio.open_nursery() as nursery:
            await main(nursery)
            nursery.cancel_scope.cancel()

    run(outer, timeout_s=60)


async def _silent(stream):
    await trio.sleep_forever()


@pytest.mark.ring
def test_a_stage_that_dialed_the_bootstrap_node_before_joining_enters_its_table():
    """A stage dials a bootstrap node for its dial-back check before it serves the DHT; identify ran
    then and the bootstrap node never took it for a server, so a stage joining later never heard of
    it, and once the bootstrap node was gone each stage knew only itself (a fresh user's check of
    issue 31: two ``swarm stage`` processes). open_dht pushes identify to the peers met before."""
    from swarm.discovery.dht import parse_bootstrap

    async def main():
        async with AsyncExitStack() as stack:
            keys = [create_new_key_pair() for _ in range(3)]
            hosts = [await stack.enter_async_context(open_host(k)) for k in keys]
            boot = await stack.enter_async_context(open_dht(hosts[0], server=True))
            addr = hosts[0].addrs()[0]
            await hosts[1].libp2p_host.connect(parse_bootstrap(addr))  # as check_reachable does
            await trio.sleep(0.3)  # identify has run
            first = await stack.enter_async_context(open_dht(hosts[1], server=True, bootstrap=[addr]))
            await first.announce(signed_record(keys[1]), MODEL)
            first_id = hosts[1].libp2p_host.get_id()
            with trio.fail_after(5):
                while not boot.dht.routing_table.peer_in_table(first_id):
                    await trio.sleep(0.05)
            later = await stack.enter_async_context(open_dht(hosts[2], server=True, bootstrap=[addr]))
            await later.table_filled.wait()
            assert later.dht.routing_table.peer_in_table(first_id)

    run(main, timeout_s=30)


def _delaying_proxy(port: int, delay_s: float):
    """A TCP handler that waits ``delay_s`` and then relays the connection to 127.0.0.1:``port``
    (a bootstrap node on a slow path)."""
    async def handle(stream):
        await trio.sleep(delay_s)
        async with await trio.open_tcp_stream("127.0.0.1", port) as upstream:
            async def pump(src, dst):
                try:
                    while data := await src.receive_some(65536):
                        await dst.send_all(data)
                    await dst.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):  # the other side left
                    pass
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, stream, upstream)
                nursery.start_soon(pump, upstream, stream)
    return handle


@pytest.mark.ring
def test_a_bootstrap_node_slower_than_a_known_peer_is_joined_in_the_background(monkeypatch):
    """Issue 31: known peers are joined through at the same time as the bootstrap nodes. One that
    answers first lets the node start JOIN_GRACE_S later; the bootstrap node, still joining then,
    becomes one of its bootstrap nodes once it answers. Meanwhile its provider lookups run with
    OUTAGE_READ_ALPHA requests in flight."""
    alphas: list = []
    original = dht_mod.lookup

    async def counted(*args, **kwargs):
        alphas.append(kwargs.get("alpha"))
        return await original(*args, **kwargs)

    monkeypatch.setattr(dht_mod, "lookup", counted)

    async def main(nursery):
        async with AsyncExitStack() as stack:
            keys = [create_new_key_pair() for _ in range(3)]
            hosts = [await stack.enter_async_context(open_host(k)) for k in keys]
            await stack.enter_async_context(open_dht(hosts[0], server=True))
            boot_id = str(hosts[0].libp2p_host.get_id())
            await stack.enter_async_context(open_dht(hosts[1], server=True, bootstrap=[hosts[0].addrs()[0]]))
            port = int(str(hosts[0].addrs()[0]).split("/tcp/")[1].split("/")[0])
            listener = (await nursery.start(trio.serve_tcp, _delaying_proxy(port, 2.5), 0))[0]
            slow = f"/ip4/127.0.0.1/tcp/{listener.socket.getsockname()[1]}/p2p/{boot_id}"
            start = time.monotonic()
            async with open_dht(hosts[2], server=False, bootstrap=[slow], peers=[hosts[1].addrs()[0]],
                                timeout_s=8) as node:
                took_s = time.monotonic() - start
                assert [str(i.peer_id) for i in node.bootstrap] == [str(hosts[1].libp2p_host.get_id())]
                assert took_s < 1.2, took_s  # not the bootstrap node's 2.5 s
                await node.find_records(MODEL)
                assert alphas[-1] == dht_mod.OUTAGE_READ_ALPHA
                with trio.fail_after(8):
                    while boot_id not in {str(i.peer_id) for i in node.bootstrap}:
                        await trio.sleep(0.05)
                assert slow in node.bootstrap_addrs
                assert node.dht.routing_table.peer_in_table(hosts[0].libp2p_host.get_id())
                assert node.read_alpha == 3

    async def outer():
        async with trio.open_nursery() as nursery:
            await main(nursery)
            nursery.cancel_scope.cancel()

    run(outer, timeout_s=60)


@pytest.mark.ring
def test_a_peer_cache_leads_with_the_nodes_that_named_providers(tmp_path):
    """Issue 31's simulator: a client joined through its cache during a bootstrap outage spent up to
    2 s walking towards the model key's holders. The cache now leads with the nodes that named
    providers of the keys it read, newest first."""
    cache = tmp_path / "peers.json"

    async def main():
        async with AsyncExitStack() as stack:
            keys, boot, servers, _ = await _swarm(stack, 4)
            await servers[0].announce(signed_record(keys[1]), MODEL)
            host = await stack.enter_async_context(open_host(create_new_key_pair()))
            async with open_dht(host, server=False, bootstrap=[boot.host.addrs()[0]], peer_cache=cache) as client:
                assert await client.find_records(MODEL)
                holders = list(client.holders)
                assert client.read_alpha == 3  # joined through the bootstrap node: the paper's alpha
                assert holders  # the bootstrap node at least: every provide reaches it
            named = [a.rsplit("/", 1)[-1] for a in load_peer_cache(cache)]
            assert named[:len(holders)] == holders[::-1]
            assert dht_mod.peer_cache_order(["a", "b", "c"], ["c", "x"]) == ["x", "c", "a", "b"]

    run(main, timeout_s=60)


def test_a_corrupt_peer_cache_is_ignored(tmp_path):
    bad = tmp_path / "peers.json"
    bad.write_text("{not json")
    assert load_peer_cache(bad) == [] and load_peer_cache(tmp_path / "missing.json") == []
    save_peer_cache(bad, ["/ip4/1.2.3.4/tcp/1/p2p/x"] * 100)
    assert len(load_peer_cache(bad)) == dht_mod.PEER_CACHE_SIZE


class _RetrySeen(__import__("logging").Handler):
    """Sets a trio Event when ``open_dht`` logs that it will try its joins again."""

    def __init__(self):
        super().__init__()
        self.event = trio.Event()

    def emit(self, record):
        if record.getMessage().startswith("dht.join_retry"):
            self.event.set()


@pytest.mark.ring
def test_a_join_tries_again_until_the_bootstrap_node_answers():
    """Issue 31: 60 of 199 nodes joining through one busy bootstrap node gave up. A join that found
    nothing answering tries again after a pause, and gets in once the node is up."""
    import logging
    import socket

    boot_key = create_new_key_pair()
    held = socket.socket()  # holds a port on which nothing listens yet: connections are refused
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(boot_key)}"
    seen = _RetrySeen()
    logger = logging.getLogger("swarm.discovery.dht")
    level = logger.level
    logger.setLevel(logging.INFO)  # the retry is logged at INFO (a CLI's error stays one line)
    logger.addHandler(seen)

    async def main():
        async with AsyncExitStack() as stack:
            host = await stack.enter_async_context(open_host(create_new_key_pair()))
            joined: list = []

            async def join():
                async with open_dht(host, server=True, bootstrap=[addr], timeout_s=3, join_attempts=6,
                                    join_backoff_s=0.2) as node:
                    joined.append(node)
                    await trio.sleep_forever()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(join)
                await seen.event.wait()  # the first round failed: only now does the node come up
                assert not joined
                held.close()
                async with open_host(boot_key, [f"/ip4/127.0.0.1/tcp/{port}"]) as boot_host, \
                        open_dht(boot_host, server=True):
                    with trio.fail_after(15):
                        while not joined:
                            await trio.sleep(0.05)
                    node = joined[0]
                    assert [str(i.peer_id) for i in node.bootstrap] == [peer_id_of(boot_key)]
                    assert node.dht.routing_table.peer_in_table(boot_host.libp2p_host.get_id())
                    nursery.cancel_scope.cancel()

    try:
        run(main, timeout_s=40)
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
        held.close()


@pytest.mark.ring
def test_bootstrap_nodes_are_joined_at_once_and_a_silent_one_does_not_stop_the_join():
    """Several bootstrap addresses: any one answering is enough, and two that accept connections but
    never answer are left JOIN_GRACE_S after it answered, not waited for until their join timeout;
    permanent failures are not retried."""

    async def joins(stack: AsyncExitStack, nursery) -> None:
        listeners = [(await nursery.start(trio.serve_tcp, _silent, 0))[0] for _ in range(2)]
        mute = [f"/ip4/127.0.0.1/tcp/{ls.socket.getsockname()[1]}/p2p/{peer_id_of(create_new_key_pair())}"
                for ls in listeners]
        hosts = [await stack.enter_async_context(open_host(create_new_key_pair())) for _ in range(2)]
        await stack.enter_async_context(open_dht(hosts[0], server=True))
        live = hosts[0].addrs()[0]
        start = time.monotonic()
        async with open_dht(hosts[1], server=True, bootstrap=[*mute, live], timeout_s=6) as node:
            took_s = time.monotonic() - start
            assert node.dht.routing_table.peer_in_table(hosts[0].libp2p_host.get_id())
        assert took_s < 4.5, took_s  # waiting for the silent ones: >= 6 s; one after another: >= 12 s
        # a live node without the swarm DHT is no busy node: one round, not join_attempts
        plain = await stack.enter_async_context(open_host(create_new_key_pair()))
        start = time.monotonic()
        with pytest.raises(DiscoveryError, match="does not serve the swarm DHT"):
            async with open_dht(hosts[1], server=False, bootstrap=[plain.addrs()[0]], timeout_s=3,
                                join_backoff_s=5):
                pass
        assert time.monotonic() - start < 4

    async def main():
        async with trio.open_nursery() as nursery:  # the silent listeners
            async with AsyncExitStack() as stack:
                await joins(stack, nursery)
            nursery.cancel_scope.cancel()

    run(main, timeout_s=40)


def test_join_settings_are_checked():
    async def main():
        with pytest.raises(ValueError, match="join_attempts must be >= 1"):
            async with open_dht(None, server=False, join_attempts=0):
                pass
        with pytest.raises(ValueError, match="join_backoff_s must be >= 0"):
            async with open_dht(None, server=False, join_backoff_s=-1):
                pass

    run(main)

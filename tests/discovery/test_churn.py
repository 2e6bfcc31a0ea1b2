"""Churn and clocks on loopback DHT nodes (issue 27): stages that left never hide a live one, the
provider store stays bounded, a leaving stage withdraws, and a stage whose clock is minutes off is
found (or, where its record is refused, says so on its console)."""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm.discovery.dht import open_dht
from swarm.transport.host import open_host
from swarm.transport.identity import peer_id_of
from tests.support.dht import MODEL, OTHER, signed_record
from tests.support.transport import run

pytestmark = pytest.mark.ring


async def _boot(stack: AsyncExitStack, **kw):
    host = await stack.enter_async_context(open_host(create_new_key_pair()))
    dht = await stack.enter_async_context(open_dht(host, server=True, **kw))
    return dht, host.addrs()[0]


async def _node(stack: AsyncExitStack, boot_addr: str, *, server: bool, key=None, **kw):
    host = await stack.enter_async_context(open_host(key or create_new_key_pair()))
    return await stack.enter_async_context(open_dht(host, server=server, bootstrap=[boot_addr], **kw))


async def _depart(boot_addr: str, n: int, *, model=MODEL, layers=(0, 5), state="draining") -> list[str]:
    """n stages that announce (a DHT server node each, as reachable stages run) and leave, one
    after another: with a ``draining`` record (a drained stage) or an ``online`` one (killed).
    Returns their PeerIds."""
    gone = []
    for _ in range(n):
        key = create_new_key_pair()
        async with open_host(key) as host, open_dht(host, server=True, bootstrap=[boot_addr]) as dht:
            await dht.announce(signed_record(key, model=model, layers=layers, state=state), model)
        gone.append(peer_id_of(key))
    return gone


@pytest.mark.slow
def test_a_live_stage_is_found_after_25_stages_left():
    """py-libp2p keeps 20 providers per key for 48 h: 20 drained stages hid every later one."""
    async def main():
        async with AsyncExitStack() as stack:
            boot, addr = await _boot(stack)
            gone = await _depart(addr, 25)
            live = {}
            for server in (True, False):  # a reachable stage, and one in client mode (--dht-client)
                key = create_new_key_pair()
                node = await _node(stack, addr, server=server, key=key)
                await node.announce(signed_record(key, layers=(0, 5)), MODEL)
                live[peer_id_of(key)] = server
            reader = await _node(stack, addr, server=False)
            for provider_key in (MODEL, None):  # the model's key and the all-stages key (`swarm peers`)
                found = {r.peer_id: r.state for r in await reader.find_records(provider_key, timeout_s=10)}
                assert {p: found.get(p) for p in live} == {p: "online" for p in live}, provider_key
                assert set(found) <= set(live) | set(gone)
    run(main, timeout_s=60)


@pytest.mark.slow
def test_a_live_stage_is_found_after_40_killed_stages_of_other_ranges_and_models():
    async def main():
        async with AsyncExitStack() as stack:
            boot, addr = await _boot(stack)
            # killed, not drained: their records still say "online" until they expire
            gone = await _depart(addr, 20, layers=(2, 4), state="online")
            gone_other = await _depart(addr, 20, model=OTHER, layers=(0, 3), state="online")
            key = create_new_key_pair()
            node = await _node(stack, addr, server=False, key=key)
            await node.announce(signed_record(key, layers=(1, 3)), MODEL)
            reader = await _node(stack, addr, server=False)
            records = await reader.find_records(MODEL, timeout_s=10)
            assert peer_id_of(key) in {r.peer_id for r in records}
            assert {r.peer_id for r in records} <= set(gone) | {peer_id_of(key)}
            assert {r.peer_id for r in await reader.find_records(OTHER, timeout_s=10)} <= set(gone_other)
            assert peer_id_of(key) in {r.peer_id for r in await reader.find_records(None, timeout_s=10)}
    run(main, timeout_s=120)


def test_the_provider_store_is_bounded_and_forgets_entries_not_refreshed():
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    from swarm.discovery.providers import MAX_PROVIDERS_PER_KEY, PROVIDER_TTL_S, bound_provider_store

    async def main():
        async with AsyncExitStack() as stack:
            boot, _ = await _boot(stack)
            store, now = boot.dht.provider_store, [1_000_000.0]
            bound_provider_store(store, clock=lambda: now[0])
            ids = [ID.from_base58(peer_id_of(create_new_key_pair())) for _ in range(MAX_PROVIDERS_PER_KEY + 40)]
            addr = [Multiaddr("/ip4/127.0.0.1/tcp/1")]
            refreshed = {}  # provider -> when it last announced itself

            def add(pid):
                store.add_provider(b"k", PeerInfo(pid, addr))
                refreshed[pid] = now[0]

            keep = ids[5]  # an early provider that keeps refreshing (a live stage) is never evicted
            for i, pid in enumerate(ids):
                now[0] += 1
                add(pid)
                if i > 5 and i % 50 == 0:
                    add(keep)
            held = {p.peer_id for p in store.get_providers(b"k")}
            assert len(held) == MAX_PROVIDERS_PER_KEY
            assert ids[-1] in held and keep in held  # newcomers always get in; the refreshed one stays
            assert ids[0] not in held  # the least recently refreshed went first
            now[0] += PROVIDER_TTL_S - 30
            add(ids[-1])
            assert {p.peer_id for p in store.get_providers(b"k")} == {
                p for p in held if now[0] - refreshed[p] <= PROVIDER_TTL_S}
            assert len(store.get_providers(b"k")) < 40
            now[0] += PROVIDER_TTL_S + 1
            assert store.get_providers(b"k") == []
    run(main, timeout_s=30)


def test_a_stage_that_leaves_withdraws_its_record_within_seconds():
    from swarm.discovery.announce import LEAVING_TTL_S, Announcer

    async def main():
        async with AsyncExitStack() as stack:
            boot, addr = await _boot(stack)
            key = create_new_key_pair()
            node = await _node(stack, addr, server=True, key=key)
            later = [0.0]  # the reader's clock, moved by hand (no measuring against the bootstrap)
            reader = await _node(stack, addr, server=False, clock=lambda: time.time() + later[0], sync_clock=False)
            state = {"state": "online"}
            pid = peer_id_of(key)
            snapshot = lambda: dict(model_id=MODEL, model_name="m", num_layers=5, layers=(0, 5),  # noqa: E731
                                    addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), **state)
            announcer = Announcer(node, key, snapshot, interval_s=30, ttl_s=60)
            assert await announcer.publish()
            state["state"] = "draining"
            assert await announcer.withdraw()
            (rec,) = await reader.find_records(MODEL)
            assert rec.state == "draining" and rec.expires_at <= time.time() + LEAVING_TTL_S + 0.5
            later[0] = LEAVING_TTL_S + 1  # the online record's 60 s would still run; the withdrawal has not
            records, report = await reader.read_records(MODEL)
            assert records == [] and [d[:2] for d in report.dropped] == [(pid, "expired")]
    run(main, timeout_s=30)


def test_a_joining_record_marks_the_block_taken_until_the_online_record_replaces_it():
    """As ``membership.place``: a stage that chose its block announces it as joining from a client-mode
    DHT node, before its weights load; a stage placing itself next reads it and takes the other block;
    the first stage's online record (a new Announcer, as the daemon starts one) then replaces it."""
    from swarm.discovery.announce import JOINING_TTL_S, Announcer, joining_fields
    from swarm.discovery.client import holders_of
    from swarm.routing import Holder, plan_placement

    async def main():
        async with AsyncExitStack() as stack:
            boot, addr = await _boot(stack)
            key = create_new_key_pair()
            pid = peer_id_of(key)
            placer = await _node(stack, addr, server=False, key=key)
            reader = await _node(stack, addr, server=False)
            seed = Holder("seed", "/memory/seed", (0, 4), throughput_tps=10.0)  # one stage holds all 4 layers
            window = plan_placement([seed], 4, 2)
            fields = joining_fields(model_id=MODEL, model_name="m", num_layers=4, layers=window,
                                    addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",))
            assert await Announcer(placer, key, lambda: fields, interval_s=JOINING_TTL_S / 2,
                                   ttl_s=JOINING_TTL_S).publish()
            (rec,) = await reader.find_records(MODEL)
            assert (rec.peer_id, rec.state, rec.layers, rec.throughput_tps) == (pid, "joining", window, 0.0)
            assert rec.expires_at > time.time() + JOINING_TTL_S - 30
            assert plan_placement([seed, *holders_of([rec])], 4, 2) == (2, 4) != window == (0, 2)
            online = dict(fields, state="online", throughput_tps=20.0)
            assert await Announcer(placer, key, lambda: online, interval_s=30, ttl_s=60).publish()
            (rec,) = await reader.find_records(MODEL)
            assert (rec.state, rec.throughput_tps) == ("online", 20.0)
    run(main, timeout_s=30)


def test_a_stage_that_moves_announces_its_new_block_as_joining_at_its_measured_speed():
    from swarm.discovery.announce import JOINING_TTL_S, Announcer

    async def main():
        async with AsyncExitStack() as stack:
            boot, addr = await _boot(stack)
            key = create_new_key_pair()
            pid = peer_id_of(key)
            node = await _node(stack, addr, server=True, key=key)
            reader = await _node(stack, addr, server=False)
            snapshot = lambda: dict(model_id=MODEL, model_name="m", num_layers=8, layers=(0, 2),  # noqa: E731
                                    addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), state="draining", throughput_tps=30.0)
            announcer = Announcer(node, key, snapshot, interval_s=30, ttl_s=60)
            assert await announcer.publish()
            assert await announcer.move((2, 8))
            (rec,) = await reader.find_records(MODEL)
            # 30 steps/s over 2 layers is 60 layer-steps/s: 10 steps/s over 6 layers
            assert (rec.state, rec.layers, rec.throughput_tps, rec.rtt_ms) == ("joining", (2, 8), 10.0, {})
            assert rec.expires_at > time.time() + JOINING_TTL_S - 30 and announcer.withdrawn
    run(main, timeout_s=30)


@pytest.mark.parametrize("skew_s", [-180.0, 900.0, -3600.0])
def test_a_stage_whose_clock_is_off_is_found(skew_s):
    """Petals #433: a clock 180 s behind made every record expire on arrival, +900 s made it "too
    far out"; each node now measures its offset from the bootstrap node and works in its time."""
    from swarm.discovery.announce import Announcer

    async def main():
        async with AsyncExitStack() as stack:
            boot, addr = await _boot(stack)
            key = create_new_key_pair()
            pid = peer_id_of(key)
            node = await _node(stack, addr, server=True, key=key, clock=lambda: time.time() + skew_s)
            snapshot = lambda: dict(model_id=MODEL, model_name="m", num_layers=5, layers=(0, 5),  # noqa: E731
                                    addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",))
            assert await Announcer(node, key, snapshot, clock=node.clock).publish()  # the node's own clock
            # readers with a right clock, and with one off the other way
            for reader_skew in (0.0, -skew_s / 2):
                reader = await _node(stack, addr, server=False, clock=lambda: time.time() + reader_skew)
                assert [r.peer_id for r in await reader.find_records(MODEL)] == [pid], reader_skew
            assert abs(node.clock() - time.time()) < 1.0  # the offset cancelled the skew
    run(main, timeout_s=30)


def test_a_stage_whose_records_are_refused_says_so(caplog):
    """A record no DHT node stores is a warning on the stage's console, and publish reports False
    (READY's "announced"); before, it printed "announced": true and nothing else."""
    from swarm.discovery.announce import Announcer

    async def main():
        async with AsyncExitStack() as stack:
            # a bootstrap node that does not accept this model, with every clock right
            picky, picky_addr = await _boot(stack, accept_models=frozenset({OTHER}))
            key = create_new_key_pair()
            pid = peer_id_of(key)
            snapshot = lambda: dict(model_id=MODEL, model_name="m", num_layers=5, layers=(0, 5),  # noqa: E731
                                    addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",))
            node = await _node(stack, picky_addr, server=False, key=key)
            assert not await Announcer(node, key, snapshot).publish()
            # a clock 180 s behind that cannot be corrected (measuring is off): the bootstrap node
            # refuses the expired record
            boot, addr = await _boot(stack)
            key2 = create_new_key_pair()
            pid2 = peer_id_of(key2)
            snapshot2 = lambda: {**snapshot(), "addrs": (f"/ip4/127.0.0.1/tcp/1/p2p/{pid2}",)}  # noqa: E731
            node2 = await _node(stack, addr, server=False, key=key2, clock=lambda: time.time() - 180, sync_clock=False)
            assert not await Announcer(node2, key2, snapshot2).publish()

    with caplog.at_level(logging.WARNING, logger="swarm.discovery.announce"):
        run(main, timeout_s=30)
    refused = [r.getMessage() for r in caplog.records if "announce.refused" in r.getMessage()]
    assert len(refused) == 2, caplog.text
    assert all("clients cannot find this stage" in line and "clock" in line for line in refused)


@pytest.mark.parametrize("flood", [300, 1000])
def test_a_flood_of_throw_away_providers_never_pushes_out_a_stage_that_keeps_announcing(flood):
    """Issue 45 item 3: ``flood`` fresh PeerIds announced once each, 6 a second (300 in 49 s was
    seen), into a key a live stage provides every 60 s: the stage stays in every answer; a stage
    that joined during the flood may be pushed out, and is back, for good, after its next announce."""
    from libp2p.kad_dht.provider_store import ProviderStore
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    from swarm.discovery.providers import MAX_PROVIDERS_PER_KEY, bound_provider_store

    me = ID.from_base58(peer_id_of(create_new_key_pair()))
    store, now = ProviderStore(host=SimpleNamespace(get_id=lambda: me), peer_routing=None), [1_000_000.0]
    bound_provider_store(store, clock=lambda: now[0])
    addr = [Multiaddr("/ip4/127.0.0.1/tcp/1")]
    live, late = (ID.from_base58(peer_id_of(create_new_key_pair())) for _ in range(2))
    fakes = [ID.from_base58(peer_id_of(create_new_key_pair())) for _ in range(flood)]
    announced = {live: now[0], late: None}

    def held() -> set:
        return {p.peer_id for p in store.get_providers(b"k")}

    store.add_provider(b"k", PeerInfo(live, addr))  # the live stage has been up a while: two announces
    now[0] += 60
    store.add_provider(b"k", PeerInfo(live, addr))
    announced[live] = now[0]
    for i, fake in enumerate(fakes):
        now[0] += 1 / 6
        store.add_provider(b"k", PeerInfo(fake, addr))
        if i == 20:
            store.add_provider(b"k", PeerInfo(late, addr))
            announced[late] = now[0]
        for stage in (live, late):  # each stage re-provides every 60 s
            if announced[stage] is not None and now[0] - announced[stage] >= 60:
                store.add_provider(b"k", PeerInfo(stage, addr))
                announced[stage] = now[0]
        assert live in held(), i
        assert len(held()) <= MAX_PROVIDERS_PER_KEY
    now[0] += 60
    store.add_provider(b"k", PeerInfo(late, addr))
    for fake in fakes[:300]:  # another wave: neither stage moves now
        now[0] += 1 / 6
        store.add_provider(b"k", PeerInfo(ID.from_base58(peer_id_of(create_new_key_pair())), addr))
    assert {live, late} <= held()

"""``swarm serve --bootstrap`` believes what it measured over what stages claim (issue 45 item 17): a stage
announcing 1e9 tok/s but serving slowly gets serve's first route (claims are all it knows), the request
measures it, and the clients opened next route to the honest stage; the text stays the same. A heal's
replacement is chosen with the same measurements (``find_replacement``).

One swarm on loopback, in this process: a DHT bootstrap node and two stories260k stages of all 5 layers
(honest: claims 20 tok/s, computes far faster; cheat: claims 1e9, each forward slowed to 150 ms); the
server runs in a thread (tests/support/serve.py) with its own cache (so nothing is measured before).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import trio

from swarm.config import RingSpec, cache_root
from swarm.coordinator.measured import load_measured
from swarm.errors import collapse
from swarm.weights.identify import model_id as weights_model_id
from tests.coordinator.test_measured import _records, _slow_down
from tests.support.ring import open_bootstrap, start_announced

ASK = dict(prompt="Once upon a time", max_tokens=12, temperature=0)


def _route_until(server, want: list[str], within_s: float = 20.0) -> list[str]:
    end = time.monotonic() + within_s
    while True:
        route = [s["peer_id"] for s in server.health()["stages"]]
        if route == want or time.monotonic() > end:
            return route
        time.sleep(0.3)


@pytest.mark.ring
@pytest.mark.slow
def test_serve_routes_away_from_a_stage_it_measured_slower_than_it_claims(stories_dir, tmp_path, monkeypatch):
    from tests.support.serve import Server

    monkeypatch.setenv("SWARM_CACHE", str(tmp_path / "cache"))
    weights_id = weights_model_id(stories_dir, cache_root() / "manifests")
    got: dict = {}

    async def in_thread(fn, *args):
        return await trio.to_thread.run_sync(fn, *args)

    async def main():
        with trio.fail_after(300):
            async with AsyncExitStack() as stack:
                boot = await open_bootstrap(stack)
                nursery = await stack.enter_async_context(trio.open_nursery())
                stack.callback(nursery.cancel_scope.cancel)
                honest, _, _ = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "h.key", boot,
                                                     weights_id, 20.0)
                cheat, cheat_server, _ = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "c.key",
                                                               boot, weights_id, 1e9)
                _slow_down(cheat_server.block, 0.15)
                got["honest"], got["cheat"] = honest["peer_id"], cheat["peer_id"]
                while len(await _records(boot, tmp_path, weights_id)) < 2:
                    await trio.sleep(0.2)
                (tmp_path / "serve").mkdir()
                server = await in_thread(lambda: Server(RingSpec(model=str(stories_dir), stages=()),
                                                        tmp_path / "serve", bootstrap=(boot,)))
                try:
                    model = server.box["info"]["model"]
                    got["routed"] = [e["peer_id"] for e in server.box["info"]["ring"]]
                    texts = []
                    for _ in range(3):
                        texts.append(await in_thread(
                            lambda: server.client.completions.create(model=model, **ASK).choices[0].text))
                    got["texts"] = texts
                    got["route"] = await in_thread(_route_until, server, [got["honest"]])
                finally:
                    await in_thread(server.stop)

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    assert got["routed"] == [got["cheat"]]  # before any measurement the claim wins
    assert got["route"] == [got["honest"]]  # measured once, the cheat loses the route
    assert len(set(got["texts"])) == 1 and got["texts"][0]
    measured = load_measured(weights_id)
    assert measured[got["cheat"]] > 10.0  # ms per layer: over the honest stage's claim (10 ms), far over its own


def test_a_heals_replacement_believes_measurements_over_claims():
    """``find_replacement`` over known records: the stage claiming 1e9 tok/s is taken on claims alone, the
    honest one once the claimer was measured slow; without measurements nothing changes."""
    from swarm.discovery import client
    from swarm.discovery.records import StageRecord

    def record(peer: str, tps: float) -> StageRecord:
        return StageRecord(peer_id=peer, model_id="m" * 64, model_name="m", num_layers=5, layers=(0, 5),
                           addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), max_ctx=512, free_kv_bytes=1 << 30,
                           kv_bytes_per_token_layer=64, throughput_tps=tps)

    honest, cheat = record("12D3KooWhonest", 20.0), record("12D3KooWcheat", 1e9)
    rtt = {honest.peer_id: 1.0, cheat.peer_id: 1.0}

    async def probe(dht, rec, fresh):  # every probed stage answers, at the RTT of routing time
        fresh[rec.peer_id] = rtt[rec.peer_id]

    async def pick(measured):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(client, "probe_one", probe)
            hops = await client.find_replacement(None, "m" * 64, (0, 5), prev_peer=None, next_peer=None,
                                                 exclude=frozenset(), known=[honest, cheat], known_rtt_ms=rtt,
                                                 measured_layer_ms=measured)
        return [h.peer_id for h in hops]

    assert trio.run(pick, None) == [cheat.peer_id]
    assert trio.run(pick, {cheat.peer_id: 30.0}) == [honest.peer_id]

"""``swarm coordinate --model --bootstrap``: a routed stage that dies between the routing (its record
read, its RTT probed) and the connect is excluded and the route chosen again (found by
bench/chaos.py, where a stage killed in that second failed the request: "stage 1 [1, 2) is
unreachable: nothing accepts connections there")."""

from __future__ import annotations

import pytest
import trio

from swarm.config import CoordinatorConfig, RingSpec
from swarm.coordinator import generation
from swarm.errors import collapse
from swarm.weights.identify import model_id
from tests.support.models import reference_greedy
from tests.support.ring import start_announced

pytestmark = [pytest.mark.ring, pytest.mark.process]


def test_a_routed_stage_gone_before_the_connect_is_routed_around(stories_dir, tmp_path, monkeypatch):
    from swarm.cli.launch import BootstrapNode
    from swarm.discovery import client

    mid = model_id(stories_dir)
    real = client.discover_ring
    routes: list[list[str]] = []

    async def main(boot):
        async with trio.open_nursery() as nursery:
            fast, _, fast_scope = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "f.key", boot, mid,
                                                        throughput_tps=1000.0)
            slow, _, _ = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "s.key", boot, mid,
                                               throughput_tps=1.0)

            async def discover_then_lose_it(*args, **kwargs):
                found = await real(*args, **kwargs)
                routes.append([h.peer_id for h in found.route.hops])
                if len(routes) == 1:  # the chosen stage dies now, its record left on the DHT
                    fast_scope.cancel()
                    await trio.sleep(0.5)
                return found

            monkeypatch.setattr(client, "discover_ring", discover_then_lose_it)
            config = CoordinatorConfig(ring=RingSpec(model=str(stories_dir), stages=()), bootstrap=(boot,),
                                       max_new_tokens=12, key_path=tmp_path / "coord.key", receipt_dir=None)
            with trio.fail_after(120):
                while len(await _records(boot, tmp_path, mid)) < 2:
                    await trio.sleep(0.2)
                result = await generation.generate(config, "Once upon a time")
            nursery.cancel_scope.cancel()
        return result, fast["peer_id"], slow["peer_id"]

    with BootstrapNode(tmp_path / "boot.key") as boot:
        try:
            result, fast_peer, slow_peer = trio.run(main, boot.addr)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    assert routes == [[fast_peer], [slow_peer]]
    assert [e["peer_id"] for e in result["ring"]] == [slow_peer]
    assert result["output_ids"] == reference_greedy(stories_dir, result["prompt_ids"], 12, "float32")


async def _records(boot: str, tmp_path, mid: str) -> list:
    from swarm.discovery.dht import open_dht
    from swarm.transport import load_or_create_key, open_host

    async with open_host(load_or_create_key(tmp_path / "reader.key"), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_dht(host, server=False, bootstrap=[boot]) as dht:
        return await dht.find_records(mid)

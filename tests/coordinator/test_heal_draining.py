"""A stage that begins to drain between routing and the session's open (found by bench/chaos.py):
it refuses the open ("draining") yet answers every probe. The heal must blame it and take a spare;
before, it found every stage answering, skipped, and the request failed."""

from __future__ import annotations

import pytest
import trio

from swarm.config import RingSpec, StageSpec
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient
from swarm.coordinator.routing import RouteContext
from swarm.errors import collapse
from swarm.model.resolve import model_manifest_digest
from swarm.ranges import LayerRange
from swarm.transport import load_or_create_key, open_host
from tests.support.models import reference_greedy
from tests.support.ring import LOOPBACK, start_stages

pytestmark = [pytest.mark.ring]

PROMPT = [1, 403, 407, 261, 378]
NEW = 12


def test_a_stage_draining_since_routing_is_healed_around_not_skipped(stories_dir, tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            ((draining, d_server, _),) = await start_stages(nursery, stories_dir, [(0, 5)], tmp_path, "d")
            ((spare, _, _),) = await start_stages(nursery, stories_dir, [(0, 5)], tmp_path, "s")
            spec = RingSpec(model=str(stories_dir), stages=(draining,), spares=(spare,))
            async with open_host(load_or_create_key(tmp_path / "coord.key"), [LOOPBACK]) as host:
                ring = RingClient(host, spec, 30.0, 10.0, heartbeat_s=0.5)
                await ring.connect(5, model_manifest_digest(stories_dir), nursery)
                await d_server.drain(0)  # after the route was chosen and checked: the open is refused
                decoded = await decode(ring, PROMPT, DecodeOptions(NEW))
                infos = ring.infos
            nursery.cancel_scope.cancel()
        return decoded, infos, spare.addr

    try:
        decoded, infos, spare_addr = trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    assert decoded.output_ids == reference_greedy(stories_dir, PROMPT, NEW, "float64")
    (event,) = decoded.heal_events
    assert event["reason"].startswith("draining"), event
    assert [i.addr for i in infos] == [spare_addr]


@pytest.mark.process
def test_the_heal_never_takes_the_draining_stage_back_from_records_read_before_it_drained(stories_dir, tmp_path):
    """Routed over the DHT: the records read at routing time still say the draining stage is online,
    and it claims the higher throughput, so the replacement search would pick it again (a fresh
    session may go back to the lost PeerId: a restarted volunteer). The probe's refusal excludes it."""
    from swarm.cli.launch import BootstrapNode
    from swarm.discovery.dht import open_dht
    from swarm.weights.identify import model_id
    from tests.support.ring import start_announced

    mid = model_id(stories_dir)

    async def main(boot):
        async with trio.open_nursery() as nursery:
            ready_d, d_server, _ = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "d.key", boot, mid,
                                                         throughput_tps=1000.0, dtype="float64")
            ready_s, _, _ = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "s.key", boot, mid,
                                                  throughput_tps=1.0, dtype="float64")
            spec = RingSpec(model=str(stories_dir), stages=(StageSpec(ready_d["addrs"][0], LayerRange(0, 5)),))
            async with open_host(load_or_create_key(tmp_path / "coord.key"), [LOOPBACK]) as host, \
                    open_dht(host, server=False, bootstrap=[boot]) as dht:
                ring = RingClient(host, spec, 30.0, 10.0, heartbeat_s=0.5, model_id=mid)
                with trio.fail_after(30):
                    while len(records := await dht.find_records(mid)) < 2:
                        await trio.sleep(0.2)
                ring.discovery = RouteContext(dht, mid, tuple(records))  # both "online"
                await ring.connect(5, model_manifest_digest(stories_dir), nursery)
                await d_server.drain(0)
                decoded = await decode(ring, PROMPT, DecodeOptions(NEW))
                infos = ring.infos
            nursery.cancel_scope.cancel()
        return decoded, infos, ready_s["peer_id"]

    with BootstrapNode(tmp_path / "boot.key") as boot:
        try:
            decoded, infos, spare_peer = trio.run(main, boot.addr)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    assert decoded.output_ids == reference_greedy(stories_dir, PROMPT, NEW, "float64")
    (event,) = decoded.heal_events
    assert event["reason"].startswith("draining") and event["attempts"] == 1, event
    assert [i.peer_id for i in infos] == [spare_peer]

"""A stage that begins to drain between routing and the session's open (found by bench/chaos.py):
it refuses the open ("draining") yet answers every probe. The heal must blame it and take a spare;
before, it found every stage answering, skipped, and the request failed."""

from __future__ import annotations

import pytest
import trio

from swarm.config import RingSpec
from swarm.coordinator.generation import DecodeOptions, decode
from swarm.coordinator.ring import RingClient
from swarm.errors import collapse
from swarm.model.resolve import model_manifest_digest
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

"""A stage restarted under the same key on a new port, to which the coordinator already holds a
connection (its DHT client talks to every DHT server): dialing the stage's OLD address "works" here
(libp2p reuses the connection to the PeerId), but the predecessor given that address as ``next``
cannot reach it. Found by bench/chaos.py with ``swarm serve``, whose records and ring are kept across
requests: "stage 1 [2, 3) refused: cannot reach successor ...", then no stage could be blamed and
the request failed with 503. The coordinator now hands on the address the stage says it listens at."""

from __future__ import annotations

import pytest
import trio

from swarm.config import RingSpec, StageSpec
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient
from swarm.errors import collapse
from swarm.model.resolve import model_manifest_digest
from swarm.transport import load_or_create_key, open_host
from swarm.wire import PROTOCOL_ID
from tests.support.models import reference_greedy
from tests.support.ring import LOOPBACK, start_stages

pytestmark = [pytest.mark.ring]

PROMPT = [1, 403, 407, 261, 378]
NEW = 10


def test_a_restarted_stage_reached_over_an_old_connection_is_handed_on_at_its_new_address(stories_dir, tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            ((head, _, _),) = await start_stages(nursery, stories_dir, [(0, 2)], tmp_path, "h")
            ((old, _, old_scope),) = await start_stages(nursery, stories_dir, [(2, 5)], tmp_path, "t")
            old_scope.cancel()  # the tail's process goes ...
            await trio.sleep(0.2)
            ((new, _, _),) = await start_stages(nursery, stories_dir, [(2, 5)], tmp_path, "t")  # ... and comes back
            assert new.addr != old.addr and new.peer_id == old.peer_id
            async with open_host(load_or_create_key(tmp_path / "coord.key"), [LOOPBACK]) as host:
                kept = await host.open_stream(new.addr, PROTOCOL_ID)  # e.g. the DHT client's connection
                spec = RingSpec(model=str(stories_dir), stages=(head, StageSpec(old.addr, old.layers)))
                ring = RingClient(host, spec, 30.0, 10.0, heartbeat_s=0.5)
                await ring.connect(5, model_manifest_digest(stories_dir), nursery)  # the old address "answers"
                decoded = await decode(ring, PROMPT, DecodeOptions(NEW, heal=False))
                addrs = [i.addr for i in ring.infos]
                await kept.aclose()
            nursery.cancel_scope.cancel()
        return decoded.output_ids, addrs, head.addr, new.addr

    try:
        out, addrs, head_addr, new_addr = trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    assert addrs == [head_addr, new_addr]
    assert out == reference_greedy(stories_dir, PROMPT, NEW, "float64")

"""Stages reachable only through a relay (issue 15), with real processes on loopback.

A ``swarm relay`` and three stories260k stages; the middle one holds a reservation on the relay
(``--relay``) and the ring file names it only by its circuit address, so every byte to and from
it (from the coordinator and from its predecessor) crosses the relay. The ids equal
transformers'. Then the relay is SIGKILLed mid-answer and restarted at the same address: the
middle stage reserves again at once, the coordinator heals onto the same stage through the new
relay (listed as its own spare), and the answer is still exact.
"""

from __future__ import annotations

import os
import signal
import socket

import pytest
import trio

from swarm.config import RingSpec, SpecConfig, StageSpec
from swarm.coordinator import decode
from swarm.launch import BootstrapNode, LocalRing
from swarm.model.resolve import model_manifest_digest
from swarm.ranges import LayerRange
from swarm.ring import RingClient
from swarm.transport import load_or_create_key, open_host
from tests.conftest import reference_greedy

pytestmark = pytest.mark.slow

RANGES = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
PROMPT = [1, 403, 407, 261, 378]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stage_reachable_only_through_a_relay_serves_exactly_and_survives_a_relay_restart(stories_dir, tmp_path):
    new = 24
    expected = reference_greedy(stories_dir, PROMPT, new, "float32")
    listen = f"/ip4/127.0.0.1/tcp/{_free_port()}"
    relay = BootstrapNode(tmp_path / "relay.key", role="relay", listen=listen).__enter__()
    relays = [relay]
    try:
        assert relay.ready["relay_protocol"] == "/libp2p/circuit/relay/0.2.0/hop"
        with LocalRing(str(stories_dir), RANGES, tmp_path / "keys", threads=1, extra_args=["--dtype", "float32"],
                       per_stage_args={1: ["--relay", relay.addr]}) as ring_procs:
            mid = ring_procs.stages[1]
            (circuit,) = mid.ready["relay_addrs"]
            assert circuit == f"{relay.addr}/p2p-circuit/p2p/{mid.ready['peer_id']}"
            stages = [StageSpec(ring_procs.stages[0].addr, RANGES[0]), StageSpec(circuit, RANGES[1]),
                      StageSpec(ring_procs.stages[2].addr, RANGES[2])]
            spec = RingSpec(model=str(stories_dir), stages=tuple(stages), spares=(StageSpec(circuit, RANGES[1]),))

            def restart_relay(out):
                if len(out) >= 8 and len(relays) == 1:
                    os.killpg(relays[0].proc.pid, signal.SIGKILL)
                    relays[0].proc.wait()
                    # same key, same port: the address the stage and the ring file hold
                    relays.append(BootstrapNode(tmp_path / "relay.key", role="relay", listen=listen).__enter__())

            async def main():
                with trio.fail_after(180):
                    return await _run()

            async def _run():
                async with open_host(load_or_create_key(tmp_path / "c.key")) as host, trio.open_nursery() as nursery:
                    client = RingClient(host, spec, hop_timeout_s=30.0, connect_timeout_s=10.0, heartbeat_s=0.5)
                    await client.connect(5, model_manifest_digest(stories_dir), nursery)
                    first, _ = await decode(client, PROMPT, new, set(), spec=SpecConfig())
                    again, rec = await decode(client, PROMPT, new, set(), on_ids=restart_relay, spec=SpecConfig())
                    infos = client.infos
                    nursery.cancel_scope.cancel()
                return first, again, rec, infos

            first, again, rec, infos = trio.run(main)
        assert first == expected  # through the relay, before any fault
        assert len(relays) == 2, "the relay was never restarted"
        assert again == expected
        events = rec["heal_events"]
        assert events and all(e["stage"] == 1 for e in events), events
        assert infos[1].peer_id == mid.ready["peer_id"] and infos[1].addr == circuit
    finally:
        for r in relays:
            r.__exit__()

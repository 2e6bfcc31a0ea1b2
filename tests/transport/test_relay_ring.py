"""Stages reachable only through a relay (issue 15), with real processes on loopback.

One ``swarm relay`` (at a fixed port, so it can be restarted at the same address) and four
stories260k stages: A [0, 2), B [2, 4) and B' [2, 4) holding reservations on the relay (B' with
``--no-hole-punch``), C [4, 5). Ring files name B or B' only by its circuit address.

- Through B' (no hole punching): every byte to and from it crosses the relay; the ids equal
  transformers'. The relay is SIGKILLed mid-answer and restarted at the same address: B' reserves
  again at once, the coordinator heals onto B' through the new relay (listed as its own spare),
  and the answer is still exact.
- Through B: DCUtR punches a direct connection (on loopback at once) and the hops move onto it
  at a frame boundary; then the relay is killed for good and the ring answers exactly without a
  heal: the relay is no longer in the data path. Runs last (it kills the relay).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import trio

from swarm.config import RingSpec, SpecConfig, StageSpec
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.errors import StageLost
from swarm.cli.launch import BootstrapNode, LocalRing
from swarm.model.resolve import model_manifest_digest
from swarm.ranges import LayerRange
from swarm.coordinator.ring import RingClient
from swarm.transport import load_or_create_key, open_host
from tests.support.models import reference_greedy
from tests.support.net import free_port

# serial: DCUtR moves a hop off the relay on its own timer (every 2 s), which the test waits out
pytestmark = [pytest.mark.slow, pytest.mark.ring, pytest.mark.process, pytest.mark.serial]

RANGES = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(2, 4), LayerRange(4, 5)]
PROMPT = [1, 403, 407, 261, 378]
NEW = 24



@pytest.fixture(scope="module")
def lab(stories_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("relay-lab")
    listen = f"/ip4/127.0.0.1/tcp/{free_port()}"
    relays = [BootstrapNode(root / "relay.key", role="relay", listen=listen).__enter__()]
    try:
        relay_addr = relays[0].addr
        per_stage = {1: ["--relay", relay_addr], 2: ["--relay", relay_addr, "--no-hole-punch"]}
        with LocalRing(str(stories_dir), RANGES, root / "keys", threads=1, extra_args=["--dtype", "float32"],
                       per_stage_args=per_stage) as ring:
            yield {"relays": relays, "listen": listen, "root": root, "stages": ring.stages,
                   "expected": reference_greedy(stories_dir, PROMPT, NEW, "float32")}
    finally:
        for r in relays:
            r.__exit__()


def _ring(stories_dir, stages, middle: int, spare: bool) -> tuple[RingSpec, str]:
    (circuit,) = stages[middle].ready["relay_addrs"]
    ring = (StageSpec(stages[0].addr, RANGES[0]), StageSpec(circuit, RANGES[middle]), StageSpec(stages[3].addr, RANGES[3]))
    spares = (StageSpec(circuit, RANGES[middle]),) if spare else ()
    return RingSpec(model=str(stories_dir), stages=ring, spares=spares), circuit


def test_through_a_relay_exact_and_a_relay_restart_heals(lab, stories_dir, tmp_path):
    stages, relays = lab["stages"], lab["relays"]
    mid = stages[2]
    spec, circuit = _ring(stories_dir, stages, 2, spare=True)
    assert circuit == f"{relays[0].addr}/p2p-circuit/p2p/{mid.ready['peer_id']}"

    def restart_relay(out):
        if len(out) >= 8 and len(relays) == 1:
            os.killpg(relays[0].proc.pid, signal.SIGKILL)
            relays[0].proc.wait()
            # same key, same port: the address the stage and the ring file hold
            relays.append(BootstrapNode(lab["root"] / "relay.key", role="relay", listen=lab["listen"]).__enter__())

    async def main():
        with trio.fail_after(180):
            async with open_host(load_or_create_key(tmp_path / "c.key"), hole_punch=False) as host, \
                    trio.open_nursery() as nursery:
                client = RingClient(host, spec, hop_timeout_s=30.0, connect_timeout_s=10.0, heartbeat_s=0.5)
                await client.connect(5, model_manifest_digest(stories_dir), nursery)
                first = (await decode(client, PROMPT, DecodeOptions(NEW, spec=SpecConfig()))).output_ids
                decoded = await decode(client, PROMPT, DecodeOptions(NEW, spec=SpecConfig()), on_ids=restart_relay)
                again, rec = decoded.output_ids, decoded.as_record()
                infos = client.infos
                nursery.cancel_scope.cancel()
        return first, again, rec, infos

    first, again, rec, infos = trio.run(main)
    assert first == lab["expected"]  # through the relay, before any fault
    assert len(relays) == 2, "the relay was never restarted"
    assert again == lab["expected"]
    events = rec["heal_events"]
    assert events and all(e["stage"] == 1 for e in events), events
    assert infos[1].peer_id == mid.ready["peer_id"] and infos[1].addr == circuit


def test_hops_move_onto_a_punched_connection_and_leave_the_relay(lab, stories_dir, tmp_path):
    stages, relays = lab["stages"], lab["relays"]
    spec, circuit = _ring(stories_dir, stages, 1, spare=False)

    async def main():
        with trio.fail_after(180):
            async with open_host(load_or_create_key(tmp_path / "c.key")) as host, trio.open_nursery() as nursery:
                end = time.monotonic() + 30
                while True:  # B reserves again on the relay the test before restarted (its retries back off
                    client = RingClient(host, spec, hop_timeout_s=30.0, connect_timeout_s=10.0, heartbeat_s=0.5)
                    start = time.monotonic()  # up to 10 s): until then its circuit is refused (no reservation)
                    try:
                        await client.connect(5, model_manifest_digest(stories_dir), nursery)
                        break
                    except StageLost as exc:
                        await client.aclose()
                        if "status 204" not in str(exc) or time.monotonic() > end:
                            raise
                        await trio.sleep(0.5)
                first = (await decode(client, PROMPT, DecodeOptions(NEW, spec=SpecConfig()))).output_ids
                link = client.links[1]
                while link.data.moves == 0 or link.control.moves == 0:
                    await trio.sleep(0.1)
                moved_s = time.monotonic() - start
                await trio.sleep(5.0)  # the stages' own hop (A -> B): DCUtR drives it every 2 s, then it moves
                os.killpg(relays[-1].proc.pid, signal.SIGKILL)  # the relay is gone for good
                relays[-1].proc.wait()
                decoded = await decode(client, PROMPT, DecodeOptions(NEW, spec=SpecConfig()))
                again, rec = decoded.output_ids, decoded.as_record()
                nursery.cancel_scope.cancel()
        return first, again, rec, moved_s

    first, again, rec, moved_s = trio.run(main)
    assert first == lab["expected"] and again == lab["expected"]
    assert rec["heal_events"] == []  # nothing crossed the dead relay
    assert moved_s < 15, moved_s

"""discovery/client.py: find_replacement over the records and RTTs read at routing time."""

from __future__ import annotations

import trio

from swarm.discovery.client import KNOWN_TRIES, find_replacement
from swarm.discovery.records import StageRecord

MODEL = "ab" * 32


def _rec(peer_id: str, layers, state: str = "online") -> StageRecord:
    return StageRecord(peer_id=peer_id, model_id=MODEL, model_name="m", num_layers=8, layers=layers,
                       addrs=(f"/ip4/10.0.0.1/tcp/1/p2p/{peer_id}",), state=state, throughput_tps=10.0)


class _DHT:
    """Answers probes from a table (None: the stage is gone) and counts DHT reads."""

    def __init__(self, rtt_ms: dict, records=()):
        self.table, self.records = rtt_ms, list(records)
        self.probed: list[str] = []
        self.reads = 0

    async def rtt_ms(self, addr: str, rounds: int = 3, timeout_s: float = 3.0):
        peer_id = addr.rsplit("/", 1)[-1]
        self.probed.append(peer_id)
        await trio.sleep(0)
        return self.table.get(peer_id)

    async def find_records(self, model_id: str, *, timeout_s: float = 5.0):
        self.reads += 1
        return self.records


KNOWN = [_rec("ring0", (0, 4)), _rec("ring1", (4, 8)), _rec("near", (4, 8)), _rec("far", (4, 8)),
         _rec("farther", (2, 8)), _rec("joining", (4, 8), state="joining")]
ROUTING_RTTS = {"ring0": 5.0, "ring1": 5.0, "near": 10.0, "far": 90.0, "farther": 200.0, "joining": 1.0}


def _heal(dht, **kw):
    async def main():
        return await find_replacement(dht, MODEL, (4, 8), prev_peer="ring0", next_peer=None,
                                      exclude=frozenset({"ring0", "ring1"}), known=KNOWN, **kw)
    return trio.run(main)


def test_a_heal_with_routing_time_rtts_probes_only_the_chain_it_plans():
    dht = _DHT({"near": 11.0, "far": 95.0, "farther": 210.0})
    (hop,) = _heal(dht, known_rtt_ms=ROUTING_RTTS)
    assert (hop.peer_id, hop.layers) == ("near", (4, 8))
    assert dht.probed == ["near"] and dht.reads == 0


def test_a_planned_stage_that_no_longer_answers_is_dropped_and_the_next_planned():
    dht = _DHT({"far": 95.0, "farther": 210.0})  # near left since the route was chosen
    (hop,) = _heal(dht, known_rtt_ms=ROUTING_RTTS)
    assert hop.peer_id == "far" and dht.probed == ["near", "far"] and dht.reads == 0


def test_after_known_tries_every_candidate_is_probed_as_without_rtts():
    gone = {f"gone{i}": 1.0 + i for i in range(KNOWN_TRIES)}
    known = [_rec(p, (4, 8)) for p in gone] + KNOWN
    dht = _DHT({"farther": 210.0})

    async def main():
        return await find_replacement(dht, MODEL, (4, 8), prev_peer="ring0", next_peer=None,
                                      exclude=frozenset({"ring0", "ring1"}), known=known,
                                      known_rtt_ms={**ROUTING_RTTS, **gone})
    (hop,) = trio.run(main)
    assert hop.peer_id == "farther"
    assert dht.probed[:KNOWN_TRIES] == list(gone)  # one planned chain a try, then the fan-out
    assert {"near", "far", "farther"} <= set(dht.probed[KNOWN_TRIES:])


def test_without_routing_time_rtts_every_candidate_is_probed():
    dht = _DHT({"near": 11.0, "far": 95.0, "farther": 210.0})
    (hop,) = _heal(dht)
    assert hop.peer_id == "near" and set(dht.probed) == {"near", "far", "farther"}

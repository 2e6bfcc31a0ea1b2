"""coordinator/measured.py, issue 45 item 17: the stage timings a client keeps between its sessions, and a
2-candidate swarm on loopback where a stage claiming 1e9 tok/s, slowed in-process, loses the route after
its first session."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest
import trio

from swarm.config import CoordinatorConfig, RingSpec
from swarm.coordinator import generation
from swarm.coordinator.measured import MEASURED_TTL_S, load_measured, note_session, record_measured
from swarm.errors import collapse
from swarm.weights.identify import model_id
from tests.support.models import reference_greedy
from tests.support.ring import start_announced

MID = "ab" * 32


def test_figures_round_trip_average_and_expire(tmp_path):
    path = tmp_path / "m.json"
    assert load_measured(MID, path=path) == {}  # no file: nothing measured
    assert record_measured(MID, {"p": 4.0}, now=100.0, path=path) == {"p": 4.0}
    assert record_measured(MID, {"p": 8.0, "q": 1.0}, now=200.0, path=path) == {"p": 6.0, "q": 1.0}  # halfway
    assert load_measured(MID, now=300.0, path=path) == {"p": 6.0, "q": 1.0}
    assert load_measured("cd" * 32, now=300.0, path=path) == {}  # per model
    assert load_measured(MID, now=200.0 + MEASURED_TTL_S, path=path) == {}  # expired
    assert record_measured(MID, {"p": 2.0}, now=200.0 + MEASURED_TTL_S, path=path) == {"p": 2.0}  # replaced


@pytest.mark.parametrize("text", ["", "{not json", "[]", json.dumps({MID: []}),
                                  json.dumps({MID: {"p": {"layer_ms": "fast", "at": 1}, "q": {"layer_ms": -1, "at": 1},
                                                    "r": {"layer_ms": 3.0, "at": 1}}})])
def test_a_torn_or_forged_file_measures_nothing_wrong(tmp_path, text):
    path = tmp_path / "m.json"
    path.write_text(text)
    got = load_measured(MID, now=2.0, path=path)
    assert got == ({"r": 3.0} if '"r"' in text else {})
    assert record_measured(MID, {"p": 5.0}, now=2.0, path=path)["p"] == 5.0


def _decoded(tokens: int, tokens_per_s: float, rounds: int, heal_events=()):
    return SimpleNamespace(output_ids=list(range(tokens)), tokens_per_s=tokens_per_s, spec={"rounds": rounds},
                           heal_events=list(heal_events))


def test_note_session_spreads_the_round_over_the_route(tmp_path):
    path = tmp_path / "m.json"
    hops = [("a", (0, 2)), ("b", (2, 5))]
    # 11 tokens at 10 tok/s: 1,000 ms over 10 rounds = 100 ms a round; network: 10/2 + 20/2 + 20/2 = 25 ms
    got = note_session(MID, hops, {"a": 10.0, "b": 20.0}, _decoded(11, 10.0, 10), path=path)
    assert got == pytest.approx({"a": 15.0, "b": 15.0})
    assert load_measured(MID, path=path) == pytest.approx({"a": 15.0, "b": 15.0})
    for decoded in (_decoded(11, 10.0, 1), _decoded(11, None, 10), _decoded(11, 10.0, 10, [{"stage": 0}])):
        assert note_session(MID, hops, {}, decoded, path=tmp_path / "n.json") == {}  # measures nothing
    assert not (tmp_path / "n.json").exists()


@pytest.mark.ring
@pytest.mark.process
def test_a_slowed_claimer_loses_the_route_after_its_first_session(stories_dir, tmp_path, monkeypatch, caplog):
    from swarm.cli.launch import BootstrapNode
    from swarm.discovery import client

    monkeypatch.setenv("SWARM_CACHE", str(tmp_path / "cache"))  # this client's measurements start empty
    mid = model_id(stories_dir)
    real = client.discover_ring
    routes: list[list[str]] = []

    async def discover(*args, **kwargs):
        found = await real(*args, **kwargs)
        routes.append([h.peer_id for h in found.route.hops])
        return found

    monkeypatch.setattr(client, "discover_ring", discover)

    async def main(boot):
        async with trio.open_nursery() as nursery:
            # the honest stage claims 20 tok/s (10 ms per layer) and is much faster; the cheat claims 1e9
            honest, _, _ = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "h.key", boot, mid,
                                                 throughput_tps=20.0)
            cheat, server, _ = await start_announced(nursery, stories_dir, (0, 5), tmp_path / "c.key", boot, mid,
                                                     throughput_tps=1e9)
            _slow_down(server.block, 0.15)  # 150 ms a forward: 30 ms per layer, 3x the honest stage's claim
            config = CoordinatorConfig(ring=RingSpec(model=str(stories_dir), stages=()), bootstrap=(boot,),
                                       max_new_tokens=12, key_path=tmp_path / "coord.key", receipt_dir=None)
            with trio.fail_after(180):
                while len(await _records(boot, tmp_path, mid)) < 2:
                    await trio.sleep(0.2)
                results = [await generation.generate(config, "Once upon a time") for _ in range(2)]
            nursery.cancel_scope.cancel()
        return results, honest["peer_id"], cheat["peer_id"]

    with caplog.at_level(logging.INFO), BootstrapNode(tmp_path / "boot.key") as boot:
        try:
            results, honest_peer, cheat_peer = trio.run(main, boot.addr)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    assert routes == [[cheat_peer], [honest_peer]]  # the claim won once, the measurement from then on
    assert [[e["peer_id"] for e in r["ring"]] for r in results] == [[cheat_peer], [honest_peer]]
    measured = load_measured(mid)
    assert measured[cheat_peer] > max(10.0, 3 * measured[honest_peer])  # slower than its rival and its claim
    assert any("route.overclaim" in r.getMessage() and cheat_peer in r.getMessage() for r in caplog.records)
    want = reference_greedy(stories_dir, results[0]["prompt_ids"], 12, "float32")
    assert [r["output_ids"] for r in results] == [want, want]


def _slow_down(block, seconds: float) -> None:
    """Every forward of ``block`` (decode and prefill paths) sleeps ``seconds`` first: a stage slowed in-process.
    The stage runs forwards in a worker thread, so the sleep holds that stage only."""
    for name in ("forward_batch", "forward_steps"):
        real = getattr(block, name)

        def slow(*args, _real=real, **kwargs):
            time.sleep(seconds)
            return _real(*args, **kwargs)

        setattr(block, name, slow)


async def _records(boot: str, tmp_path, mid: str) -> list:
    from swarm.discovery.dht import open_dht
    from swarm.transport import load_or_create_key, open_host

    async with open_host(load_or_create_key(tmp_path / "reader.key"), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_dht(host, server=False, bootstrap=[boot]) as dht:
        return await dht.find_records(mid)

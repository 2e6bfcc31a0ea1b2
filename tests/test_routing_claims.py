"""routing.py, issue 45 item 17: a record's throughput is a claim. Tables of a cheat (claiming 1e9 or 1,500
tok/s, or nothing) against an honest stage, measured or not, and the route each must give."""

from __future__ import annotations

import pytest

from swarm.errors import ConfigError
from swarm.routing import (Holder, attribute_round_ms, overclaimed, plan_replacement, plan_route, spares_for,
                           unmeasured_floor_ms)

RTT = {"cheat": 10.0, "honest": 10.0}  # the same way to both: compute alone decides
HONEST_TPS = 150.0  # over 4 layers: 1.667 ms per layer, which it delivers (measured 1.8 with overheads)
HONEST_MS, CHEAT_MS = 1.8, 18.0  # the cheat is slowed to a tenth of the honest stage's speed


def H(peer_id, layers, **kw):
    return Holder(peer_id, f"/memory/{peer_id}", layers, **kw)


def swarm(cheat_tps: float) -> list[Holder]:
    return [H("cheat", (0, 4), throughput_tps=cheat_tps), H("honest", (0, 4), throughput_tps=HONEST_TPS)]


@pytest.mark.parametrize("cheat_tps", [1e9, 1500.0, 0.0])
@pytest.mark.parametrize("measured, default_layer_ms, expected", [
    # the cheat measured (after its first session): the honest stage, unmeasured, is routed on its claim
    ({"cheat": CHEAT_MS}, 10.0, "honest"),
    # the honest stage measured: an unmeasured claim never beats it, however large (or a claim of nothing,
    # even where the default per-layer ms is below the honest stage's)
    ({"honest": HONEST_MS}, 10.0, "honest"),
    ({"honest": HONEST_MS}, 0.01, "honest"),
    # both measured: the measurements decide
    ({"cheat": CHEAT_MS, "honest": HONEST_MS}, 0.01, "honest"),
])
def test_measurements_beat_claims(cheat_tps, measured, default_layer_ms, expected):
    route = plan_route(swarm(cheat_tps), 4, client_rtt_ms=RTT, measured_layer_ms=measured,
                       default_layer_ms=default_layer_ms)
    assert [h.peer_id for h in route.hops] == [expected]


@pytest.mark.parametrize("cheat_tps, cost_ms", [
    # nothing measured: the cheat is tried once, but its claim counts no faster than the median claim / 4
    # (the honest 1.667 ms per layer / 4 over 4 layers = 1.667 ms), not as ~0 ms
    (1e9, 10.0 + 1000.0 / HONEST_TPS / 4),
    (1500.0, 10.0 + 1000.0 / HONEST_TPS / 4),
])
def test_an_unmeasured_claim_is_bounded_by_the_median_claim(cheat_tps, cost_ms):
    route = plan_route(swarm(cheat_tps), 4, client_rtt_ms=RTT)
    assert [h.peer_id for h in route.hops] == ["cheat"]
    assert route.cost_ms == pytest.approx(cost_ms)


def test_a_slowed_claimer_loses_the_route_once_measured():
    """The loop a client runs: route, measure the session, route again."""
    holders = swarm(1e9)
    first = plan_route(holders, 4, client_rtt_ms=RTT)
    measured = attribute_round_ms([(h.peer_id, h.layers) for h in first.hops], round_ms=20.0 + 4 * CHEAT_MS,
                                  network_ms=20.0)
    assert measured == {"cheat": pytest.approx(CHEAT_MS)}
    second = plan_route(holders, 4, client_rtt_ms=RTT, measured_layer_ms=measured)
    assert [h.peer_id for h in first.hops] == ["cheat"] and [h.peer_id for h in second.hops] == ["honest"]


def test_an_overclaimers_measurement_is_no_anchor():
    """A slowed liar measured first must not make the honest stage's claim count as slow as the liar."""
    holders = swarm(1e9) + [H("fair", (0, 4), throughput_tps=50.0)]  # 5 ms per layer, measured so
    assert overclaimed(holders[0], CHEAT_MS) and not overclaimed(holders[2], 5.0) and not overclaimed(holders[1], 1.8)
    assert not overclaimed(H("quiet", (0, 4)), 1000.0)  # a stage that claims nothing never overclaims
    # the median claim (the honest one's 1.667 ms per layer) / 4; with the fair stage measured: its 5 ms x 1.1
    assert unmeasured_floor_ms(holders, {"cheat": CHEAT_MS}) == pytest.approx(1000.0 / HONEST_TPS / 4 / 4)
    assert unmeasured_floor_ms(holders, {"cheat": CHEAT_MS, "fair": 5.0}) == pytest.approx(5.5)
    assert unmeasured_floor_ms([], {}) == 0.0
    # a stage that claims nothing, measured slow, is no anchor either
    assert unmeasured_floor_ms([H("quiet", (0, 4)), holders[1]], {"quiet": CHEAT_MS}) == pytest.approx(
        1000.0 / HONEST_TPS / 4 / 4)
    route = plan_route(holders, 4, client_rtt_ms={**RTT, "fair": 10.0}, measured_layer_ms={"cheat": CHEAT_MS})
    assert [h.peer_id for h in route.hops] == ["honest"]


def test_replacements_and_spares_believe_measurements_too():
    holders = swarm(1e9) + [H("head", (0, 2), throughput_tps=100.0), H("tail", (2, 4), throughput_tps=100.0)]
    kw = dict(client_rtt_ms={**RTT, "head": 10.0, "tail": 10.0}, measured_layer_ms={"cheat": CHEAT_MS})
    assert [h.peer_id for h in plan_replacement(holders, (0, 4), prev_peer=None, next_peer=None,
                                                exclude=frozenset(), **kw)] == ["honest"]
    route = plan_route(holders, 4, exclude=frozenset({"honest"}), **kw)  # head + tail: 2 hops beat the slow cheat
    assert [h.peer_id for h in route.hops] == ["head", "tail"]
    spares = spares_for(holders, route, **kw)
    assert [h.peer_id for h in spares[0]] == ["honest"] and [h.peer_id for h in spares[1]] == ["honest"]


@pytest.mark.parametrize("hops, round_ms, network_ms, expected", [
    ([("a", (0, 4))], 30.0, 10.0, {"a": 5.0}),
    ([("a", (0, 1)), ("b", (1, 4))], 30.0, 10.0, {"a": 5.0, "b": 5.0}),  # spread evenly over the route's layers
    ([("a", (0, 4))], 5.0, 10.0, {"a": 0.001}),  # faster than the RTT estimate: the smallest figure, never 0
])
def test_attribute_round_ms(hops, round_ms, network_ms, expected):
    assert attribute_round_ms(hops, round_ms, network_ms) == pytest.approx(expected)


@pytest.mark.parametrize("call, match", [
    (lambda: attribute_round_ms([], 1.0, 0.0), "none, or an empty"),
    (lambda: attribute_round_ms([("a", (2, 2))], 1.0, 0.0), "none, or an empty"),
    (lambda: attribute_round_ms([("a", (0, 2))], float("nan"), 0.0), "round_ms"),
    (lambda: attribute_round_ms([("a", (0, 2))], 1.0, -1.0), "network_ms"),
    (lambda: plan_route(swarm(1.0), 4, measured_layer_ms={"cheat": 0.0}), r"measured_layer_ms\[cheat\]"),
    (lambda: plan_route(swarm(1.0), 4, measured_layer_ms={"cheat": float("inf")}), r"measured_layer_ms\[cheat\]"),
])
def test_bad_measurements_are_refused(call, match):
    with pytest.raises(ConfigError, match=match):
        call()

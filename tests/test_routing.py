"""routing.py: tables of swarms and the route, spare or placement each must give; property tests
against a brute-force enumeration of every chain under the same cost model."""

from __future__ import annotations

import heapq
import random
import subprocess
import sys
from collections.abc import Mapping

import pytest
from hypothesis import given, settings, strategies as st

import swarm.routing as R
from swarm.errors import ConfigError
from swarm.routing import (Holder, Hop, NoRoute, Route, layer_capacity, plan_placement, plan_replacement, plan_route,
                           should_move, spares_for)


def H(peer_id, layers, **kw):
    return Holder(peer_id, f"/memory/{peer_id}", layers, **kw)


def hops(route_or_hops):
    chain = route_or_hops.hops if isinstance(route_or_hops, Route) else route_or_hops
    return [(h.peer_id, h.layers) for h in chain]


# ---- plan_route ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("holders,num_layers,kw,expected,cost_ms", [
    # single holder, nothing measured: 25 ms there + 4 layers x 10 ms + 25 ms back
    ([H("a", (0, 4))], 4, {}, [("a", (0, 4))], 90.0),
    # 5 overlapping holders: b (12.5 ms/layer) measured 2 ms to d; a is slower, c is far from b, e is slow
    ([H("a", (0, 4), throughput_tps=10), H("b", (0, 4), throughput_tps=20, rtt_ms={"c": 100, "d": 2}),
      H("c", (4, 8), throughput_tps=20), H("d", (4, 8), throughput_tps=20), H("e", (2, 8), throughput_tps=5)],
     8, {}, [("b", (0, 4)), ("d", (4, 8))], 25 + 50 + 1 + 50 + 25),
    # equal holders: the one 51 ms from the client loses to the one 1 ms away, despite its PeerId
    ([H("a", (0, 4)), H("b", (0, 4))], 4, {"client_rtt_ms": {"a": 51, "b": 1}}, [("b", (0, 4))], 0.5 + 40 + 0.5),
    # draining, joining and excluded holders are skipped however fast they are
    ([H("a", (0, 4), state="draining", throughput_tps=1000), H("b", (0, 4), state="joining", throughput_tps=1000),
      H("c", (0, 4), throughput_tps=1000), H("d", (0, 4), throughput_tps=1)],
     4, {"exclude": frozenset({"c"})}, [("d", (0, 4))], 25 + 1000 + 25),
    # KV: 1000 tokens x 100 B x 4 layers = 400000 B; a is one byte short, b has exactly enough
    ([H("a", (0, 4), throughput_tps=1000, free_kv_bytes=399_999, kv_bytes_per_token_layer=100),
      H("b", (0, 4), throughput_tps=1000, free_kv_bytes=400_000, kv_bytes_per_token_layer=100), H("c", (0, 4))],
     4, {"context_tokens": 1000}, [("b", (0, 4))], 25 + 1 + 25),
    ([H("a", (0, 4), throughput_tps=1000, free_kv_bytes=399_999, kv_bytes_per_token_layer=100), H("c", (0, 4))],
     4, {"context_tokens": 1000}, [("c", (0, 4))], 90.0),
    # unknown KV (free None, or 0 bytes per token) is no penalty
    ([H("a", (0, 4), throughput_tps=1000, free_kv_bytes=0), H("c", (0, 4))],
     4, {"context_tokens": 1000}, [("a", (0, 4))], 25 + 1 + 25),
    # sub-range hops: a [0, 3) at 10 ms/layer then b [2, 5) at 20 ms/layer (4 sessions): a serves its whole block
    ([H("a", (0, 3)), H("b", (2, 5), sessions=4)], 5, {}, [("a", (0, 3)), ("b", (3, 5))], 25 + 30 + 25 + 40 + 25),
    # ... and when a is the loaded one, b takes the shared layer 2
    ([H("a", (0, 3), sessions=4), H("b", (2, 5))], 5, {}, [("a", (0, 2)), ("b", (2, 5))], 25 + 40 + 25 + 30 + 25),
    # tie on cost: PeerIds in order
    ([H("b", (0, 4)), H("a", (0, 4))], 4, {}, [("a", (0, 4))], 90.0),
    # tie on cost (90 ms both): fewer hops wins over PeerId order
    ([H("z", (0, 4)), H("b", (0, 2), rtt_ms={"c": 0}), H("c", (2, 4))], 4, {}, [("z", (0, 4))], 90.0),
    # the link b -> c is known only from c's side (RTTs are symmetric)
    ([H("b", (0, 2)), H("c", (2, 4), rtt_ms={"b": 0}), H("z", (0, 4), sessions=1)], 4, {},
     [("b", (0, 2)), ("c", (2, 4))], 90.0),
    # defaults are parameters
    ([H("a", (0, 2))], 2, {"default_rtt_ms": 10, "default_layer_ms": 1}, [("a", (0, 2))], 12.0),
])
def test_plan_route(holders, num_layers, kw, expected, cost_ms):
    route = plan_route(holders, num_layers, **kw)
    assert hops(route) == expected
    assert route.cost_ms == pytest.approx(cost_ms)


def test_hop_carries_addr_and_block():
    route = plan_route([H("a", (0, 3)), H("b", (2, 5), sessions=4)], 5)
    assert route.hops[1] == Hop("b", "/memory/b", (3, 5), (2, 5))
    assert str(route) == "a [0, 3) -> b [3, 5) (145.0 ms)"


@pytest.mark.parametrize("holders,num_layers,kw,uncovered,message", [
    # a gap in the middle and at the end
    ([H("a", (0, 2)), H("b", (3, 5))], 7, {}, ((2, 3), (5, 7)), r"layers \[2, 3\), \[5, 7\): no online holder"),
    # a draining or joining holder does not close a gap
    ([H("a", (0, 2)), H("c", (2, 3), state="draining"), H("d", (2, 7), state="joining"), H("b", (3, 5))], 7, {},
     ((2, 3), (5, 7)), r"\[2, 3\), \[5, 7\)"),
    ([], 3, {}, ((0, 3),), r"\[0, 3\)"),
    ([H("a", (1, 3))], 3, {}, ((0, 1),), r"\[0, 1\)"),
    # covered, but only by an excluded holder
    ([H("a", (0, 4)), H("b", (0, 2))], 4, {"exclude": frozenset({"a"})}, ((2, 4),), r"\[2, 4\): only excluded"),
    ([H("a", (0, 1))], 2, {"exclude": frozenset({"a"})}, ((0, 2),),
     r"\[0, 2\): no online holder covers \[1, 2\), only"),
    # covered, but a has KV room for 1 of the 2 layers [2, 4) (1000 tokens x 100 B = 100000 B per layer)
    ([H("a", (0, 4), free_kv_bytes=100_000, kv_bytes_per_token_layer=100), H("b", (0, 2))], 4,
     {"context_tokens": 1000}, ((2, 4),), r"\[2, 4\): no holder there has free KV cache for 1000"),
    # each half fits a's KV room, the whole does not, and a cannot serve two consecutive hops
    ([H("a", (0, 4), free_kv_bytes=200_000, kv_bytes_per_token_layer=100), H("c", (2, 4), state="draining")], 4,
     {"context_tokens": 1000}, ((2, 4),), r"\[2, 4\): every chain"),
])
def test_no_route_names_the_uncovered_layers(holders, num_layers, kw, uncovered, message):
    with pytest.raises(NoRoute, match=message) as info:
        plan_route(holders, num_layers, **kw)
    assert info.value.uncovered == uncovered


@pytest.mark.parametrize("make,message", [
    (lambda: plan_route([H("a", (0, 4))], 0), "at least one layer"),
    (lambda: plan_route([H("a", (0, 5))], 4, ), r"\[0, 5\) is out of bounds.*4 layers"),
    (lambda: plan_route([H("a", (0, 4)), H("a", (0, 2))], 4), "two records for peer a"),
    (lambda: H("a", (2, 2)), "empty"),
    (lambda: H("a", (3, 1)), "empty"),
    (lambda: H("a", (-1, 2)), "negative"),
    (lambda: H("a", (0, 2), state="gone"), "state 'gone'"),
    (lambda: H("a", (0, 2), sessions=-1), "sessions"),
    (lambda: H("a", (0, 2), throughput_tps=float("nan")), "throughput_tps"),
    (lambda: H("a", (0, 2), rtt_ms={"b": -3}), r"rtt_ms\[b\]"),
])
def test_invalid_input_is_a_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_holder_is_frozen_and_hashable():
    h = H("a", [0, 2], rtt_ms={"b": 1})
    assert h.layers == (0, 2) and hash(h) == hash(H("a", (0, 2)))
    with pytest.raises(TypeError):
        h.rtt_ms["b"] = 5


# ---- plan_replacement and spares_for -------------------------------------------------------------------------

NEIGHBOURS = [H("p", (0, 4)), H("n", (8, 12)), H("dead", (4, 8), throughput_tps=1000)]


@pytest.mark.parametrize("holders,kw,expected", [
    # one holder of exactly the lost range beats a loaded bigger one; the dead peer is excluded
    (NEIGHBOURS + [H("s", (4, 8)), H("t", (0, 8), sessions=2)], {}, [("s", (4, 8))]),
    # a holder of a bigger block serves just the lost layers
    (NEIGHBOURS + [H("t", (0, 10))], {}, [("t", (4, 8))]),
    # a chain when no one holder covers it
    (NEIGHBOURS + [H("u", (4, 6)), H("v", (6, 8))], {}, [("u", (4, 6)), ("v", (6, 8))]),
    # the previous stage's measured RTT decides between equal holders
    ([H("p", (0, 4), rtt_ms={"s1": 80, "s2": 1}), H("n", (8, 12)), H("s1", (4, 8)), H("s2", (4, 8))], {},
     [("s2", (4, 8))]),
    # so does the next stage's (the link back is known only from its side)
    ([H("p", (0, 4)), H("n", (8, 12), rtt_ms={"s2": 1}), H("s1", (4, 8)), H("s2", (4, 8))], {}, [("s2", (4, 8))]),
    # the previous stage never serves the first hop (it would serve two consecutive hops)
    ([H("p", (0, 8)), H("n", (8, 12)), H("s", (4, 8), sessions=8)], {}, [("s", (4, 8))]),
    # KV room counts as in plan_route
    (NEIGHBOURS + [H("s", (4, 8), free_kv_bytes=10, kv_bytes_per_token_layer=1), H("t", (4, 8), sessions=3)],
     {"context_tokens": 5}, [("t", (4, 8))]),
])
def test_plan_replacement(holders, kw, expected):
    got = plan_replacement(holders, (4, 8), prev_peer="p", next_peer="n", exclude=frozenset({"dead"}), **kw)
    assert hops(got) == expected


@pytest.mark.parametrize("holders,prev_peer,next_peer,uncovered", [
    (NEIGHBOURS + [H("u", (4, 6))], "p", "n", ((6, 8),)),
    (NEIGHBOURS, "p", "n", ((4, 8),)),
    ([H("p", (0, 8)), H("n", (8, 12))], "p", "n", ((4, 8),)),  # only the previous stage holds it
    ([H("s", (4, 8)), H("n", (8, 12))], None, "s", ((4, 8),)),  # only the next stage holds it
])
def test_plan_replacement_no_route(holders, prev_peer, next_peer, uncovered):
    with pytest.raises(NoRoute) as info:
        plan_replacement(holders, (4, 8), prev_peer=prev_peer, next_peer=next_peer, exclude=frozenset({"dead"}))
    assert info.value.uncovered == uncovered


def test_plan_replacement_rejects_an_empty_range():
    with pytest.raises(ConfigError, match="empty"):
        plan_replacement(NEIGHBOURS, (4, 4), prev_peer=None, next_peer=None, exclude=frozenset())


SPARE_SWARM = [H("a", (0, 4), throughput_tps=100), H("b", (4, 8), throughput_tps=100), H("s", (0, 4)),
               H("t", (4, 6)), H("u", (6, 8)), H("x", (0, 8), state="draining")]


@pytest.mark.parametrize("holders,exclude,expected", [
    (SPARE_SWARM, frozenset(), {0: [("s", (0, 4))], 1: [("t", (4, 6)), ("u", (6, 8))]}),
    (SPARE_SWARM, frozenset({"s", "u"}), {0: [], 1: []}),
    (SPARE_SWARM[:2], frozenset(), {0: [], 1: []}),
])
def test_spares_for(holders, exclude, expected):
    route = plan_route(holders, 8)
    assert hops(route) == [("a", (0, 4)), ("b", (4, 8))]
    spares = spares_for(holders, route, exclude=exclude)
    assert {i: hops(chain) for i, chain in spares.items()} == expected


# ---- plan_placement and should_move --------------------------------------------------------------------------

@pytest.mark.parametrize("holders,num_layers,fit_layers,expected", [
    ([], 6, 2, (0, 2)),  # empty swarm
    ([H("a", (0, 2)), H("b", (4, 6))], 6, 2, (2, 4)),  # gap fill
    ([H("a", (0, 2)), H("b", (4, 6))], 6, 3, (1, 4)),  # min 0 everywhere near the gap: lowest total, then leftmost
    ([H("a", (0, 3), throughput_tps=10), H("b", (3, 6), throughput_tps=2)], 6, 3, (3, 6)),  # lowest throughput
    ([H("a", (0, 6), throughput_tps=5), H("b", (0, 3), throughput_tps=5)], 6, 2, (3, 5)),  # tie: leftmost
    ([H("a", (0, 4)), H("b", (1, 2), throughput_tps=2)], 4, 2, (2, 4)),  # capacity [1, 3, 1, 1]: lowest total
    ([H("a", (0, 2)), H("b", (2, 4), throughput_tps=0.5)], 4, 2, (2, 4)),  # unknown throughput counts 1.0
    ([H("a", (0, 2)), H("b", (2, 4), state="draining", throughput_tps=9)], 4, 2, (2, 4)),  # draining counts as gone
    ([H("a", (0, 2), state="joining")], 4, 2, (2, 4)),  # joining counts
    ([H("a", (0, 2)), H("b", (2, 4), state="joining", throughput_tps=5)], 4, 2, (0, 2)),
    ([H("a", (0, 3), throughput_tps=2), H("b", (1, 3))], 3, 1, (0, 1)),
    ([], 4, 10, (0, 4)),  # fit > L clamps
    ([H("a", (0, 4))], 4, 10, (0, 4)),
])
def test_plan_placement(holders, num_layers, fit_layers, expected):
    assert plan_placement(holders, num_layers, fit_layers) == expected


def test_a_joining_holder_counts_at_the_median_speed_over_its_width():
    # block speeds (tps x width): 10 x 2 = 20, 2 x 4 = 8, 30 x 2 = 60: median 20; the joining holder is 4 wide
    holders = [H("a", (0, 2), throughput_tps=10), H("b", (0, 4), throughput_tps=2), H("c", (4, 6), throughput_tps=30),
               H("j", (2, 6), state="joining"), H("d", (0, 6), state="draining", throughput_tps=1000)]
    assert layer_capacity(holders, 6) == [12.0, 12.0, 7.0, 7.0, 35.0, 35.0]
    # an online holder of unknown throughput still counts 1.0, and so does a joining one with no known speed
    assert layer_capacity([H("o", (0, 2)), H("j", (1, 3), state="joining")], 3) == [1.0, 2.0, 1.0]


def test_stages_joining_in_turn_with_joining_records_spread_over_the_layers():
    """Four equal stages of 2 layers join an 8-layer model one after another, each announcing its block as
    joining before the next chooses: they tile the model, where without the records they would all pick [0, 2)."""
    holders = [H("seed", (0, 8), throughput_tps=5)]
    chosen = []
    for i in range(4):
        window = plan_placement(holders, 8, 2)
        chosen.append(window)
        holders.append(H(f"j{i}", window, state="joining"))
    assert sorted(chosen) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert {plan_placement([H("seed", (0, 8), throughput_tps=5)], 8, 2) for _ in range(4)} == {(0, 2)}


@pytest.mark.parametrize("num_layers,fit_layers,message", [(0, 2, "at least one layer"), (4, 0, "at least one layer")])
def test_plan_placement_rejects(num_layers, fit_layers, message):
    with pytest.raises(ConfigError, match=message):
        plan_placement([], num_layers, fit_layers)


THREE_ON_FRONT = [H("me", (0, 4), throughput_tps=10), H("o1", (0, 4), throughput_tps=10),
                  H("o2", (0, 4), throughput_tps=10)]


@pytest.mark.parametrize("holders,kw,expected", [
    # leaving would uncover [2, 4): stay, however weak the back half is
    ([H("me", (0, 4), throughput_tps=10), H("o1", (0, 2), throughput_tps=10), H("o3", (4, 8), throughput_tps=1)],
     {}, None),
    # only a draining or joining holder would remain on my layers: that is a gap too
    ([H("me", (0, 4)), H("o1", (0, 4), state="draining"), H("o3", (4, 8), throughput_tps=1)], {}, None),
    ([H("me", (0, 4)), H("o1", (0, 4), state="joining"), H("o3", (4, 8), throughput_tps=1)], {}, None),
    # clearly better: my layers keep 20 tps without me, [4, 8) has 1 < 20 / 2
    (THREE_ON_FRONT + [H("o3", (4, 8), throughput_tps=1)], {}, (4, 8)),
    # marginal: 15 is not below 20 / 1.5 (the default gain) ...
    (THREE_ON_FRONT + [H("o3", (4, 8), throughput_tps=15)], {}, None),
    # 12 is (gain 2 kept a swarm of 1,000 simulated stages at 0.87 of its LP bound)
    (THREE_ON_FRONT + [H("o3", (4, 8), throughput_tps=12)], {}, (4, 8)),
    (THREE_ON_FRONT + [H("o3", (4, 8), throughput_tps=12)], {"gain": 2.0}, None),
    # ... but is below 20 / 1
    (THREE_ON_FRONT + [H("o3", (4, 8), throughput_tps=15)], {"gain": 1.0}, (4, 8)),
    # the weakest window is where I already am
    ([H("me", (0, 4)), H("o1", (0, 4), throughput_tps=1), H("o2", (4, 8), throughput_tps=10)], {}, None),
])
def test_should_move(holders, kw, expected):
    assert should_move(holders, "me", 8, 4, **kw) == expected


@pytest.mark.parametrize("me,gain,message", [("ghost", 2.0, "stage ghost has no record"), ("me", 0.0, "gain")])
def test_should_move_rejects(me, gain, message):
    with pytest.raises(ConfigError, match=message):
        should_move(THREE_ON_FRONT, me, 8, 4, gain=gain)


# ---- properties against a brute-force reference ------------------------------------------------------------

def ref_hop_ms(prev, h, a, b, client_rtt_ms, floor):
    """The cost model, written out again from the issue: one-way network + loaded compute."""
    rtt = client_rtt_ms.get(h.peer_id, 50.0)
    if prev is not None and h.peer_id in prev.rtt_ms:
        rtt = prev.rtt_ms[h.peer_id]
    elif prev is not None and prev.peer_id in h.rtt_ms:
        rtt = h.rtt_ms[prev.peer_id]
    per_layer = 1000 / h.throughput_tps / (h.layers[1] - h.layers[0]) if h.throughput_tps else 10.0
    return rtt / 2 + (b - a) * max(per_layer, floor) * (1 + 0.25 * h.sessions)


def claim_floor(holders):
    """Nothing measured: an unmeasured claim counts no faster than the median claim / 4 (issue 45 item 17)."""
    claims = sorted(1000 / h.throughput_tps / (h.layers[1] - h.layers[0]) for h in holders
                    if h.state == "online" and h.throughput_tps)
    return claims[len(claims) // 2] / 4 if claims else 0.0


def ref_best_cost(holders, num_layers, exclude, client_rtt_ms, context_tokens):
    """Minimum cost over every chain, by exhaustive search (None: no chain)."""
    cuts = sorted({0, num_layers} | {x for h in holders for x in h.layers})
    usable = [h for h in holders if h.state == "online" and h.peer_id not in exclude]
    best = None

    def walk(a, prev, cost):
        nonlocal best
        if a == num_layers:
            total = cost + client_rtt_ms.get(prev.peer_id, 50.0) / 2
            best = total if best is None else min(best, total)
            return
        for h in usable:
            if h.layers[0] <= a < h.layers[1] and h is not prev:
                for b in cuts:
                    need = context_tokens * h.kv_bytes_per_token_layer * (b - a)
                    fits = h.free_kv_bytes is None or h.free_kv_bytes >= need
                    if a < b <= h.layers[1] and fits:
                        walk(b, h, cost + ref_hop_ms(prev, h, a, b, client_rtt_ms, claim_floor(holders)))

    walk(0, None, 0.0)
    return best


def uncovered_layers(holders, lo, hi, exclude=frozenset()):
    held = {i for h in holders if h.state == "online" and h.peer_id not in exclude for i in range(*h.layers)}
    return [i for i in range(lo, hi) if i not in held]


@st.composite
def swarms(draw):
    num_layers = draw(st.integers(1, 8))
    ids = [f"p{i}" for i in range(draw(st.integers(0, 6)))]
    peer = st.sampled_from(ids + ["nobody"])  # records may name peers that have no record
    holders = []
    for peer_id in ids:
        start = draw(st.integers(0, num_layers - 1))
        holders.append(H(peer_id, (start, draw(st.integers(start + 1, num_layers))),
                         state=draw(st.sampled_from(["online", "online", "online", "joining", "draining"])),
                         throughput_tps=draw(st.sampled_from([0.0, 1.0, 5.0, 40.0])),
                         sessions=draw(st.integers(0, 3)),
                         free_kv_bytes=draw(st.none() | st.integers(0, 40)),
                         kv_bytes_per_token_layer=draw(st.integers(0, 2)),
                         rtt_ms=draw(st.dictionaries(peer, st.sampled_from([0.0, 1.0, 20.0, 120.0]), max_size=3))))
    exclude = frozenset(draw(st.sets(peer, max_size=2)))
    client_rtt_ms = draw(st.dictionaries(peer, st.sampled_from([1.0, 30.0, 200.0]), max_size=4))
    return holders, num_layers, exclude, client_rtt_ms, draw(st.integers(0, 6))


@settings(max_examples=150, deadline=None)
@given(swarms())
def test_route_tiles_uses_only_usable_holders_and_is_cheapest(swarm):
    holders, num_layers, exclude, client_rtt_ms, context_tokens = swarm
    best = ref_best_cost(holders, num_layers, exclude, client_rtt_ms, context_tokens)
    try:
        route = plan_route(holders, num_layers, client_rtt_ms=client_rtt_ms, context_tokens=context_tokens,
                           exclude=exclude)
    except NoRoute as exc:
        assert best is None
        assert exc.uncovered and all(0 <= a < b <= num_layers for a, b in exc.uncovered)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(exc.uncovered, exc.uncovered[1:]))  # ordered, disjoint
        missing = uncovered_layers(holders, 0, num_layers, exclude)
        if missing:  # a real gap is reported exactly, layer for layer
            assert [i for a, b in exc.uncovered for i in range(a, b)] == missing
        return
    by_id = {h.peer_id: h for h in holders}
    at, prev, cost = 0, None, 0.0
    for hop in route.hops:
        h = by_id[hop.peer_id]
        assert hop.layers[0] == at < hop.layers[1]  # tiles [0, L) in order
        assert h.layers[0] <= hop.layers[0] and hop.layers[1] <= h.layers[1] and hop.holder_layers == h.layers
        assert h.state == "online" and h.peer_id not in exclude and h is not prev
        cost += ref_hop_ms(prev, h, *hop.layers, client_rtt_ms, claim_floor(holders))
        at, prev = hop.layers[1], h
    assert at == num_layers
    assert route.cost_ms == pytest.approx(cost + client_rtt_ms.get(prev.peer_id, 50.0) / 2)
    assert route.cost_ms == pytest.approx(best)


@settings(max_examples=100, deadline=None)
@given(swarms(), st.data())
def test_replacement_tiles_the_lost_range(swarm, data):
    holders, num_layers, exclude, client_rtt_ms, context_tokens = swarm
    lo = data.draw(st.integers(0, num_layers - 1))
    lost = (lo, data.draw(st.integers(lo + 1, num_layers)))
    ends = st.none() | st.sampled_from([h.peer_id for h in holders] + ["nobody"])
    prev_peer, next_peer = data.draw(ends), data.draw(ends)
    try:
        chain = plan_replacement(holders, lost, prev_peer=prev_peer, next_peer=next_peer, exclude=exclude,
                                 client_rtt_ms=client_rtt_ms, context_tokens=context_tokens)
    except NoRoute as exc:
        assert exc.uncovered and all(lost[0] <= a < b <= lost[1] for a, b in exc.uncovered)
        return
    assert chain[0].layers[0] == lost[0] and chain[-1].layers[1] == lost[1]
    assert all(x.layers[1] == y.layers[0] for x, y in zip(chain, chain[1:]))
    assert all(h.holder_layers[0] <= h.layers[0] < h.layers[1] <= h.holder_layers[1] for h in chain)
    assert chain[0].peer_id != prev_peer and chain[-1].peer_id != next_peer
    assert not {h.peer_id for h in chain} & exclude


@settings(max_examples=100, deadline=None)
@given(swarms(), st.integers(1, 10))
def test_placement_takes_a_weakest_window(swarm, fit_layers):
    holders, num_layers = swarm[0], swarm[1]
    start, end = plan_placement(holders, num_layers, fit_layers)
    width = min(fit_layers, num_layers)
    assert 0 <= start and end <= num_layers and end - start == width
    speeds = sorted(h.throughput_tps * (h.layers[1] - h.layers[0]) for h in holders
                    if h.state != "draining" and h.throughput_tps)
    median = speeds[len(speeds) // 2] if speeds else 0.0

    def tps(h):  # a joining holder has not measured: the median speed over its width
        if h.throughput_tps or h.state != "joining" or not median:
            return h.throughput_tps or 1.0
        return median / (h.layers[1] - h.layers[0])

    capacity = [sum(tps(h) for h in holders if h.state != "draining" and h.layers[0] <= i < h.layers[1])
                for i in range(num_layers)]
    assert min(capacity[start:end]) == min(min(capacity[s:s + width]) for s in range(num_layers - width + 1))


@pytest.mark.process
def test_routing_imports_no_torch_trio_or_libp2p():
    code = "import sys, swarm.routing; bad = [m for m in ('torch', 'trio', 'libp2p') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- the boundary DP against the Dijkstra it replaced (issue 31) -------------------------------------------------

def dijkstra_reference(by_id: Mapping[str, Holder], lo: int, hi: int, prev_peer: str | None, next_peer: str | None,
                    exclude: frozenset[str], model: R._CostModel) -> tuple[float, tuple[Hop, ...]] | None:
    """Dijkstra over states (layer boundary, previous hop's peer) from ``lo`` after ``prev_peer`` to
    ``hi`` before ``next_peer`` (None: the client). Ties: fewer hops, then PeerIds in order, then
    earlier boundaries. A peer never serves two consecutive hops (one longer hop is the same work).

    The planner before issue 31 (10 s of CPU at 1,000 holders), kept as the reference: None where no chain exists.
    """
    usable = sorted((h for h in by_id.values() if h.state == "online" and h.peer_id not in exclude
                     and h.layers[0] < hi and h.layers[1] > lo), key=lambda h: h.peer_id)
    cuts = sorted({lo, hi} | {x for h in by_id.values() for x in h.layers if lo < x < hi})
    # hops that may start at each boundary: holder -> [(end boundary, compute ms)], whatever came before
    hops_from: dict[int, list[tuple[Holder, list[tuple[int, float]]]]] = {a: [] for a in cuts}
    for h in usable:
        layer_ms = model.layer_ms(h)
        for i, a in enumerate(cuts):
            if h.layers[0] <= a < h.layers[1]:
                ends = [(b, (b - a) * layer_ms) for b in cuts[i + 1:]
                        if b <= h.layers[1] and model.kv_fits(h, b - a)]
                if ends:
                    hops_from[a].append((h, ends))
    # A state is (boundary, previous peer, arrived): arrived means back at next_peer after hi.
    # A path's key is (cost_ms, hops, peer ids, hop ends): the order of the heap and of ties.
    start = (lo, prev_peer, False)
    best: dict = {start: (0.0, 0, (), ())}
    heap: list = [(0.0, 0, (), ()) + start]
    settled: set = set()
    reached = lo

    def relax(key: tuple, state: tuple) -> None:
        old = best.get(state)
        if old is None or key < old:
            best[state] = key
            heapq.heappush(heap, key + state)

    while heap:
        entry = heapq.heappop(heap)
        key, state = entry[:4], entry[4:]
        if state in settled or best[state] != key:
            continue  # a stale entry: a cheaper path to this state was pushed later
        settled.add(state)
        cost, n, ids, ends = key
        a, prev, arrived = state
        if arrived:
            starts = (lo,) + ends[:-1]
            return cost, tuple(Hop(p, by_id[p].addr, (s, e), by_id[p].layers) for p, s, e in zip(ids, starts, ends))
        if a == hi:
            last = by_id[prev]
            if last.peer_id != next_peer:
                back = model.rtt_ms(next_peer, by_id.get(next_peer), last) / 2
                relax((cost + back, n, ids, ends), (hi, prev, True))
            continue
        reached = max(reached, a)  # the furthest boundary a chain could go on from
        prev_holder = by_id.get(prev) if prev is not None else None
        for h, hop_ends in hops_from[a]:
            if h.peer_id == prev:
                continue
            enter_ms = cost + model.rtt_ms(prev, prev_holder, h) / 2
            for b, compute_ms in hop_ends:
                new_cost = enter_ms + compute_ms
                old = best.get((b, h.peer_id, False))
                if old is None or new_cost <= old[0]:
                    relax((new_cost, n + 1, ids + (h.peer_id,), ends + (b,)), (b, h.peer_id, False))
    return None


def random_swarm(rng, n, num_layers, measured):
    """n holders with random blocks, speeds, loads, KV room and ``measured`` RTTs each to random others."""
    ids = [f"q{i:04d}" for i in range(n)]
    holders = []
    for peer_id in ids:
        width = rng.randint(1, max(1, num_layers // 3))
        start = rng.randint(0, num_layers - width)
        holders.append(H(peer_id, (start, start + width), state=rng.choice(["online"] * 8 + ["joining", "draining"]),
                         throughput_tps=rng.choice([0.0, rng.uniform(1, 200)]), sessions=rng.randint(0, 3),
                         free_kv_bytes=rng.choice([None, None, rng.randint(0, 4000)]),
                         kv_bytes_per_token_layer=rng.randint(0, 3),
                         rtt_ms={p: rng.uniform(1, 250) for p in rng.sample(ids, min(n, measured))}))
    client_rtt_ms = {p: rng.uniform(5, 300) for p in rng.sample(ids, n * 3 // 4)}
    return holders, client_rtt_ms


@pytest.mark.parametrize("seed", range(40))
def test_the_boundary_dp_chooses_what_dijkstra_chose(seed):
    rng = random.Random(seed)
    num_layers = rng.choice([4, 12, 30])
    holders, client_rtt_ms = random_swarm(rng, rng.choice([3, 10, 40]), num_layers, rng.choice([0, 2, 5]))
    exclude = frozenset(rng.sample([h.peer_id for h in holders], 1))
    context_tokens = rng.choice([0, 100, 1000])
    by_id = {h.peer_id: h for h in holders}
    model = R._CostModel(client_rtt_ms, context_tokens, 50.0, 10.0)
    lo = rng.randint(0, num_layers - 1)
    hi = rng.randint(lo + 1, num_layers)
    ends = [None] + [h.peer_id for h in holders]
    for lo, hi, prev_peer, next_peer in [(0, num_layers, None, None), (lo, hi, rng.choice(ends), rng.choice(ends))]:
        want = dijkstra_reference(by_id, lo, hi, prev_peer, next_peer, exclude, model)
        if want is None:
            with pytest.raises(NoRoute):
                R._cheapest_chain(by_id, lo, hi, prev_peer, next_peer, exclude, model)
            continue
        got = R._cheapest_chain(by_id, lo, hi, prev_peer, next_peer, exclude, model)
        assert got[1] == want[1]  # the same hops, ties broken the same way
        assert got[0] == pytest.approx(want[0])


def test_route_planning_work_grows_with_holders_not_their_square(monkeypatch):
    """1,000 holders over 80 layers, each with 10 measured RTTs: the DP asks the cost model for a few
    RTTs per (holder, boundary), where the Dijkstra asked for one per (state, holder) pair (millions)."""
    calls = []
    rtt_ms = R._CostModel.rtt_ms
    monkeypatch.setattr(R._CostModel, "rtt_ms", lambda self, *a: calls.append(1) or rtt_ms(self, *a))

    def evaluations(n):
        calls.clear()
        holders, client_rtt_ms = random_swarm(random.Random(n), n, 80, 10)
        plan_route(holders + [H("backbone", (0, 80))], 80, client_rtt_ms=client_rtt_ms)  # every layer covered
        return len(calls)

    small, large = evaluations(100), evaluations(1000)  # seen: 3,454 and 45,558
    assert large < 60 * 1000  # about 60 per holder at most: its boundaries x (1 + its measured pairs there)
    assert large < 20 * small  # 10x the holders: about 13x the work (more measured pairs meet), not 100x

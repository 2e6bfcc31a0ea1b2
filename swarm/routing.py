"""Route, spare and placement decisions for a self-organizing swarm. Pure: standard library only.

Owns: ``plan_route`` (the chain of stages a client uses), ``plan_replacement`` and ``spares_for`` (what replaces
a lost layer range), ``plan_placement`` and ``should_move`` (a stage's block), over ``Holder``s that carry every
measurement as data. The rules and their source: docs/architecture.md, "The self-organizing swarm".
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from swarm.errors import ConfigError, SwarmError

HOLDER_STATES = ("joining", "online", "draining")
LOAD_PENALTY_PER_SESSION = 0.25  # each open session slows a stage's compute by a quarter (a queueing guess)
# A record's throughput_tps is a claim: a stage may announce any number (issue 45 item 17: one announcing
# 1e9 tok/s, or only 1,500, took 10 of 10 routes while 10x slower than the honest stage). Routing believes
# what the client measured itself, and bounds every claim it has not measured:
CLAIM_SPREAD = 4.0  # an unmeasured claim counts at most this many times faster than the median claim
UNMEASURED_MARGIN = 1.1  # ... and at least this much slower than the fastest credible stage the client measured
OVERCLAIM_FACTOR = 4.0  # a stage measured this many times slower than it claims is an overclaimer (no anchor)
_NO_RTT: Mapping[str, float] = MappingProxyType({})

Span = tuple[int, int]


def format_ranges(ranges: Iterable[Span]) -> str:
    """Layer ranges as ``[a, b), [c, d)``."""
    return ", ".join(f"[{a}, {b})" for a, b in ranges)


class NoRoute(SwarmError):
    """No chain of online, non-excluded holders can serve the layers asked for.

    Attributes:
        uncovered: the layer ranges ``[a, b)`` that block every route, in layer order: layers no
            usable holder covers, or, when they are covered, the ones where exclusion or a lack
            of free KV cache leaves no holder that may serve them.
    """

    def __init__(self, uncovered: Iterable[Span], reason: str) -> None:
        self.uncovered: tuple[Span, ...] = tuple(uncovered)
        super().__init__(f"no route covers layers {format_ranges(self.uncovered)}: {reason}")


@dataclass(frozen=True)
class Holder:
    """One stage as its DHT record describes it.

    Args:
        peer_id: PeerId string. addr: multiaddr, opaque here.
        layers: half-open block ``[start, end)`` of decoder layers it holds.
        state: "joining" | "online" | "draining"; only "online" holders serve hops.
        throughput_tps: decode steps/s it measured over its whole block at start (0: unknown).
        sessions: sessions open on it now.
        free_kv_bytes: KV cache bytes it can still give a session (None: unknown, no check).
        kv_bytes_per_token_layer: KV bytes one token costs in one of its layers (0: unknown).
        rtt_ms: round trips it measured to other peers, PeerId -> ms.
    Raises:
        ConfigError: an empty or negative block, an unknown state, or a negative or non-finite number.
    """

    peer_id: str
    addr: str
    layers: Span
    state: str = "online"
    throughput_tps: float = 0.0
    sessions: int = 0
    free_kv_bytes: int | None = None
    kv_bytes_per_token_layer: int = 0
    rtt_ms: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if (len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
                or layers[0] < 0 or layers[1] <= layers[0]):
            raise ConfigError(f"holder {self.peer_id}: layer range {self.layers!r} is empty, negative or not "
                              "two integers")
        if self.state not in HOLDER_STATES:
            raise ConfigError(f"holder {self.peer_id}: state {self.state!r} is not one of {', '.join(HOLDER_STATES)}")
        numbers = {"throughput_tps": self.throughput_tps, "sessions": self.sessions,
                   "kv_bytes_per_token_layer": self.kv_bytes_per_token_layer,
                   **({} if self.free_kv_bytes is None else {"free_kv_bytes": self.free_kv_bytes}),
                   **{f"rtt_ms[{p}]": v for p, v in dict(self.rtt_ms).items()}}
        for name, value in numbers.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"holder {self.peer_id}: {name} = {value!r} is not a finite number >= 0")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "rtt_ms", MappingProxyType(dict(self.rtt_ms)))


@dataclass(frozen=True)
class Hop:
    """One stage of a route: ``peer_id`` runs ``layers``, a sub-range of its block ``holder_layers``."""

    peer_id: str
    addr: str
    layers: Span
    holder_layers: Span


@dataclass(frozen=True)
class Route:
    """A chain of hops tiling ``[0, L)`` in order, and its expected per-token latency ``cost_ms``
    (client -> every hop -> client)."""

    hops: tuple[Hop, ...]
    cost_ms: float

    def __str__(self) -> str:
        chain = " -> ".join(f"{h.peer_id} [{h.layers[0]}, {h.layers[1]})" for h in self.hops)
        return f"{chain} ({self.cost_ms:.1f} ms)"


def claimed_layer_ms(h: Holder) -> float | None:
    """Compute ms per layer per decode step that ``h``'s record claims (None: it claims nothing, 0)."""
    return 1000.0 / h.throughput_tps / (h.layers[1] - h.layers[0]) if h.throughput_tps > 0 else None


def overclaimed(h: Holder, measured_ms: float) -> bool:
    """Whether ``measured_ms`` (per layer, as the client measured ``h``) is over ``OVERCLAIM_FACTOR`` times
    what ``h`` claims. A stage that claims nothing never overclaims."""
    claim = claimed_layer_ms(h)
    return claim is not None and measured_ms > OVERCLAIM_FACTOR * claim


def unmeasured_floor_ms(holders: Iterable[Holder], measured_layer_ms: Mapping[str, float]) -> float:
    """The fewest ms per layer an unmeasured stage is charged, whatever it claims.

    The larger of: the median claim (the slower one of two middle values, so one liar of two does
    not set it) / ``CLAIM_SPREAD``, over the online holders that claim a throughput; and the fastest
    per-layer ms the client measured on one of ``holders`` that delivered its claim (measured within
    ``OVERCLAIM_FACTOR`` of it), times ``UNMEASURED_MARGIN`` (an unverified claim never beats a verified
    stage). A stage that overclaimed, or claimed nothing, is no anchor: a slowed liar measured first
    must not make honest claims count as slow as it is. The price: a stage faster than every credible
    one measured is not tried by this client until those measurements expire.

    Args:
        holders: the records. measured_layer_ms: the client's measurements, PeerId -> ms per layer.
    Returns:
        ms per layer per decode step; 0.0 when nothing bounds the claims.
    """
    holders = list(holders)
    claims = sorted(ms for h in holders if h.state == "online" and (ms := claimed_layer_ms(h)) is not None)
    by_claims = claims[len(claims) // 2] / CLAIM_SPREAD if claims else 0.0
    credible = [measured_layer_ms[h.peer_id] for h in holders if h.peer_id in measured_layer_ms
                and claimed_layer_ms(h) is not None and not overclaimed(h, measured_layer_ms[h.peer_id])]
    by_measured = min(credible) * UNMEASURED_MARGIN if credible else 0.0
    return max(by_claims, by_measured)


def attribute_round_ms(hops: Sequence[tuple[str, Span]], round_ms: float, network_ms: float) -> dict[str, float]:
    """Per-layer ms of each hop's peer from one whole-route timing.

    The ring reports no per-hop timing the client could check, so a round's compute time (its wall
    time less the network's share) is spread evenly over the route's layers: every hop of a route is
    charged the route's mean ms per layer. A slow stage also slows its route's other hops' figures;
    a later route without it clears them.

    Args:
        hops: ``(PeerId, [start, end))`` of each hop, in ring order.
        round_ms: wall ms of one decode round around the route (decode time / rounds).
        network_ms: the part of ``round_ms`` spent on the wire (the client's RTT estimates).
    Returns:
        PeerId -> ms per layer per decode step (>= 0.001).
    Raises:
        ConfigError: no hops, an empty hop, or a negative or non-finite time.
    """
    layers = sum(e - s for _, (s, e) in hops)
    if not hops or any(e <= s for _, (s, e) in hops):
        raise ConfigError(f"cannot attribute a round to hops {list(hops)!r}: none, or an empty layer range")
    for name, value in (("round_ms", round_ms), ("network_ms", network_ms)):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name} = {value!r} is not a finite number >= 0")
    per_layer = max(round_ms - network_ms, 0.0) / layers
    return {peer: max(per_layer, 0.001) for peer, _ in hops}


@dataclass(frozen=True)
class _CostModel:
    client_rtt_ms: Mapping[str, float]
    context_tokens: int
    default_rtt_ms: float
    default_layer_ms: float
    measured_layer_ms: Mapping[str, float] = field(default_factory=lambda: _NO_RTT)
    floor_ms: float = 0.0  # ``unmeasured_floor_ms``

    def rtt_ms(self, peer_id: str | None, peer: Holder | None, cand: Holder) -> float:
        """Round trip between ``cand`` and ``peer_id`` (None: the client): what ``peer`` measured to
        ``cand``, else what ``cand`` measured to it, else the client's RTT to ``cand``, else the default."""
        if peer_id is not None:
            if peer is not None and cand.peer_id in peer.rtt_ms:
                return peer.rtt_ms[cand.peer_id]
            if peer_id in cand.rtt_ms:
                return cand.rtt_ms[peer_id]
        return self.client_rtt_ms.get(cand.peer_id, self.default_rtt_ms)

    def layer_ms(self, h: Holder) -> float:
        """Compute ms per layer per decode step on ``h``, with its load penalty: what the client measured
        on it, else its claim (or ``default_layer_ms`` without one) no lower than ``floor_ms``."""
        base = self.measured_layer_ms.get(h.peer_id)
        if base is None:
            claim = claimed_layer_ms(h)
            base = max(self.default_layer_ms if claim is None else claim, self.floor_ms)
        return base * (1.0 + LOAD_PENALTY_PER_SESSION * h.sessions)

    def kv_fits(self, h: Holder, num_layers: int) -> bool:
        """Whether ``h`` has free KV cache for the context over ``num_layers`` of its layers."""
        need = self.context_tokens * h.kv_bytes_per_token_layer * num_layers
        return h.free_kv_bytes is None or h.free_kv_bytes >= need


def _check_holders(holders: Sequence[Holder], num_layers: int | None) -> dict[str, Holder]:
    by_id: dict[str, Holder] = {}
    for h in holders:
        if h.peer_id in by_id:
            raise ConfigError(f"two records for peer {h.peer_id}: {format_ranges([by_id[h.peer_id].layers])} "
                              f"and {format_ranges([h.layers])}")
        if num_layers is not None and h.layers[1] > num_layers:
            raise ConfigError(f"holder {h.peer_id}: layer range {format_ranges([h.layers])} is out of bounds: "
                              f"the model has {num_layers} layers [0, {num_layers})")
        by_id[h.peer_id] = h
    return by_id


def _cost_model(by_id: Mapping[str, Holder], client_rtt_ms: Mapping[str, float], context_tokens: int,
                default_rtt_ms: float, default_layer_ms: float, measured_layer_ms: Mapping[str, float]) -> _CostModel:
    for peer, ms in measured_layer_ms.items():
        if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            raise ConfigError(f"measured_layer_ms[{peer}] = {ms!r} is not a finite number > 0")
    measured = MappingProxyType(dict(measured_layer_ms))
    return _CostModel(client_rtt_ms, context_tokens, default_rtt_ms, default_layer_ms, measured,
                      unmeasured_floor_ms(by_id.values(), measured))


def _gaps(spans: Iterable[Span], lo: int, hi: int) -> list[Span]:
    """The parts of ``[lo, hi)`` that no span covers, in order."""
    gaps, at = [], lo
    for s, e in sorted(spans):
        if at >= hi:
            break
        if s > at:
            gaps.append((at, min(s, hi)))
        at = max(at, e)
    if at < hi:
        gaps.append((at, hi))
    return gaps


def _merge(spans: Iterable[Span]) -> list[Span]:
    out: list[Span] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _cheapest_chain(by_id: Mapping[str, Holder], lo: int, hi: int, prev_peer: str | None, next_peer: str | None,
                    exclude: frozenset[str], model: _CostModel) -> tuple[float, tuple[Hop, ...]]:
    """The cheapest chain from ``lo`` after ``prev_peer`` to ``hi`` before ``next_peer`` (None: the client).

    Shortest path over states (layer boundary, previous hop's peer). Every hop moves to a higher
    boundary, so the states are settled boundary by boundary, lowest first (a DP over the layer
    boundaries; the same optimum as Dijkstra, which this replaced: issue 31 measured 10 s of CPU
    at 1,000 holders). A hop's RTT from the previous peer is the measured pair's where one of the
    two measured the other, else the client's RTT to the new hop, the same for every previous
    peer: so only the cheapest eligible state at a boundary, plus the few with a measured pair,
    can lead into a holder there. Work is O(holders x boundaries in their blocks x measured pairs),
    not O(holders^2 x boundaries). Ties: fewer hops, then PeerIds in order, then earlier boundaries.
    A peer never serves two consecutive hops (one longer hop is the same work).

    Raises:
        NoRoute: naming the layers that block every chain.
    """
    usable = sorted((h for h in by_id.values() if h.state == "online" and h.peer_id not in exclude
                     and h.layers[0] < hi and h.layers[1] > lo), key=lambda h: h.peer_id)
    cuts = sorted({lo, hi} | {x for h in by_id.values() for x in h.layers if lo < x < hi})
    # hops that may start at each boundary: holder -> [(end boundary, compute ms)], whatever came before
    hops_from: dict[int, list[tuple[Holder, list[tuple[int, float]]]]] = {a: [] for a in cuts}
    for h in usable:
        layer_ms = model.layer_ms(h)
        last = bisect.bisect_right(cuts, h.layers[1])
        for i in range(bisect.bisect_left(cuts, h.layers[0]), bisect.bisect_left(cuts, h.layers[1])):
            a = cuts[i]
            ends = [(b, (b - a) * layer_ms) for b in cuts[i + 1:last] if model.kv_fits(h, b - a)]
            if ends:
                hops_from[a].append((h, ends))
    # peers whose RTT to a holder was measured (by either side): the only previous hops whose cost differs
    measured: dict[str, set[str]] = {}
    for h in by_id.values():
        for other in h.rtt_ms:
            measured.setdefault(h.peer_id, set()).add(other)
            measured.setdefault(other, set()).add(h.peer_id)
    # a path's key is (cost_ms, hops, peer ids, hop ends): its order is the order of ties
    best: dict[int, dict] = {a: {} for a in cuts}
    best[lo][prev_peer] = (0.0, 0, (), ())
    reached = lo
    for a in cuts[:-1]:
        states = best[a]
        if not states:
            continue
        reached = a  # the furthest boundary a chain could go on from
        ranked = sorted(states.items(), key=lambda kv: kv[1])
        for h, hop_ends in hops_from[a]:
            hid = h.peer_id
            pairs = measured.get(hid, ())
            entries = []  # (cost on entering h, key of the path before it)
            for prev, key in ranked:  # the cheapest state whose RTT to h is the client's estimate
                if prev != hid and prev not in pairs:
                    entries.append((key[0] + model.rtt_ms(None, None, h) / 2, key))
                    break
            for prev in pairs:
                if prev != hid and prev in states:
                    key = states[prev]
                    entries.append((key[0] + model.rtt_ms(prev, by_id.get(prev), h) / 2, key))
            at_end = best
            for enter_ms, (_, n, ids, ends) in entries:
                for b, compute_ms in hop_ends:
                    new = (enter_ms + compute_ms, n + 1, ids + (hid,), ends + (b,))
                    old = at_end[b].get(hid)
                    if old is None or new < old:
                        at_end[b][hid] = new
    done = None
    for prev, (cost, n, ids, ends) in best[hi].items():
        if prev != next_peer:
            back = model.rtt_ms(next_peer, by_id.get(next_peer), by_id[prev]) / 2
            key = (cost + back, n, ids, ends)
            if done is None or key < done:
                done = key
    if done is None:
        raise _explain(by_id, lo, hi, exclude, model, cuts, reached)
    cost, _, ids, ends = done
    starts = (lo,) + ends[:-1]
    return cost, tuple(Hop(p, by_id[p].addr, (s, e), by_id[p].layers) for p, s, e in zip(ids, starts, ends))


def _explain(by_id: Mapping[str, Holder], lo: int, hi: int, exclude: frozenset[str], model: _CostModel,
             cuts: list[int], reached: int) -> NoRoute:
    online = [h for h in by_id.values() if h.state == "online"]
    usable = [h for h in online if h.peer_id not in exclude]
    gaps = _gaps((h.layers for h in usable), lo, hi)
    if gaps:
        bare = _gaps((h.layers for h in online), lo, hi)
        if bare == gaps:
            return NoRoute(gaps, "no online holder covers them")
        if not bare:
            return NoRoute(gaps, "only excluded holders cover them")
        return NoRoute(gaps, f"no online holder covers {format_ranges(bare)}, only excluded holders cover the rest")
    blocked = [(p, q) for p, q in zip(cuts, cuts[1:])
               if not any(h.layers[0] <= p and q <= h.layers[1] and model.kv_fits(h, q - p) for h in usable)]
    if blocked:
        return NoRoute(_merge(blocked), f"no holder there has free KV cache for {model.context_tokens} context tokens")
    return NoRoute([(reached, hi)], "every chain there would give one peer two consecutive hops or overflow a "
                                    f"holder's free KV cache for {model.context_tokens} context tokens")


def plan_route(holders: Sequence[Holder], num_layers: int, *, client_rtt_ms: Mapping[str, float] = _NO_RTT,
               context_tokens: int = 0, exclude: frozenset[str] = frozenset(), default_rtt_ms: float = 50.0,
               default_layer_ms: float = 10.0, measured_layer_ms: Mapping[str, float] = _NO_RTT) -> Route:
    """The cheapest route over decoder layers ``[0, num_layers)``.

    Shortest path over states (layer boundary, previous holder), as Petals does over server spans
    (Borzunov et al. 2023, section 3; Dijkstra in Petals' ``sequence_manager``). From boundary a, an
    online holder h not in ``exclude`` with h.start <= a < h.end may serve [a, b) for b any holder's
    start or end in (a, h.end], or h.end. Hop cost, ms: rtt/2 from the previous hop (its measured
    ``rtt_ms[h]``, else h's to it, else for the first hop or when unknown ``client_rtt_ms[h]``, else
    ``default_rtt_ms``) + (b - a) * per-layer ms * (1 + 0.25 * sessions), per-layer ms being
    1000 / throughput_tps / block length, or ``default_layer_ms`` when throughput is unknown. A hop
    whose known free KV cache is below context_tokens * kv_bytes_per_token_layer * (b - a) is not
    allowed. The route's cost adds the last hop's way back to the client (its client RTT / 2).
    A record's throughput is a claim: where the client measured a holder (``measured_layer_ms``) that
    measurement is its per-layer ms; an unmeasured holder's claim (or default) counts no faster than
    ``unmeasured_floor_ms``: at most ``CLAIM_SPREAD`` times faster than the median claim, and slower
    than the fastest credible stage the client measured (issue 45 item 17).
    Ties: fewer hops, then PeerIds in order. A peer never serves two consecutive hops; it may
    serve two separate ones when the holders between are fast enough to pay for the extra trips.
    Settled boundary by boundary (``_cheapest_chain``): work grows with holders x boundaries, not
    with holders squared (1,000 holders over 80 layers: well under a second; the Dijkstra it
    replaced took 10 s, issue 31).

    Args:
        holders: one record per peer, any state.
        num_layers: L, decoder layers of the model.
        client_rtt_ms: the client's measured round trips, PeerId -> ms.
        context_tokens: positions the session's KV cache must hold (prompt + new tokens).
        exclude: PeerIds never to use (failed, distrusted).
        default_rtt_ms: round trip assumed where none was measured.
        default_layer_ms: compute ms per layer per decode step where throughput is unknown.
        measured_layer_ms: compute ms per layer per decode step the client measured, PeerId -> ms
            (``attribute_round_ms``).
    Returns:
        The Route; its hops tile [0, num_layers) in order.
    Raises:
        ConfigError: num_layers < 1, two records of one peer, a block outside [0, num_layers), or a
            measurement that is not a finite number > 0.
        NoRoute: names the layer ranges no usable holder covers (or where exclusion or KV cache
            room blocks every chain).
    """
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"a model needs at least one layer, got num_layers={num_layers!r}")
    by_id = _check_holders(holders, num_layers)
    model = _cost_model(by_id, client_rtt_ms, context_tokens, default_rtt_ms, default_layer_ms, measured_layer_ms)
    cost_ms, hops = _cheapest_chain(by_id, 0, num_layers, None, None, frozenset(exclude), model)
    return Route(hops, cost_ms)


def plan_replacement(holders: Sequence[Holder], lost: Span, *, prev_peer: str | None, next_peer: str | None,
                     exclude: frozenset[str], client_rtt_ms: Mapping[str, float] = _NO_RTT, context_tokens: int = 0,
                     default_rtt_ms: float = 50.0, default_layer_ms: float = 10.0,
                     measured_layer_ms: Mapping[str, float] = _NO_RTT) -> tuple[Hop, ...]:
    """The cheapest chain of hops serving exactly ``lost``, to splice between ``prev_peer`` and ``next_peer``.

    The cost model and search of ``plan_route``, from ``prev_peer`` to ``next_peer`` instead of
    client to client. Usually one holder containing ``lost``; else a chain. ``prev_peer`` never
    serves the first hop nor ``next_peer`` the last (each would serve two consecutive hops: extend
    its own hop instead, or re-plan the route).

    Args:
        holders: one record per peer, any state.
        lost: the layer range ``[start, end)`` to serve again.
        prev_peer, next_peer: the route's neighbours of the gap (None: the client).
        exclude: PeerIds never to use, normally the lost peer and the rest of the route.
        client_rtt_ms, context_tokens, default_rtt_ms, default_layer_ms, measured_layer_ms: as in ``plan_route``.
    Returns:
        Hops tiling ``lost`` in order.
    Raises:
        ConfigError: an empty or negative ``lost``, or two records of one peer.
        NoRoute: names the part of ``lost`` no usable holder can serve.
    """
    lo, hi = lost
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 0 or hi <= lo:
        raise ConfigError(f"lost layer range {lost!r} is empty or negative")
    by_id = _check_holders(holders, None)
    model = _cost_model(by_id, client_rtt_ms, context_tokens, default_rtt_ms, default_layer_ms, measured_layer_ms)
    return _cheapest_chain(by_id, lo, hi, prev_peer, next_peer, frozenset(exclude), model)[1]


def spares_for(holders: Sequence[Holder], route: Route, *, exclude: frozenset[str] = frozenset(),
               client_rtt_ms: Mapping[str, float] = _NO_RTT, context_tokens: int = 0, default_rtt_ms: float = 50.0,
               default_layer_ms: float = 10.0,
               measured_layer_ms: Mapping[str, float] = _NO_RTT) -> dict[int, tuple[Hop, ...]]:
    """For each hop of ``route``, the best replacement chain from holders outside the route.

    Args:
        holders: one record per peer. route: from ``plan_route``. exclude: PeerIds never to use.
        client_rtt_ms, context_tokens, default_rtt_ms, default_layer_ms, measured_layer_ms: as in ``plan_route``.
    Returns:
        Hop index -> chain of hops tiling that hop's layers (an empty tuple where none exists).
    Raises:
        ConfigError: two records of one peer.
    """
    in_route = frozenset(h.peer_id for h in route.hops)
    spares: dict[int, tuple[Hop, ...]] = {}
    for i, hop in enumerate(route.hops):
        prev_peer = route.hops[i - 1].peer_id if i > 0 else None
        next_peer = route.hops[i + 1].peer_id if i + 1 < len(route.hops) else None
        try:
            spares[i] = plan_replacement(holders, hop.layers, prev_peer=prev_peer, next_peer=next_peer,
                                         exclude=frozenset(exclude) | in_route, client_rtt_ms=client_rtt_ms,
                                         context_tokens=context_tokens, default_rtt_ms=default_rtt_ms,
                                         default_layer_ms=default_layer_ms, measured_layer_ms=measured_layer_ms)
        except NoRoute:
            spares[i] = ()
    return spares


def layer_capacity(holders: Iterable[Holder], num_layers: int) -> list[float]:
    """Per layer, the summed throughput_tps of the online and joining holders covering it.

    An online holder of unknown throughput (0) counts 1.0. A joining holder carries the speed it
    estimated on one layer before choosing (``swarm.stage.membership.estimate_block_tps``); one that
    could not estimate (0) has not measured yet
    (it announces its block before its weights load, so stages choosing after it see the block
    taken): it counts as the median holder of known throughput would over its width, i.e. the
    median of ``throughput_tps * width`` over those holders, divided by its own width (1.0 when
    none is known). Counting it as 1.0 would leave its block looking empty to the stages that join
    while it loads, and they would all pick that block (the swarm simulator, issue 31, 1,000 stages:
    0.67 of the LP bound after the warm-up without joining records, 0.87 with them counted at the
    median speed, 0.90 had each carried its true speed; with the one-layer estimate and placement
    reads over every placement shard, 0.99 without churn and 0.97 with it).

    Args:
        holders: records as Holders; draining ones count as gone.
        num_layers: L.
    Returns:
        L floats, decode steps/s summed per layer.
    """
    holders = [h for h in holders if h.state in ("online", "joining")]
    speeds = sorted(h.throughput_tps * (h.layers[1] - h.layers[0]) for h in holders if h.throughput_tps > 0)
    median_speed = speeds[len(speeds) // 2] if speeds else 0.0
    capacity = [0.0] * num_layers
    for h in holders:
        tps = h.throughput_tps
        if not tps:
            tps = median_speed / (h.layers[1] - h.layers[0]) if h.state == "joining" and median_speed else 1.0
        for i in range(h.layers[0], min(h.layers[1], num_layers)):
            capacity[i] += tps
    return capacity


def _weakest_window(capacity: list[float], width: int) -> Span:
    key = min((min(capacity[s:s + width]), sum(capacity[s:s + width]), s) for s in range(len(capacity) - width + 1))
    return key[2], key[2] + width


def _check_placement(num_layers: int, fit_layers: int) -> int:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"a model needs at least one layer, got num_layers={num_layers!r}")
    if not isinstance(fit_layers, int) or fit_layers < 1:
        raise ConfigError(f"a stage must fit at least one layer, got fit_layers={fit_layers!r}")
    return min(fit_layers, num_layers)


def plan_placement(holders: Sequence[Holder], num_layers: int, fit_layers: int) -> Span:
    """The block a joining stage should load: ``min(fit_layers, num_layers)`` consecutive layers.

    Per-layer capacity is ``layer_capacity``; the window with the lowest minimum capacity wins
    (uncovered layers, capacity 0, first), then the lowest total capacity, then the leftmost. As in
    Petals (Borzunov et al. 2023, section 3), a joining server takes the span with the lowest throughput.

    Args:
        holders: one record per peer; draining ones count as gone.
        num_layers: L. fit_layers: how many layers this stage's memory holds.
    Returns:
        ``(start, end)``, half-open, inside [0, num_layers).
    Raises:
        ConfigError: num_layers or fit_layers < 1, two records of one peer, or a block outside [0, L).
    """
    width = _check_placement(num_layers, fit_layers)
    _check_holders(holders, num_layers)
    return _weakest_window(layer_capacity(holders, num_layers), width)


def should_move(holders: Sequence[Holder], me: str, num_layers: int, fit_layers: int, *,
                gain: float = 1.5) -> Span | None:
    """Whether running stage ``me`` should reload another block, and which.

    Without ``me``: if another online holder still covers every layer of its block (moving opens no
    gap) and the weakest window's minimum capacity is below the current block's minimum capacity /
    ``gain``, return that window. The ``gain`` margin keeps stages from chasing small differences
    (Petals moves a server only when the swarm's throughput clearly improves). Issue 31's simulator
    (1,000 stages, no churn, each read showing 256 of them): gain 2 never moved once placement had
    settled at 0.87 of the LP bound; 1.5 reached 0.92 with 0.07 moves per node-hour; 1.33 0.92
    with 0.5 (the reads' sampling noise, not the margin, is then the limit).

    Args:
        holders: one record per peer, ``me`` included. me: this stage's PeerId.
        num_layers: L. fit_layers: how many layers this stage's memory holds.
        gain: how many times weaker the new window must be than the current one (> 0).
    Returns:
        The new ``(start, end)``, or None to stay.
    Raises:
        ConfigError: ``me`` has no record, gain <= 0, or as ``plan_placement``.
    """
    width = _check_placement(num_layers, fit_layers)
    if not gain > 0:
        raise ConfigError(f"gain must be > 0, got {gain!r}")
    by_id = _check_holders(holders, num_layers)
    if me not in by_id:
        raise ConfigError(f"stage {me} has no record among the {len(by_id)} holders")
    start, end = by_id[me].layers
    others = [h for h in holders if h.peer_id != me]
    if _gaps((h.layers for h in others if h.state == "online"), start, end):
        return None  # leaving would uncover some of its layers
    capacity = layer_capacity(others, num_layers)
    best = _weakest_window(capacity, width)
    if best != (start, end) and min(capacity[best[0]:best[1]]) < min(capacity[start:end]) / gain:
        return best
    return None

"""A client's view of the swarm: records -> holders, RTT probes, a route as a ring, replacements.

Owns: one model's validated ``StageRecord``s as ``swarm.routing.Holder``s (``holders_of``), the client's own RTT
probes (``probe_rtts``), ``discover_ring`` (a route as a ``RingSpec``) and ``find_replacement`` (for a heal);
the decisions are ``swarm.routing``'s.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import trio

from swarm.config import RingSpec, StageSpec
from swarm.discovery.dht import SwarmDHT
from swarm.discovery.providers import PROVIDERS_SETTLE_S, gather_settled
from swarm.discovery.records import StageRecord
from swarm.errors import ConfigError
from swarm.ranges import LayerRange
from swarm.routing import Holder, Hop, NoRoute, Route, overclaimed, plan_replacement, plan_route

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Discovered:
    """What ``discover_ring`` found and chose.

    Args:
        ring: the route as a RingSpec (stages = hops with their sub-ranges; no spares).
        route: the routing decision (hops, expected per-token ms).
        records: every valid record of the model that was read.
        client_rtt_ms: this client's measured round trips, PeerId -> ms.
        seconds: time spent (read + probes + planning).
    """

    ring: RingSpec
    route: Route
    records: tuple[StageRecord, ...]
    client_rtt_ms: dict
    seconds: float


def holders_of(records: Sequence[StageRecord]) -> list[Holder]:
    """One Holder per record (its first direct addr, else its first relayed addr)."""
    out = []
    for r in records:
        addr = (r.addrs or r.relay_addrs)[0]
        out.append(Holder(peer_id=r.peer_id, addr=addr, layers=tuple(r.layers), state=r.state,
                          throughput_tps=float(r.throughput_tps), sessions=r.sessions,
                          free_kv_bytes=r.free_kv_bytes or None, kv_bytes_per_token_layer=r.kv_bytes_per_token_layer,
                          rtt_ms=dict(r.rtt_ms)))
    return out


PROBE_ROUNDS = 2  # echoes per probe on a warm connection (the smallest counts): jitter, without 3 round trips
ROUTE_QUORUM = 0.6  # a route waits for this share of the stages (read and probed), then SETTLE_GRACE_S ...
ROUTE_COVER = 3  # ... or until the stages read and probed hold every layer this many times, if sooner
ROUTE_GRACE_S = 0.1  # the wait for more stages after that: the ones still dialing are the farther ones


async def probe_one(dht: SwarmDHT, r: StageRecord, out: dict[str, float], timeout_s: float = 2.0) -> None:
    """Measure this client's round trip to one record's stage (its addresses in order) into ``out``."""
    for addr in (*r.addrs, *r.relay_addrs):
        ms = await dht.rtt_ms(addr, rounds=PROBE_ROUNDS, timeout_s=timeout_s)
        if ms is not None:
            out[r.peer_id] = ms
            return


async def probe_rtts(dht: SwarmDHT, records: Sequence[StageRecord], timeout_s: float = 2.0) -> dict[str, float]:
    """Measure this client's round trip to every record's stage concurrently; unreachable ones are left out,
    and so are the slowest: it returns ``SETTLE_GRACE_S`` after ``SETTLE_QUORUM`` of them answered
    (``swarm.discovery.providers.gather_settled``)."""
    out: dict[str, float] = {}
    # the slowest few percent (crashed or far behind relays) would set the time of every route
    with trio.move_on_after(timeout_s + 1):
        await gather_settled([functools.partial(probe_one, dht, r, out, timeout_s) for r in records])
    return out


def _could_cover(r: StageRecord, lost: tuple[int, int]) -> bool:
    return r.state == "online" and r.layers[0] < lost[1] and r.layers[1] > lost[0]


def ring_of(model: str, hops: Sequence[Hop]) -> RingSpec:
    """A RingSpec whose stages are the hops (addr, sub-range)."""
    return RingSpec(model=model, stages=tuple(StageSpec(addr=h.addr, layers=LayerRange(*h.layers)) for h in hops))


async def discover_ring(dht: SwarmDHT, model: str, model_id: str, num_layers: int, *, context_tokens: int = 0,
                        exclude: frozenset[str] = frozenset(), timeout_s: float = 5.0, shut_out=None,
                        measured_layer_ms: Mapping[str, float] | None = None) -> Discovered:
    """Read the swarm's records of a model and choose a route over them.

    Args:
        dht: a joined SwarmDHT (client mode is enough).
        model: the model as the user named it (kept in the RingSpec for messages).
        model_id: its 64-hex id (``swarm.weights.identify.model_id``): only records naming it count.
        num_layers: L of the model.
        context_tokens: prompt + new tokens the session may reach (stages without KV room for it
            are skipped).
        exclude: PeerIds not to use.
        shut_out: ``await shut_out.excluded(dht, peer_ids)`` names the stages this reader verified a
            fraud proof against (``swarm.auditor.exclusions.Exclusions``); they are not used either.
        measured_layer_ms: compute ms per layer per decode step this client measured on stages in
            earlier sessions, PeerId -> ms (``swarm.coordinator.measured``): believed over their
            records' throughput claims. A stage measured ``OVERCLAIM_FACTOR`` times slower than it
            claims is logged (``route.overclaim``).
    Returns:
        Discovered (the ring to connect to, and what the choice rested on).
    Raises:
        ConfigError: no stage of this model announces on the swarm (or none of those the DHT
            names is live: the message says what their records were), or the announced stages
            leave layers uncovered (the message names the layer ranges and what holds what).
    """
    start = time.monotonic()
    # the provider lookup ends soon after the first node naming providers (not after libp2p's lock-step
    # rounds); each stage is probed as soon as its record arrives, on the connection the read opened;
    # the read ends ROUTE_GRACE_S after the stages read and probed cover every layer ROUTE_COVER times
    # (or ROUTE_QUORUM of them answered): the ones left out are the farthest (or gone), which a route
    # would not take anyway (issue 31: lookup, read, then probes took 7.5-8.3 s cold at 1,000 peers)
    rtts: dict[str, float] = {}
    cover = [0] * num_layers  # online stages read and probed, per layer

    async def probe(r: StageRecord) -> None:
        if r.peer_id not in exclude:
            await probe_one(dht, r, rtts)
            if r.peer_id in rtts and r.state == "online":
                for i in range(max(0, r.layers[0]), min(num_layers, r.layers[1])):
                    cover[i] += 1

    records, report = await dht.read_records(model_id, timeout_s=timeout_s, quorum=ROUTE_QUORUM, on_record=probe,
                                             enough=lambda: min(cover) >= ROUTE_COVER, grace_s=ROUTE_GRACE_S,
                                             settle_s=PROVIDERS_SETTLE_S)
    if not records and not report.providers:
        raise ConfigError(f"no stage of model {model} (id {model_id[:16]}) announces on the swarm; "
                          "start stages with --bootstrap, or check that they run the same weights")
    if not records:
        raise ConfigError(f"no live stage of model {model} (id {model_id[:16]}) announces on the swarm: "
                          f"{report.describe()}")
    if shut_out is not None:
        exclude = exclude | await shut_out.excluded(dht, [r.peer_id for r in records])
    holders = [h for h in holders_of(records) if h.peer_id in rtts]
    measured = dict(measured_layer_ms or {})
    for h in holders:
        if h.peer_id in measured and overclaimed(h, measured[h.peer_id]):
            log.warning("route.overclaim peer=%s claimed_tps=%.1f measured_tps=%.1f: routed by the measurement",
                        h.peer_id, h.throughput_tps, 1000.0 / measured[h.peer_id] / (h.layers[1] - h.layers[0]))
    try:
        route = plan_route(holders, num_layers, client_rtt_ms=rtts, context_tokens=context_tokens, exclude=exclude,
                           measured_layer_ms=measured)
    except NoRoute as e:
        held = ", ".join(f"{r.peer_id[-8:]} [{r.layers[0]}, {r.layers[1]}) {r.state}"
                         f"{'' if r.peer_id in rtts else ' unreachable'}" for r in records)
        raise ConfigError(f"cannot route model {model}: {e} (stages: {held})") from None
    seconds = time.monotonic() - start
    log.info("route.chosen model=%s hops=%d cost_ms=%.1f found=%d took_s=%.2f route=%s", model, len(route.hops),
             route.cost_ms, len(records), seconds, route)
    return Discovered(ring_of(model, route.hops), route, tuple(records), rtts, seconds)


async def find_replacement(dht: SwarmDHT, model_id: str, lost: tuple[int, int], *, prev_peer: str | None,
                           next_peer: str | None, exclude: frozenset[str], context_tokens: int = 0,
                           timeout_s: float = 5.0, known: Sequence[StageRecord] | None = None,
                           known_rtt_ms: Mapping[str, float] | None = None,
                           _records: Sequence[StageRecord] | None = None, shut_out=None,
                           measured_layer_ms: Mapping[str, float] | None = None) -> tuple[Hop, ...]:
    """The cheapest reachable chain of stages that can take over layers ``lost`` of a route.

    Args:
        known: records read earlier (at routing time): tried first, so a heal costs a few RTT
            probes instead of a DHT read; None or no usable one reads the DHT afresh.
        known_rtt_ms: this client's round trips measured at routing time (``Discovered.client_rtt_ms``),
            PeerId -> ms. With ``known``, the chain is planned over the known stages measured then
            and only its stages are probed (are they still there?); one that does not answer is
            dropped and the chain planned again, up to ``KNOWN_TRIES`` times, before every
            candidate is probed as without it.
        shut_out: as for :func:`discover_ring`: stages with a verified fraud proof are not taken.
        measured_layer_ms: as for :func:`discover_ring`: this client's own timings, believed over claims.
    Raises:
        NoRoute: no reachable, online stage outside ``exclude`` covers the lost range.
    """
    measured = measured_layer_ms or {}
    if shut_out is not None:
        exclude = exclude | await shut_out.excluded(dht, [r.peer_id for r in known or ()])
    if known and known_rtt_ms:
        hops = await _replacement_from_known(dht, lost, prev_peer=prev_peer, next_peer=next_peer, exclude=exclude,
                                             context_tokens=context_tokens, known=known, known_rtt_ms=known_rtt_ms,
                                             measured_layer_ms=measured)
        if hops:
            return hops
    if known:
        try:
            return await find_replacement(dht, model_id, lost, prev_peer=prev_peer, next_peer=next_peer,
                                          exclude=exclude, context_tokens=context_tokens, timeout_s=timeout_s,
                                          known=None, _records=[r for r in known if r.peer_id not in exclude],
                                          measured_layer_ms=measured)
        except NoRoute as e:
            log.info("route.replacement_not_in_known lost=[%d, %d) reason=%s; reading the DHT", *lost, e)
    records = list(_records) if _records is not None else await dht.find_records(model_id, timeout_s=timeout_s)
    if shut_out is not None and _records is None:
        exclude = exclude | await shut_out.excluded(dht, [r.peer_id for r in records])
    records = [r for r in records if r.peer_id not in exclude]
    rtts = await probe_rtts(dht, [r for r in records if _could_cover(r, lost)])
    holders = [h for h in holders_of(records) if h.peer_id in rtts]
    hops = plan_replacement(holders, lost, prev_peer=prev_peer, next_peer=next_peer, exclude=exclude,
                            client_rtt_ms=rtts, context_tokens=context_tokens, measured_layer_ms=measured)
    log.info("route.replacement lost=[%d, %d) hops=%s", *lost, [(h.peer_id[-8:], h.layers) for h in hops])
    return hops


KNOWN_TRIES = 3  # chains planned over routing-time RTTs whose stages are probed, before probing every candidate


async def _replacement_from_known(dht: SwarmDHT, lost: tuple[int, int], *, prev_peer: str | None,
                                  next_peer: str | None, exclude: frozenset[str], context_tokens: int,
                                  known: Sequence[StageRecord], known_rtt_ms: Mapping[str, float],
                                  measured_layer_ms: Mapping[str, float]) -> tuple[Hop, ...]:
    """``find_replacement`` over the records and RTTs of routing time: plan, probe only the chain's stages,
    drop those that do not answer, plan again. A heal then waits for a probe of one or two stages,
    not for a fan-out to every candidate until its quorum (issue 31's simulator, 3 heals: p50 / p95
    3.23 / 3.57 s with the fan-out, 2.61 / 2.90 s with this). Returns () when no chain of answering
    stages was found."""
    records = {r.peer_id: r for r in known if r.peer_id not in exclude and r.peer_id in known_rtt_ms
               and _could_cover(r, lost)}
    for _ in range(KNOWN_TRIES):
        holders = holders_of(list(records.values()))
        try:
            hops = plan_replacement(holders, lost, prev_peer=prev_peer, next_peer=next_peer, exclude=exclude,
                                    client_rtt_ms=known_rtt_ms, context_tokens=context_tokens,
                                    measured_layer_ms=measured_layer_ms)
        except NoRoute:
            return ()
        fresh: dict[str, float] = {}
        async with trio.open_nursery() as nursery:
            for h in hops:
                nursery.start_soon(probe_one, dht, records[h.peer_id], fresh)
        gone = [h.peer_id for h in hops if h.peer_id not in fresh]
        if not gone:
            log.info("route.replacement lost=[%d, %d) hops=%s (routing-time RTTs)", *lost,
                     [(h.peer_id[-8:], h.layers) for h in hops])
            return hops
        for peer_id in gone:
            del records[peer_id]
    return ()

"""The client pool of ``swarm serve``: ring clients with open streams, one per request in flight.

Owns: ``ClientPool`` (at most ``max_concurrency`` clients; a healthy one reused, a failed one closed), rerouting
through the DHT when a routed ring lost a stage or a stage ran ``OVERCLAIM_FACTOR`` times slower than it claims,
and each routed request's measurements (``swarm.coordinator.measured``). It reads ``ServeState`` duck-typed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from swarm.errors import ConfigError, StageLost
from swarm.routing import OVERCLAIM_FACTOR, overclaimed

if TYPE_CHECKING:
    from swarm.coordinator.ring import RingClient

log = logging.getLogger(__name__)

REROUTE_EVERY_S = 30.0  # an overclaimer measured again within this leaves the route as it is (a DHT read each time)


class ClientPool:
    """Ring clients with open streams to every stage, one per request in flight (at most ``size``).

    Streams are opened once and reused: py-libp2p 0.8.1 loses a shared connection when many streams
    are opened and closed on it while others are busy, so requests must not churn streams. A client
    whose request failed or was cancelled (its streams may hold half a frame) is closed, not reused.
    """

    def __init__(self, state, size: int):
        """``state``: the server's ``ServeState``; ``size``: the most clients at once (``--max-concurrency``)."""
        self.state, self.size = state, size
        self.free: list[RingClient] = []
        self.route_gen = 0  # bumped when a reroute changes the served route
        self.gen_of: dict[RingClient, int] = {}  # each open client: the route_gen it was connected on
        self.slots = trio.Semaphore(size)
        self.opened = 0
        self.stale = False  # a stage of the route overclaims: the next client routes again, with measurements
        self.rerouted_at = -float("inf")  # trio clock of the last measured reroute

    async def acquire(self) -> RingClient:
        """A connected ring client, once fewer than ``size`` are taken (waits for a free slot).

        Raises:
            SwarmError: connecting failed (``StageLost``: after a reroute too, for a routed ring).
        """
        await self.slots.acquire()
        try:
            if self.stale and self.state.discovery is not None:
                await self._reroute_measured()
            while self.free:
                client = self.free.pop()
                if self.gen_of.get(client) == self.route_gen:
                    return client
                await self._close(client)  # connected on a route a reroute has left
            try:
                client = await self._connect()
            except StageLost as exc:
                if self.state.discovery is None:
                    raise
                # routed from the DHT: a stage of the route is gone (and no request healed past it, e.g.
                # its heal found nothing yet): route again over the records as they are now
                log.warning("serve.reroute reason=%s", exc)
                await self._reroute(exc)
                client = await self._connect()
            self.opened += 1
            self.gen_of[client] = self.route_gen
            return client
        except BaseException:
            self.slots.release()
            raise

    async def _connect(self) -> RingClient:
        from swarm.coordinator.ring import RingClient

        st = self.state
        cfg = st.config.ring
        client = RingClient(st.host, st.ring, cfg.hop_timeout_s, cfg.connect_timeout_s, cfg.heartbeat_s, batch=True,
                            model_id=st.discovery.model_id if st.discovery else None)
        client.discovery = st.discovery  # heals may take a replacement from the DHT
        client.shut_out = st.shut_out  # ... but never a stage with a fraud proof this server re-ran
        try:
            await client.connect(st.num_layers, st.model_digest, st.nursery, use_spares=True)
        except BaseException:
            await client.aclose()
            raise
        return client

    async def _reroute(self, cause: StageLost) -> None:
        """A new route from the DHT for the clients opened from now on (``swarm.discovery.client``),
        leaving out the stages the server's ``shut_out`` verified a fraud proof against.

        Raises:
            StageLost: the swarm has no route now (names why), so the request is a 503.
        """
        try:
            await self._route_again()
        except ConfigError as exc:
            raise StageLost(f"{cause}; and no new route: {exc}") from None

    async def _route_again(self):
        """Route over the DHT's records as they are now, believing this server's measurements over the
        stages' claims; the served ring becomes the new route. Returns ``discover_ring``'s result.

        Raises:
            ConfigError / StageLost: no route (``discover_ring``).
        """
        from swarm.coordinator.measured import load_measured
        from swarm.coordinator.routing import RouteContext
        from swarm.discovery.client import discover_ring

        st = self.state
        dht, weights_id = st.discovery.dht, st.discovery.model_id
        found = await discover_ring(dht, st.ring.model, weights_id, st.num_layers, shut_out=st.shut_out,
                                    measured_layer_ms=load_measured(weights_id))
        if [s.addr for s in found.ring.stages] != [s.addr for s in st.ring.stages]:
            self.route_gen += 1
        st.ring, st.discovery = found.ring, RouteContext.of(dht, weights_id, found)
        return found

    def note_measured(self, client: RingClient, decoded) -> None:
        """Keep what a finished routed request measured of ``client``'s stages (its ``DecodeResult``:
        ``swarm.coordinator.measured.note_session``); a stage of the served route measured
        ``OVERCLAIM_FACTOR`` times slower than its record claims marks the route stale."""
        from swarm.coordinator.measured import note_session
        from swarm.discovery.client import holders_of

        st = self.state
        if st.discovery is None:
            return
        weights_id, records, client_rtt = st.discovery.model_id, st.discovery.records, st.discovery.client_rtt_ms
        kept = note_session(weights_id, [(i.peer_id, tuple(i.layers)) for i in client.infos], client_rtt, decoded)
        claims = {h.peer_id: h for h in holders_of(list(records))}
        route = {s.peer_id for s in st.ring.stages}
        slow = [p for p, ms in kept.items() if p in claims and p in route and overclaimed(claims[p], ms)]
        if slow:
            log.warning("serve.overclaim stages=%s: measured over %gx slower than claimed; the next clients route "
                        "again", [p[-8:] for p in slow], OVERCLAIM_FACTOR)
            self.stale = True

    async def _reroute_measured(self) -> None:
        """Route again with this server's measurements (``stale``); kept clients of the old route are closed
        when next taken. At most once per ``REROUTE_EVERY_S``; a failed read keeps the route."""
        now = trio.current_time()
        if now - self.rerouted_at < REROUTE_EVERY_S:
            return
        self.stale, self.rerouted_at = False, now
        gen = self.route_gen
        try:
            found = await self._route_again()
        except (ConfigError, StageLost) as exc:
            log.warning("serve.reroute_measured_failed reason=%s: keeping the route", exc)
            return
        if self.route_gen != gen:
            log.info("serve.rerouted_by_measurement route=%s", [h.peer_id[-8:] for h in found.route.hops])

    async def release(self, client: RingClient, healthy: bool) -> None:
        """Give ``client`` back: kept for the next request if ``healthy`` (``acquire`` closes it instead if a
        reroute moved the route meanwhile), else closed (its streams may hold half a frame); its slot frees
        either way."""
        if healthy:
            self.free.append(client)
        else:
            await self._close(client)
        self.slots.release()

    async def _close(self, client: RingClient) -> None:
        self.gen_of.pop(client, None)
        await client.aclose()

    async def aclose(self) -> None:
        """Close the clients kept for reuse."""
        while self.free:
            await self._close(self.free.pop())

"""The client pool of ``swarm serve``: ring clients with open streams, one per request in flight.

Owns: ``ClientPool`` (at most ``max_concurrency`` clients; a healthy one is reused, a failed one
closed) and rerouting through the swarm's DHT when a routed ring lost a stage. It reads and
updates the server's ``ServeState`` (its ring, host, nursery, settings) duck-typed: the state holds
the pool, so this module does not import it. May import: trio, ``swarm.coordinator.ring``,
``swarm.discovery.client`` (lazily), ``swarm.errors``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from swarm.errors import ConfigError, StageLost

if TYPE_CHECKING:
    from swarm.coordinator.ring import RingClient

log = logging.getLogger(__name__)


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
        self.slots = trio.Semaphore(size)
        self.opened = 0

    async def acquire(self) -> RingClient:
        """A connected ring client, once fewer than ``size`` are taken (waits for a free slot).

        Raises:
            SwarmError: connecting failed (``StageLost``: after a reroute too, for a routed ring).
        """
        await self.slots.acquire()
        try:
            if self.free:
                return self.free.pop()
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
            return client
        except BaseException:
            self.slots.release()
            raise

    async def _connect(self) -> RingClient:
        from swarm.coordinator.ring import RingClient

        st = self.state
        cfg = st.config
        client = RingClient(st.host, st.ring, cfg.hop_timeout_s, cfg.connect_timeout_s, cfg.heartbeat_s, batch=True,
                            model_id=st.discovery[1] if st.discovery else None)
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
        from swarm.discovery.client import discover_ring

        st = self.state
        dht, weights_id = st.discovery[0], st.discovery[1]
        try:
            found = await discover_ring(dht, st.ring.model, weights_id, st.num_layers, shut_out=st.shut_out)
        except ConfigError as exc:
            raise StageLost(f"{cause}; and no new route: {exc}") from None
        st.ring, st.discovery = found.ring, (dht, weights_id, found.records, found.client_rtt_ms)

    async def release(self, client: RingClient, healthy: bool) -> None:
        """Give ``client`` back: kept for the next request if ``healthy``, else closed (its streams
        may hold half a frame); its slot frees either way."""
        if healthy:
            self.free.append(client)
        else:
            await client.aclose()
        self.slots.release()

    async def aclose(self) -> None:
        """Close the clients kept for reuse."""
        while self.free:
            await self.free.pop().aclose()

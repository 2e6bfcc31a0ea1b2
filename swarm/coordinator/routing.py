"""A ring client for a request: from a ring file, or routed through the swarm's DHT.

Owns: ``connect_ring`` (the route chosen from stage records and measured latencies, retried on a
stage that fails to connect), ``swarm_may_serve`` (refusing at once a model no stage announces) and
``run_dht`` (a client-mode DHT for routes and heals).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from swarm.config import CoordinatorConfig
from swarm.errors import HopTimeout, StageLost
from swarm.coordinator.ring import RingClient
from swarm.addrs import peer_id_from_addr

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteContext:
    """What a client routed through the swarm keeps of its route, for heals, audits and the next route:
    the DHT, the weights' model id, the stage records read and the RTTs to them measured then (ms).
    ``of(dht, model_id, found)`` from a ``discover_ring`` result."""

    dht: object
    model_id: str
    records: tuple = ()
    client_rtt_ms: dict = field(default_factory=dict)

    @classmethod
    def of(cls, dht, model_id: str, found) -> RouteContext:
        return cls(dht, model_id, tuple(found.records), dict(found.client_rtt_ms))


# routes tried when a routed stage cannot be dialed (it died or froze since its record was read)
ROUTE_ATTEMPTS = 3


async def connect_ring(config: CoordinatorConfig, host, nursery, model_path, num_layers: int,
                       prompt_len: int, digest: str) -> tuple[RingClient, float | None]:
    """A connected RingClient over the ring file, or with ``--bootstrap`` over a route read from the
    swarm's records (the DHT client runs in ``nursery``; heals may look there too).

    A routed stage that cannot be dialed (it died, or froze, between the RTT probe that chose it and
    the connect: seen under churn in bench/chaos.py) is excluded and the route chosen again, up to
    ``ROUTE_ATTEMPTS`` routes; a ring file's stage is not (the file names it).

    Returns:
        (the client, seconds the routing took or None without ``--bootstrap``).
    Raises:
        StageLost / HopTimeout: a stage could not be reached (after the last route); ConfigError: no route.
    """
    if not config.bootstrap:
        ring = RingClient(host, config.ring, config.hop_timeout_s, config.connect_timeout_s, config.heartbeat_s)
        await ring.connect(num_layers, digest, nursery)
        return ring, None
    from swarm.config import cache_root as _cache_root
    from swarm.discovery.client import discover_ring
    from swarm.weights.identify import model_id as weights_model_id

    from swarm.auditor.exclusions import Exclusions
    from swarm.auditor.judge import Blocks

    model_id = await trio.to_thread.run_sync(weights_model_id, model_path, _cache_root() / "manifests")
    dht = await nursery.start(run_dht, host, config.bootstrap)
    shut_out = Exclusions(Blocks(model_path))  # a fraud proof is re-run on the local weights before it counts
    from swarm.coordinator.measured import load_measured

    measured = load_measured(model_id)  # stage timings of this client's earlier sessions: believed over claims
    unreachable: set[str] = set()
    route_s, attempt = 0.0, 1
    while True:
        found = await discover_ring(dht, config.ring.model, model_id, num_layers, exclude=frozenset(unreachable),
                                    context_tokens=prompt_len + config.max_new_tokens, shut_out=shut_out,
                                    measured_layer_ms=measured)
        route_s += found.seconds
        ring = RingClient(host, found.ring, config.hop_timeout_s, config.connect_timeout_s, config.heartbeat_s,
                          model_id=model_id)
        # heals try these stages (at the RTTs measured now) before reading the DHT
        ring.discovery = RouteContext.of(dht, model_id, found)
        ring.shut_out = shut_out
        try:
            await ring.connect(num_layers, digest, nursery)
            return ring, route_s
        except (StageLost, HopTimeout) as exc:
            failed = found.ring.stages[len(ring.links)]  # connect dials in ring order and stops at the first
            await ring.aclose()
            if attempt == ROUTE_ATTEMPTS:
                raise
            unreachable.add(peer_id_from_addr(failed.addr))
            log.warning("route.retry attempt=%d unreachable=%s reason=%s: routing again without it", attempt,
                        failed.addr, exc)
            attempt += 1


async def swarm_may_serve(model: str, bootstrap: tuple[str, ...]) -> None:
    """Refuse at once a model whose resolving is costly (a conversion, a download) when no stage of the
    swarm announces a model of that name: the exact check (by weights id) needs the converted model,
    and a swarm of other models should not cost the user a minute of converting first.

    Raises:
        StageLost: the swarm has no stage of a model named so (the message lists what it has).
    """
    from libp2p.crypto.ed25519 import create_new_key_pair

    from swarm.discovery.dht import open_dht
    from swarm.model.resolve import costly_name
    from swarm.transport import open_host

    name = await trio.to_thread.run_sync(costly_name, model)
    if name is None:
        return
    # a read-only DHT client whose identity nobody sees: a key of its own, in memory only
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_dht(host, server=False, bootstrap=bootstrap) as dht:
        records = await dht.find_records(None, timeout_s=5.0)
    if any(r.model_name.lower() == name.lower() for r in records):
        return
    has = sorted({f"{r.model_name} ({r.model_id[:12]})" for r in records})
    raise StageLost(f"the swarm (joined through {bootstrap[0]}) has no stage of model {name!r}"
                    + (f"; its stages serve: {', '.join(has)}" if has else "; it has no stages at all")
                    + f". Nothing was converted or downloaded; if the stages announce the same weights under "
                    f"another name, run `swarm model import {model}` once, then this command checks "
                    "by the weights themselves")


async def run_dht(host, bootstrap, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Join the swarm's DHT in client mode and hand the SwarmDHT to ``task_status`` until cancelled."""
    from swarm.discovery.dht import open_dht, peer_cache_path

    # the peer cache lets a client that ran before join while no bootstrap node answers (issue 31)
    async with open_dht(host, server=False, bootstrap=bootstrap, peer_cache=peer_cache_path()) as dht:
        task_status.started(dht)
        await trio.sleep_forever()

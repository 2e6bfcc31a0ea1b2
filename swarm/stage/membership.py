"""A stage's membership in a self-organizing swarm: placement, its record, announcing, moving.

Owns: ``place`` (a block for a stage without ``--layers``, announced as ``joining`` while the weights load),
``estimate_block_tps`` and ``measure_decode_tps``, ``record_fields`` (its record from the live server) and
``announce`` (the DHT join, the record kept fresh, ``draining`` at once, a move when ``should_move`` says so).
"""

from __future__ import annotations

import logging
import time
from pathlib import PurePath

import torch
import trio

from swarm import __version__
from swarm.config import StageConfig
from swarm.errors import ConfigError, SwarmError
from swarm.ranges import LayerRange
from swarm.routing import plan_placement, should_move

log = logging.getLogger(__name__)


def measure_decode_tps(block, steps: int = 8) -> float:
    """Decode steps per second of ``block`` over its whole range (one new position per step), in
    the block's dtype and device, on a scratch KV cache: what a client's routing divides work by.

    Returns:
        steps / second (after one warm-up step).
    """
    cache = block.new_cache(steps + 2)
    gen = torch.Generator().manual_seed(0)
    if block.is_head:
        xs = [torch.randint(0, block.vocab_size, (1, 1), generator=gen) for _ in range(steps + 1)]
    else:
        xs = [torch.randn(1, 1, block.hidden_size, generator=gen).to(block.dtype) for _ in range(steps + 1)]
    block.forward_batch([(cache, 0, xs[0])])
    start = time.perf_counter()
    for i in range(1, steps + 1):
        block.forward_batch([(cache, i, xs[i])])
    return steps / max(1e-9, time.perf_counter() - start)


def probe_layer(num_layers: int) -> int:
    """The layer a stage times before choosing its block: a middle one (neither the head's
    embedding nor the tail's LM head rides along), layer 0 for a one-layer model."""
    return num_layers // 2


def estimate_block_tps(model_dir, config: StageConfig, num_layers: int, width: int, steps: int = 8) -> float:
    """Decode steps per second this stage expects over a block of ``width`` layers, before it has one:
    one middle layer (``probe_layer``) loaded from ``model_dir`` in the stage's dtype and device and
    timed as ``measure_decode_tps`` times a block, divided by ``width``.

    Why: a joining stage announces its block before the weights load (``place``); without a speed
    its record counts at the swarm's median, and stages choosing meanwhile misjudge the block
    (issue 31's simulator, 1,000 stages: 0.87 of the LP bound at the median speed, 0.92 at the
    true speed). Per-step costs outside the layers make a whole block a little slower than
    ``width`` probe layers; the stage measures its real block once loaded and republishes.

    Args:
        model_dir: the model's HF-layout directory. config: for dtype, device and quantization.
        num_layers: L. width: layers of the block to be chosen (>= 1).
        steps: timed decode steps (after one warm-up).
    Returns:
        Decode steps/s over ``width`` layers (> 0).
    Raises:
        ModelError: the probe layer's tensors are missing. ConfigError: width < 1.
    """
    from swarm.model.block import load_block

    if width < 1:
        raise ConfigError(f"a block needs at least one layer, got width={width!r}")
    layer = probe_layer(num_layers)
    block = load_block(model_dir, LayerRange(layer, layer + 1), dtype=config.model.dtype, device=config.model.device,
                       quantize=config.model.quantize)
    try:
        return measure_decode_tps(block, steps) / width
    finally:
        del block


async def place(config: StageConfig, model_dir, model_id: str, num_layers: int, key) -> LayerRange:
    """Pick this stage's block from the swarm: ``fit`` layers (``--num-layers``, else what memory
    allows) at the window ``swarm.routing.plan_placement`` chooses from the current records, and
    announce it as ``joining`` (``swarm.discovery.announce.joining_fields``, valid ``JOINING_TTL_S``)
    before returning, so stages choosing while this one loads its weights count the block as taken;
    a failed announce is logged and placement goes on. The joining record carries the speed
    ``estimate_block_tps`` measured on one layer before choosing (0, counted at the median, when
    that fails). Placement reads every placement shard of the model
    (``SwarmDHT.read_records(placement=True)``), not only the 256 providers of the model key.

    Raises:
        DiscoveryError: no bootstrap node answered.
    """
    from swarm.discovery.announce import JOINING_TTL_S, Announcer, joining_fields
    from swarm.discovery.client import holders_of
    from swarm.discovery.dht import open_dht
    from swarm.stage.preflight import layers_that_fit
    from swarm.transport import open_host

    fit = config.membership.fit_layers or await trio.to_thread.run_sync(
        lambda: layers_that_fit(model_dir, dtype=config.model.dtype, device=config.model.device,
                                budget_mb=config.membership.mem_budget_mb,
                                max_ctx=config.admission.max_ctx))
    width = min(fit, num_layers)
    try:
        tps = await trio.to_thread.run_sync(lambda: estimate_block_tps(model_dir, config, num_layers, width))
    except (SwarmError, RuntimeError, OSError) as exc:  # the record then counts at the median speed
        log.warning("placement.speed_unknown error=%s", exc)
        tps = 0.0
    async with open_host(key, [config.network.listen]) as host:
        async with open_dht(host, server=False, bootstrap=config.membership.bootstrap) as dht:
            records = await _trusted(dht, await dht.find_records(model_id, placement=True), _shut_out(model_dir))
            window = plan_placement(holders_of(records), num_layers, width)
            log.info("placement.chosen layers=[%d, %d) fit=%d holders=%d expected_tps=%.2f", *window, fit,
                     len(records), tps)
            # the block counts as taken for the stages that choose while this one loads (issue 31)
            fields = joining_fields(model_id=model_id, model_name=PurePath(str(model_dir)).name, num_layers=num_layers,
                                    layers=window, addrs=tuple(host.addrs()), throughput_tps=tps)
            joining = Announcer(dht, key, lambda: fields, interval_s=JOINING_TTL_S / 2, ttl_s=JOINING_TTL_S)
            with trio.move_on_after(10.0):
                await joining.publish()
    return LayerRange(*window)


def _shut_out(model_dir):
    """The stage's :class:`swarm.auditor.exclusions.Exclusions`: proofs re-run on its own model directory."""
    from swarm.auditor.exclusions import Exclusions
    from swarm.auditor.judge import Blocks

    return Exclusions(Blocks(model_dir))


async def _trusted(dht, records: list, shut_out, me: str | None = None) -> list:
    """``records`` without the stages this stage verified a fraud proof against: placement counts only
    honest coverage, so a new stage fills the layers of a cheater it shut out."""
    excluded = await shut_out.excluded(dht, [r.peer_id for r in records if r.peer_id != me])
    return [r for r in records if r.peer_id not in excluded]


def record_fields(server, model_id: str, throughput_tps: float) -> dict:
    """The record fields read from the live server (all but peer_id, rtt_ms, seq and expiry)."""
    b, config = server.block, server.config
    relays = tuple(server.host.circuits.reserved.values()) if server.host.circuits else ()
    reserved = server.reserved_bytes()
    budget = config.admission.kv_budget_bytes or 0
    per_pos = b.kv_bytes_per_position()
    return {
        "model_id": model_id, "model_name": server.model_name, "num_layers": b.num_layers,
        "layers": (b.layer_range.start, b.layer_range.end),
        # a stage the dial-back could not reach offers only its circuits through relays (if any)
        "addrs": () if server.reachable is False and relays else tuple(server.host.addrs()),
        "relay_addrs": relays,
        "dtype": str(b.dtype).removeprefix("torch."), "device": b.device.type, "max_ctx": b.max_ctx,
        # no --kv-budget-mb: report room for one full-context session (0 would read as "full")
        "free_kv_bytes": max(0, budget - reserved) if budget else per_pos * b.max_ctx,
        "kv_bytes_per_token_layer": per_pos // max(1, len(b.layers)), "sessions": len(server.sessions),
        "state": "draining" if server.draining or server.drain_requested.is_set() else "online",
        "version": __version__, "throughput_tps": round(float(throughput_tps), 3),
        "repro": server.signer.repro_class().as_dict(),  # what an auditor compares bits within
        "audit_rate": float(config.audits.audit_rate),  # its auditor role: coordinators offer it their job receipts
    }


async def announce(server, config: StageConfig, model_id: str, throughput_tps: float, *, placed: bool,
                   task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Join the DHT on the server's host, publish the record (before reporting started), keep it
    fresh, republish ``draining`` as soon as a drain is requested, and (for a placed block) check
    every ``--rebalance-s`` whether to move; a move requests a drain and sets ``server.move_to``.

    The DHT mode comes from a dial-back (``swarm.discovery.reach``): a stage the bootstrap node can
    open a new connection to serves the DHT; one it cannot (behind NAT or a firewall) runs client
    mode, and the log says why. ``--dht-client`` skips the check. When no bootstrap node can
    answer the check, the stage serves (as before the check existed).

    ``task_status.started`` gets ``{"announced": bool, "dht_mode": "server" | "client",
    "reachable": bool | None}`` for the READY line.

    Raises:
        DiscoveryError: no bootstrap node answered (before started).
    """
    from swarm.discovery.announce import Announcer
    from swarm.discovery.client import holders_of
    from swarm.discovery.dht import open_dht, peer_cache_path
    from swarm.discovery.reach import check_reachable

    reachable = None
    if not config.membership.dht_client:
        reach = await check_reachable(server.host, config.membership.bootstrap, server.host.addrs())
        reachable = reach.reachable
        if reach.reachable is False:
            how = ("it announces only its circuits through --relay" if config.membership.relays else
                   "clients outside this network cannot reach it: forward the port and pass --announce-addr, or "
                   "use --relay")
            log.warning("stage.unreachable %s: joining the DHT in client mode; %s", reach.reason, how)
        elif reach.reachable is None:
            log.info("stage.reachability_unknown %s; serving the DHT", reach.reason)
    server.reachable = reachable
    dht_server = not config.membership.dht_client and reachable is not False
    # the peer cache lets a restarted stage join while no bootstrap node answers (issue 31)
    async with open_dht(server.host, server=dht_server, bootstrap=config.membership.bootstrap, accept_models=None,
                        peer_cache=peer_cache_path()) as dht:
        announcer = Announcer(dht, server.host.key_pair, lambda: record_fields(server, model_id, throughput_tps),
                              interval_s=config.membership.announce_interval_s, ttl_s=config.membership.record_ttl_s)
        server.announcer = announcer
        async with trio.open_nursery() as nursery:
            await nursery.start(announcer.run)
            task_status.started({"announced": announcer.published is not None,
                                 "dht_mode": "server" if dht_server else "client", "reachable": reachable})

            async def on_drain() -> None:
                await server.drain_requested.wait()
                announcer.poke()

            nursery.start_soon(on_drain)
            if placed and config.membership.rebalance_s > 0:
                b = server.block
                shut_out = _shut_out(b.model_dir)
                while not server.drain_requested.is_set():
                    await trio.sleep(config.membership.rebalance_s)
                    try:
                        records = await _trusted(dht, await dht.find_records(model_id, placement=True), shut_out,
                                                 server.host.peer_id)
                        target = should_move(holders_of(records), server.host.peer_id, b.num_layers, len(b.layers))
                    except SwarmError as exc:  # e.g. our own record not readable right now: next time
                        log.info("placement.recheck_failed error=%s", exc)
                        continue
                    if target is not None and tuple(target) != (b.layer_range.start, b.layer_range.end):
                        log.warning("placement.move from=%s to=[%d, %d)", b.layer_range, *target)
                        server.move_to = LayerRange(*target)
                        server.drain_requested.set()

"""The stage process: the libp2p host around a ``StageServer``, and the daemon's contract.

Owns: ``serve`` (the host on ``/swarm/ring/1`` with the frame-size limit, the expiry and scheduler tasks, the
READY payload), ``run_stage`` (``swarm stage``: READY or FATAL, serving until a signal or a drain frame drains
it, DRAINED), ``run_check`` (``swarm stage --check``) and ``emit`` (the lines: docs/protocol.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from functools import partial

import torch
import trio

from swarm.config import StageConfig, cache_fault
from swarm.errors import ConfigError, SwarmError, collapse
from swarm.stage.server import StageServer
from swarm.wire import PROTOCOL_ID
from swarm.ranges import LayerRange

log = logging.getLogger(__name__)


async def serve(server: StageServer, key, listen: str, task_status=trio.TASK_STATUS_IGNORED, *,
                announce_addrs: tuple[str, ...] = (), membership=None, relays: tuple[str, ...] = (),
                hole_punch: bool = True) -> None:
    """Run ``server`` on a new libp2p host until cancelled; ``task_status.started`` gets the READY payload.

    Args:
        announce_addrs: addresses the host advertises instead of the bound ones.
        relays: relay multiaddrs to hold reservations on (``swarm.transport.circuit``) before
            READY; their circuit addresses are READY's ``relay_addrs`` and go into the record.
        hole_punch: DCUtR and moving hops onto punched connections (``open_host``).
        membership: ``async (server, task_status)`` joining the swarm's DHT and announcing this stage
            (``swarm.stage.membership.announce``); READY waits for its first published record.
    """
    from swarm.config import cache_root
    from swarm.transport import open_host
    from swarm.weights.peer import serve_weights

    async with open_host(key, [listen], announce_addrs=announce_addrs, hole_punch=hole_punch) as host, \
            trio.open_nursery() as nursery:
        server.host, server.nursery = host, nursery
        server.key = server.key or key
        b = server.block
        # largest legitimate frame: a whole-context prefill of float64 hidden states, with headroom
        max_frame = min(256 << 20, max(16 << 20, 2 * b.max_ctx * b.hidden_size * 8))
        host.set_handler(PROTOCOL_ID, server.handle_stream, max_frame_bytes=max_frame)
        serve_weights(host, b.model_dir, server.model_name, cache_root() / "manifests")  # /swarm/weights/1.0.0
        nursery.start_soon(server.expire_idle)
        nursery.start_soon(server.scheduler.run)
        if server.auditing.on:
            nursery.start_soon(_run_auditor, server, host)
        ready = {"peer_id": host.peer_id, "addrs": host.addrs(), "layers": b.layer_range.as_list(),
                 "model": server.model_name, "model_digest": server.model_digest, "max_ctx": b.max_ctx,
                 "weights_bytes": b.loaded_bytes,  # what the block holds (quantized weights as held)
                 "kernels": dict(server.kernels)}  # the kernels it runs after the start-up proof, and why rows
        if relays:
            from swarm.transport.circuit import hold_reservations

            ready["relay_addrs"] = await nursery.start(hold_reservations, host.circuits, relays, host.peer_id)
        if membership is not None:
            ready.update(model_id=server.model_id, **await nursery.start(membership, server))
        httpd = None
        if server.config.network.metrics_listen:
            httpd, ready["metrics_url"] = _serve_metrics(server, server.config.network.metrics_listen)
        try:
            task_status.started(ready)
            await trio.sleep_forever()
        finally:
            if httpd is not None:
                httpd.shutdown()
                httpd.server_close()


async def _run_auditor(server: StageServer, host) -> None:
    """The auditor role's task (``--audit-rate``): re-runs from the stage's own model directory, and with
    ``--bootstrap`` publishes each fraud proof on the DHT the stage announces on."""
    from swarm import proofs
    from swarm.auditor.judge import Blocks

    async def publish(proof: dict) -> None:
        if server.announcer is None:
            return
        stored = await server.announcer.dht.proofs.publish(proofs.encode(proof), proof["accused"])
        log.warning("audit.proof_published accused=%s nodes=%d", proof["accused"], stored)

    b = server.block
    await server.auditing.run(host, server.key, Blocks(b.model_dir, b.device.type), host.peer_id, publish=publish,
                              timeout_s=server.config.network.hop_timeout_s)


def _serve_metrics(server: StageServer, listen: str):
    """prometheus_client's HTTP server (a thread) for the stage's registry on ``HOST:PORT`` (port 0:
    any free one). Returns (the server, its /metrics URL).

    Raises:
        ConfigError: the address cannot be bound.
    """
    from prometheus_client import start_http_server

    addr, _, port = listen.rpartition(":")
    try:
        httpd, _ = start_http_server(int(port), addr=addr.strip("[]"), registry=server.metrics.registry)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--metrics-listen {listen}: cannot listen there: {exc}") from None
    host = addr if ":" not in addr else f"[{addr.strip('[]')}]"
    return httpd, f"http://{host}:{httpd.server_port}/metrics"


def stop_signals() -> tuple[int, ...]:
    """The signals by which an operator stops a stage, each asking for a drain: SIGTERM (a supervisor),
    SIGINT (Ctrl-C) and SIGHUP (its terminal closed), the last unless the process was started to
    ignore it (``nohup``), which is kept."""
    wanted = [signal.SIGTERM, signal.SIGINT]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        wanted.append(signal.SIGHUP)
    return tuple(wanted)


async def _drain_on_signal(server: StageServer, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A stop signal (``stop_signals``: SIGTERM, Ctrl-C, SIGHUP) asks for a drain, like a drain frame,
    so the stage withdraws its record on every way out. Later ones during the drain are logged and
    ignored (the drain has its own deadline). Reports started once the handler is installed: READY is
    printed only after that, so a supervisor's SIGTERM right after READY drains instead of killing."""
    with trio.open_signal_receiver(*stop_signals()) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if server.drain_requested.is_set():
                log.warning("drain.signal_again signal=%s: already draining (--drain-timeout-s bounds it; "
                            "SIGKILL stops at once, without withdrawing)", name)
            else:
                log.warning("drain.signal signal=%s", name)
                server.drain_requested.set()


def emit(line_kind: str, payload: dict) -> None:
    """Print one lifecycle line (``SWARM_STAGE_<KIND> {json}``) to stdout and flush."""
    sys.stdout.write(f"SWARM_STAGE_{line_kind} {json.dumps(payload, sort_keys=True)}\n")
    sys.stdout.flush()


def run_check(config: StageConfig) -> int:
    """``swarm stage --check``: preflight without networking. Prints ``SWARM_STAGE_OK {...}`` and
    returns 0, or ``SWARM_STAGE_FATAL {"reason": ...}`` and returns 2."""
    from swarm.stage.preflight import preflight

    try:
        payload = preflight(config)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 2
    except Exception as exc:  # a model file no check above anticipated: still one line
        log.debug("preflight.crashed", exc_info=True)
        fault = cache_fault(exc)  # the cache a local model is converted into cannot be created or written
        emit("FATAL", {"reason": str(fault) if fault is not None else
                       f"unexpected error while checking: {type(exc).__name__}: {exc}"[:500]})
        return 2
    emit("OK", payload)
    return 0


def run_stage(config: StageConfig) -> int:
    """Load the block, listen, print READY, serve until drained. Returns the exit code.

    Every start-up failure prints ``SWARM_STAGE_FATAL {"reason": ...}`` and returns 1. Once the host
    starts, a stop signal (SIGTERM, Ctrl-C, SIGHUP: ``stop_signals``) or a drain frame from an
    ``--admin`` peer drains (no new sessions; open ones may finish for ``--drain-timeout-s``, then
    fail with "draining"), withdraws the stage's record, prints ``SWARM_STAGE_DRAINED {...}`` and
    returns 0. Ctrl-C while the block still loads (nothing announced yet) stops at once and returns 0.
    """
    from swarm.config import cache_root
    from swarm.model.block import load_block
    from swarm.model.resolve import model_manifest_digest
    from swarm.stage.acquire import acquire_model
    from swarm.transport.identity import claim_key
    from swarm.weights.identify import model_id as weights_model_id

    placed = config.model.layers is None
    try:
        _check_listen(config)  # before the key, the weights and the model: a taken port fails at once
        if config.model.threads:
            torch.set_num_threads(config.model.threads)
        key, _ = claim_key(config.network.key_path, fallback=config.network.key_fallback)
        resolved = acquire_model(config, key)  # a hub id or --fetch-from: only this range's shards, verified
        model_id = weights_model_id(resolved.path, cache_root() / "manifests") if config.membership.bootstrap else None
        if placed:
            config = _placed(config, resolved.path, model_id, key)
            if config.weights.fetch_from:  # placed on the peers' manifest: now fetch that block's shards
                resolved = acquire_model(config, key)
        block = load_block(resolved.path, config.model.layers, dtype=config.model.dtype, device=config.model.device,
                           progress=sys.stderr.isatty(), quantize=config.model.quantize)
        digest = model_manifest_digest(resolved.path)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return exc.exit_code
    except Exception as exc:  # e.g. torch refusing a config no check anticipated: still one line
        log.debug("start.crashed", exc_info=True)
        fault = cache_fault(exc)  # a refused write under the cache (a converted model, a manifest)
        if fault is not None:
            emit("FATAL", {"reason": str(fault)})
            return fault.exit_code
        emit("FATAL", {"reason": f"cannot load layers {config.model.layers}: {type(exc).__name__}: {exc}"[:500]})
        return 1
    try:
        server = StageServer(config, block, resolved.name, digest)
        server.model_id = model_id
        membership = _membership(config, server, model_id, placed)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return exc.exit_code
    try:
        _run_trio(_serve_until_drained, server, key, config, membership)
    except KeyboardInterrupt:
        return 0
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return exc.exit_code
    return 0


def _placed(config: StageConfig, model_dir, model_id: str | None, key) -> StageConfig:
    """The config with the block this stage serves when ``--layers`` was not given: the one it
    moved to (a rebalance's restart), else the one the swarm's DHT shows is needed."""
    from swarm.model.block import model_num_layers
    from swarm.stage.membership import place

    moved = os.environ.get(MOVED_ENV)  # a stage that moved restarts on the block it chose
    layers = LayerRange.parse(moved) if moved else _run_trio(
        place, config, model_dir, model_id, model_num_layers(model_dir), key)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, layers=layers))


def _membership(config: StageConfig, server: StageServer, model_id: str | None, placed: bool):
    """Give the fma kernels the cores; with ``--bootstrap``, the task announcing the stage
    (:func:`swarm.stage.membership.announce`, after measuring its decode throughput), else None."""
    from swarm.stage.membership import announce, measure_decode_tps

    block = server.block
    if block.kernel_mode == "fma":  # the kernels take the cores; torch keeps one for its small ops
        from swarm.kernels import fma

        fma.set_threads(torch.get_num_threads())
        torch.set_num_threads(1)
        server.kernels["threads"] = fma.threads()
        log.info("kernels.threads fma=%d torch=1", fma.threads())
    if not config.membership.bootstrap:
        return None
    tps = measure_decode_tps(block)
    log.info("stage.throughput layers=%s decode_steps_per_s=%.1f", block.layer_range, tps)
    return partial(announce, config=config, model_id=model_id, throughput_tps=tps, placed=placed)


async def _serve_until_drained(server: StageServer, key, config: StageConfig, membership) -> None:
    """Serve, print READY, and on a drain request drain, print DRAINED and leave the process (or
    restart it on the block a rebalance chose)."""
    async with trio.open_nursery() as nursery:
        # before serving: a stop signal while joining the swarm (its first record is published
        # before READY) still drains and withdraws, once READY is out
        await nursery.start(_drain_on_signal, server)
        ready = await nursery.start(partial(serve, server, key, config.network.listen,
                                            announce_addrs=config.membership.announce_addrs, membership=membership,
                                            relays=config.membership.relays, hole_punch=config.membership.hole_punch))
        emit("READY", ready)
        await server.drain_requested.wait()
        if server.announcer is not None:
            # the swarm must see "draining" before the stage goes: a drain with nothing open ends at
            # once, and the exit below would beat the announcer's own republish
            server.draining = True
            with trio.move_on_after(5.0):
                await server.announcer.publish()
        drained = await server.drain(config.admission.drain_timeout_s)
        if server.announcer is not None and server.move_to is not None:
            # a move's last record: the new block as joining, so others do not pick it too (issue 31)
            await server.announcer.move((server.move_to.start, server.move_to.end))
        elif server.announcer is not None:
            # its last record lives seconds: readers stop listing a stage that left at once
            await server.announcer.withdraw()
        emit("DRAINED", drained)
        sys.stderr.flush()
        if server.move_to is not None:  # rebalancing: start again on the new block, same key and flags
            emit("MOVING", {"from": server.block.layer_range.as_list(), "to": server.move_to.as_list()})
            os.environ[MOVED_ENV] = f"{server.move_to.start}:{server.move_to.end}"
            os.execv(sys.executable, [sys.executable, "-m", "swarm", *sys.argv[1:]])
        # every session is finished or failed with a reason: nothing is left to save, and a
        # graceful libp2p shutdown takes seconds, so leave now (a supervisor sees exit 0 at once)
        os._exit(0)


MOVED_ENV = "SWARM_STAGE_MOVED_TO"


def _check_listen(config: StageConfig) -> None:
    """Raise ListenError now if ``--listen`` or ``--metrics-listen`` could not be bound later."""
    from swarm.listen import bind_tcp
    from swarm.transport.host import check_listen_addrs

    check_listen_addrs([config.network.listen], "--listen")
    if config.network.metrics_listen:
        addr, _, port = config.network.metrics_listen.rpartition(":")
        if port.isdigit() and int(port):
            bind_tcp(addr.strip("[]"), int(port), flag="--metrics-listen").close()


def _run_trio(fn, *args):
    """trio.run, with the one SwarmError inside an exception group raised bare."""
    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as group:
        found = collapse(group)
        raise (found if isinstance(found, (SwarmError, KeyboardInterrupt)) else cache_fault(group) or group) from None
    except OSError as exc:
        raise cache_fault(exc) or exc from None

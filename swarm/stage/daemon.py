"""The stage process: the libp2p host around a ``StageServer``, and the daemon's contract.

Owns: ``serve`` (a host listening on ``/swarm/ring/1`` with the frame-size limit, the expiry and
scheduler tasks, the READY payload), ``run_stage`` (``swarm stage``: load the block, print
``SWARM_STAGE_READY {json}`` or ``SWARM_STAGE_FATAL {json}``, serve until Ctrl-C, or until SIGTERM
or a drain frame drains it: ``SWARM_STAGE_DRAINED {json}``, exit 0), ``run_check``
(``swarm stage --check``: ``SWARM_STAGE_OK`` or ``SWARM_STAGE_FATAL``) and ``emit`` (one lifecycle
line on stdout). May import: anything the stage needs (torch, trio, ``swarm.transport``,
``swarm.model``, ``swarm.preflight``, lazily where it can), ``swarm.stage.server``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import trio

from swarm.config import StageConfig
from swarm.errors import SwarmError, collapse
from swarm.stage.server import StageServer
from swarm.wire import PROTOCOL_ID

log = logging.getLogger(__name__)


async def serve(server: StageServer, key, listen: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``server`` on a new libp2p host until cancelled; ``task_status.started`` gets the READY payload."""
    from swarm.transport import open_host

    async with open_host(key, [listen]) as host, trio.open_nursery() as nursery:
        server.host, server.nursery = host, nursery
        server.key = server.key or key
        b = server.block
        # largest legitimate frame: a whole-context prefill of float64 hidden states, with headroom
        max_frame = min(256 << 20, max(16 << 20, 2 * b.max_ctx * b.hidden_size * 8))
        host.set_handler(PROTOCOL_ID, server.handle_stream, max_frame_bytes=max_frame)
        nursery.start_soon(server.expire_idle)
        nursery.start_soon(server.scheduler)
        task_status.started({"peer_id": host.peer_id, "addrs": host.addrs(), "layers": b.layer_range.as_list(),
                             "model": server.model_name, "model_digest": server.model_digest,
                             "max_ctx": b.max_ctx})
        await trio.sleep_forever()


async def _drain_on_sigterm(server: StageServer) -> None:
    """SIGTERM (a supervisor stopping the daemon) asks for a drain, like a drain frame. Later
    SIGTERMs during the drain are logged and ignored (the drain has its own deadline)."""
    import signal

    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            if server.drain_requested.is_set():
                log.warning("drain.sigterm_again: already draining (--drain-timeout-s bounds it)")
            else:
                log.warning("drain.sigterm")
                server.drain_requested.set()


def emit(line_kind: str, payload: dict) -> None:
    """Print one lifecycle line (``SWARM_STAGE_<KIND> {json}``) to stdout and flush."""
    sys.stdout.write(f"SWARM_STAGE_{line_kind} {json.dumps(payload, sort_keys=True)}\n")
    sys.stdout.flush()


def run_check(config: StageConfig) -> int:
    """``swarm stage --check``: preflight without networking. Prints ``SWARM_STAGE_OK {...}`` and
    returns 0, or ``SWARM_STAGE_FATAL {"reason": ...}`` and returns 2."""
    from swarm.preflight import preflight

    try:
        payload = preflight(config)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 2
    except Exception as exc:  # a model file no check above anticipated: still one line
        log.debug("preflight.crashed", exc_info=True)
        emit("FATAL", {"reason": f"unexpected error while checking: {type(exc).__name__}: {exc}"[:500]})
        return 2
    emit("OK", payload)
    return 0


def run_stage(config: StageConfig) -> int:
    """Load the block, listen, print READY, serve until interrupted or drained. Returns the exit code.

    Every start-up failure prints ``SWARM_STAGE_FATAL {"reason": ...}`` and returns 1. SIGTERM or a
    drain frame from an ``--admin`` peer drains (no new sessions; open ones may finish for
    ``--drain-timeout-s``, then fail with "draining"), prints ``SWARM_STAGE_DRAINED {...}`` and
    returns 0. Ctrl-C (SIGINT) stops at once and returns 0.
    """
    from swarm.model.block import load_block
    from swarm.model.resolve import model_manifest_digest, resolve_model
    from swarm.transport import load_or_create_key

    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        key = load_or_create_key(config.key_path)
        resolved = resolve_model(config.model)
        block = load_block(resolved.path, config.layers, dtype=config.dtype, device=config.device,
                           progress=sys.stderr.isatty())
        digest = model_manifest_digest(resolved.path)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 1
    except Exception as exc:  # e.g. torch refusing a config no check anticipated: still one line
        log.debug("start.crashed", exc_info=True)
        emit("FATAL", {"reason": f"cannot load layers {config.layers}: {type(exc).__name__}: {exc}"[:500]})
        return 1
    try:
        server = StageServer(config, block, resolved.name, digest)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ready = await nursery.start(serve, server, key, config.listen)
            emit("READY", ready)
            nursery.start_soon(_drain_on_sigterm, server)
            await server.drain_requested.wait()
            emit("DRAINED", await server.drain(config.drain_timeout_s))
            # every session is finished or failed with a reason: nothing is left to save, and a
            # graceful libp2p shutdown takes seconds, so leave now (a supervisor sees exit 0 at once)
            sys.stderr.flush()
            os._exit(0)

    try:
        try:
            trio.run(main)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    except KeyboardInterrupt:
        return 0
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 1
    return 0

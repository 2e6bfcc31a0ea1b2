"""The ring's health as ``swarm serve`` reports it on ``/health`` and the dashboard.

Owns: ``ring_health``: every stage of the current ring asked for its ``info`` in parallel, with a
short deadline.
"""

from __future__ import annotations

import time

import trio

from swarm import wire
from swarm.errors import SwarmError
from swarm.frames import Info, InfoOk
from swarm.wire import PROTOCOL_ID


async def ring_health(state) -> list[dict]:
    """Ask every stage of the current ring for its info (in parallel, with a short deadline).

    Args:
        state: a ``swarm.serve.state.ServeState`` (its ``ring``, ``host`` and ``config.ring.connect_timeout_s``).
    Returns:
        one dict per stage, in ring order: ``index``, ``layers``, ``addr``, ``peer_id``, ``ok`` and
        either what the stage reported (``latency_ms``, ``max_ctx``, ``sessions``, KV bytes, ``kernels``:
        the mode, ISA and library it runs and why rows, ...) or ``error``.
    """
    results: list[dict] = [{} for _ in state.ring.stages]

    async def one(i, spec):
        entry = {"index": i, "layers": [spec.layers.start, spec.layers.end], "addr": spec.addr,
                 "peer_id": spec.peer_id, "ok": False}
        t0 = time.perf_counter()
        try:
            with trio.fail_after(min(5.0, state.config.ring.connect_timeout_s)):
                s = await state.host.open_stream(spec.addr, PROTOCOL_ID, timeout_s=state.config.ring.connect_timeout_s)
                try:
                    await s.send(Info())
                    msg = wire.validate(await s.recv())
                finally:
                    await s.aclose()
            entry.update(ok=isinstance(msg, InfoOk) and msg.peer_id == spec.peer_id
                         and not msg.draining, latency_ms=round((time.perf_counter() - t0) * 1000, 1),
                         **{k: getattr(msg, k, None) for k in ("max_ctx", "sessions", "kv_bytes", "kv_reserved_bytes",
                                                    "draining", "batching", "prefix_cache", "kernels")})
        except (SwarmError, trio.TooSlowError) as exc:
            entry["error"] = str(exc) or "no answer within 5 s"
        results[i] = entry

    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(state.ring.stages):
            nursery.start_soon(one, i, spec)
    return results

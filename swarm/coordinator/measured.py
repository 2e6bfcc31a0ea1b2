"""What this client measured of the stages it routed through: per PeerId, compute ms per layer per decode step.

Owns: ``measured-stages.json`` in the cache root (per model id, then PeerId), a finished session's timing turned
into per-stage figures (``swarm.routing.attribute_round_ms``) and handed to routing over the stages' claims
(issue 45 item 17); figures expire after ``MEASURED_TTL_S``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from swarm.routing import attribute_round_ms

log = logging.getLogger(__name__)

MEASURED_TTL_S = 3600.0  # a figure older than this is forgotten
MEASURED_MAX_PEERS = 2000  # per model: the oldest figures go first
MIN_ROUNDS = 2  # a session with fewer decode rounds measures nothing
EWMA_WEIGHT = 0.5  # a new figure's weight against the one kept


def measured_path() -> Path:
    """``measured-stages.json`` in the cache root."""
    from swarm.config import cache_root

    return cache_root() / "measured-stages.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or torn: nothing measured (routing falls back to bounded claims)
    return data if isinstance(data, dict) else {}


def _valid(entry) -> bool:
    return (isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in ("layer_ms", "at"))
            and math.isfinite(entry["layer_ms"]) and entry["layer_ms"] > 0 and math.isfinite(entry["at"]))


def load_measured(model_id: str, *, now: float | None = None, path: Path | None = None) -> dict[str, float]:
    """This client's unexpired measurements of a model's stages, PeerId -> ms per layer per decode step
    ({} when the file is missing or unreadable; malformed entries are skipped)."""
    now = time.time() if now is None else now
    peers = _read(path or measured_path()).get(model_id, {})
    if not isinstance(peers, dict):
        return {}
    return {p: float(e["layer_ms"]) for p, e in peers.items()
            if isinstance(p, str) and _valid(e) and now - e["at"] < MEASURED_TTL_S}


def record_measured(model_id: str, figures: Mapping[str, float], *, now: float | None = None,
                    path: Path | None = None) -> dict[str, float]:
    """Fold new figures (PeerId -> ms per layer) into the file: each kept figure moves ``EWMA_WEIGHT`` of the
    way to the new one (an expired one is replaced). Written atomically; an unwritable cache only logs.

    Returns:
        the figures now kept for these PeerIds.
    """
    now = time.time() if now is None else now
    path = path or measured_path()
    data = _read(path)
    peers = data.get(model_id) if isinstance(data.get(model_id), dict) else {}
    kept = {}
    for peer, ms in figures.items():
        old = peers.get(peer)
        if _valid(old) and now - old["at"] < MEASURED_TTL_S:
            ms = (1 - EWMA_WEIGHT) * old["layer_ms"] + EWMA_WEIGHT * ms
        peers[peer] = {"layer_ms": round(ms, 4), "at": now}
        kept[peer] = peers[peer]["layer_ms"]
    fresh = sorted(((p, e) for p, e in peers.items() if _valid(e) and now - e["at"] < MEASURED_TTL_S),
                   key=lambda pe: -pe[1]["at"])
    data[model_id] = dict(fresh[:MEASURED_MAX_PEERS])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("measured.unwritable path=%s reason=%s: this session's stage timings are not kept", path, exc)
    return kept


def note_session(model_id: str, hops: Sequence[tuple[str, tuple[int, int]]], client_rtt_ms: Mapping[str, float],
                 decoded, *, path: Path | None = None) -> dict[str, float]:
    """Measure the stages of a finished session from its timing and keep the figures.

    One decode round's wall time is the decode time (first to last new token) / the decode rounds; the
    network's share is the client's RTT estimate of each hop (half in, half out of the ring). With depth
    > 1 rounds overlap, so the figure is what the route delivered per round, not one round's latency.

    Args:
        model_id: the model's 64-hex id. hops: ``(PeerId, [start, end))`` of the ring that ran the session.
        client_rtt_ms: the client's RTTs measured when routing, PeerId -> ms.
        decoded: the session's ``DecodeResult``.
    Returns:
        PeerId -> kept ms per layer ({} when the session measures nothing: a heal changed the ring,
        fewer than ``MIN_ROUNDS`` decode rounds, or no decode rate).
    """
    rounds = decoded.spec.get("rounds", 0)
    if decoded.heal_events or rounds < MIN_ROUNDS or not decoded.tokens_per_s or not hops:
        return {}
    decode_ms = 1000.0 * (len(decoded.output_ids) - 1) / decoded.tokens_per_s
    network_ms = sum(client_rtt_ms.get(p, 0.0) / 2 for p, _ in hops) + client_rtt_ms.get(hops[-1][0], 0.0) / 2
    figures = attribute_round_ms(hops, decode_ms / rounds, network_ms)
    kept = record_measured(model_id, figures, path=path)
    log.info("measured.session model=%s round_ms=%.2f network_ms=%.2f layer_ms=%s", model_id[:16], decode_ms / rounds,
             network_ms, {p[-8:]: round(ms, 3) for p, ms in kept.items()})
    return kept

"""Signed stage records for the discovery tests."""

from __future__ import annotations

import time

from swarm.discovery.records import StageRecord, sign_record
from swarm.transport.identity import peer_id_of

MODEL = "ab" * 32
OTHER = "cd" * 32


def signed_record(key, model=MODEL, layers=(0, 3), seq=1, ttl=120.0, **over):
    """A signed StageRecord of ``key``'s peer for ``model`` (fields overridable), expiring in ``ttl`` seconds."""
    pid = peer_id_of(key)
    rec = StageRecord(peer_id=pid, model_id=model, model_name="m", num_layers=5, layers=layers,
                      addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), seq=seq, expires_at=time.time() + ttl, **over)
    return sign_record(key, rec)

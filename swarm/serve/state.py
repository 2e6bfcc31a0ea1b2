"""``ServeState``: what every request of ``swarm serve`` shares while the server runs.

Owns: the ring (replaced when a request healed it or the pool rerouted), the host and nursery, whom routing shuts
out, the tokenizer and the model as the ring reported it, the settings, the client pool, metrics, and the
request lifecycle's counters (requests in flight, the drain).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.config import RingSpec
from swarm.serve.config import ServeConfig

if TYPE_CHECKING:
    import trio
    from libp2p.crypto.keys import KeyPair
    from transformers import PreTrainedTokenizerBase

    from swarm.auditor.exclusions import Exclusions
    from swarm.coordinator.routing import RouteContext
    from swarm.serve.dashboard import SwarmCoverage
    from swarm.serve.metrics import ServeMetrics
    from swarm.serve.pool import ClientPool
    from swarm.transport.host import SwarmHost


@dataclass
class ServeState:
    """What every request shares: the ring, the host, the tokenizer, the settings.

    The fields up to ``max_ctx`` come from loading the model and checking the ring; ``pool``,
    ``metrics`` and ``coverage`` are set by ``serve_api`` before it listens; the rest change while
    it serves.
    """

    config: ServeConfig
    ring: RingSpec
    host: SwarmHost | None  # None only in tests that answer every request before the ring is used
    nursery: trio.Nursery | None  # the server's: streams run their generation in it
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    model_dir: Path | None
    num_layers: int
    model_digest: str
    stop_ids: set[int]
    max_ctx: int
    vocab_size: int = 0
    key: KeyPair | None = None  # this server's node key (its PeerId; signs the job receipts)
    # the route's DHT, weights id, records and RTTs when the ring was routed from the swarm's DHT
    discovery: RouteContext | None = None
    max_prompt_chars: int = 0  # a longer prompt cannot fit max_ctx (refused before tokenizing); 0: unchecked
    pool: ClientPool | None = None
    metrics: ServeMetrics | None = None
    coverage: SwarmCoverage | None = None  # the DHT's records, read in the background (with discovery)
    # with discovery: the stages with a fraud proof re-run on this server's weights (never routed to)
    shut_out: Exclusions | None = None
    active: int = 0  # requests on the ring now
    served: int = 0  # requests that ran on the ring so far
    cached_tokens: int = 0  # prompt positions all requests so far took from the prefix caches
    draining: bool = False  # set by a drain: new requests are refused (503)
    # request id -> ends it now (a drain's deadline passed)
    requests: dict[str, Callable[[], None]] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))  # unix time the model was loaded and served

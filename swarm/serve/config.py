"""``ServeConfig``: everything ``swarm serve`` is told, as one frozen object validated on construction.

Owns: the settings of ``serve_api`` (where it listens, its identity, the ring client's deadlines,
speculation, receipts, the request lifecycle's limits, CORS) and their defaults and checks; the
messages name the command-line flags they come from.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from swarm.config import SpecConfig
from swarm.errors import ConfigError

DEFAULT_MAX_BODY_MB = 8.0  # --max-body-mb: a text prompt that fits any ring's context is far smaller
DEFAULT_KEEPALIVE_S = 15.0  # --keepalive-s: under the idle timeouts of common proxies (nginx 60 s, ALB 60 s)
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # --drain-timeout-s, as the stages'
DEFAULT_HEADER_TIMEOUT_S = 10.0  # --header-timeout-s: a request line and headers are a few hundred bytes
DEFAULT_BODY_TIMEOUT_S = 60.0  # --body-timeout-s: --max-body-mb's 8 MiB at ~1 Mbit/s
DEFAULT_SEND_TIMEOUT_S = 60.0  # --send-timeout-s: a client that read none of its answer this long is gone


@dataclass(frozen=True)
class ServeConfig:
    """The settings of ``swarm serve`` (``serve_api``).

    Args:
        host, port: where the API listens (port 0: a free one).
        key_path: the coordinator's node key; None: ``$SWARM_CACHE/keys/coordinator.key`` (or the
            first free ``coordinator-N.key``).
        spec: speculation and prefill chunking of every request.
        wire_dtype: the dtype hidden states travel in (None: each stage's own).
        hop_timeout_s, connect_timeout_s, heartbeat_s: the ring clients' deadlines and heartbeat, seconds.
        max_concurrency: requests on the ring at once (one ring client each); more wait for a slot.
        bootstrap: route through the swarm joined at these multiaddrs instead of a ring file's stages.
        prefix_cache: offer prompts to the stages' prefix caches.
        receipt_dir: every request runs as a job whose signed receipt is saved there; None: no receipts.
        dashboard_receipts: the receipt directory the dashboard lists (default: ``receipt_dir``).
        keepalive_s: an idle stream sends an SSE comment this often; a queued stream gets its 200
            after this long (0: never).
        max_body_mb: a larger request body is refused (413) unread, MiB.
        drain_timeout_s: on SIGTERM, how long requests in flight may finish.
        cors_origins: browser origins (``scheme://host[:port]`` or ``*``) allowed to call the API.
        audit_tally: an auditor's tally file (``--audits``; ``swarm.auditor.tally``): the dashboard shows
            audited / passed / failed per stage.
        header_timeout_s: a connection's request line and headers are due this long after it opens or
            after its previous answer (also the idle keep-alive timeout), seconds.
        body_timeout_s: a request's body is due this long after its headers, else 408, seconds.
        send_timeout_s: one write of an answer must complete within this, else the connection is closed
            (the client stopped reading; its generation stops), seconds.
        max_connections: client connections open at once (None: the open-file limit less headroom for
            the ring, receipts and heals: ``swarm.serve.guard.default_max_connections``).
    Raises:
        ConfigError: a value out of range, naming its flag.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    key_path: Path | None = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    wire_dtype: str | None = None
    hop_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    max_concurrency: int = 16
    bootstrap: tuple[str, ...] = ()
    prefix_cache: bool = True
    receipt_dir: Path | None = None
    dashboard_receipts: Path | None = None
    keepalive_s: float = DEFAULT_KEEPALIVE_S
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    cors_origins: tuple[str, ...] = ()
    audit_tally: Path | None = None
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    max_connections: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        for flag, value in (("--keepalive-s", self.keepalive_s), ("--drain-timeout-s", self.drain_timeout_s)):
            if not value >= 0 or value == math.inf:  # also refuses NaN
                raise ConfigError(f"{flag} must be a number >= 0, got {value}")
        if not 0 < self.max_body_mb < math.inf:
            raise ConfigError(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        for name in ("hop_timeout_s", "connect_timeout_s", "heartbeat_s", "header_timeout_s", "body_timeout_s",
                     "send_timeout_s"):
            value = getattr(self, name)
            # a deadline a trickle (or a reader that stalls) cannot outlast
            finite = name in ("header_timeout_s", "body_timeout_s", "send_timeout_s")
            if not value > 0 or finite and value == math.inf:  # also refuses NaN
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
        object.__setattr__(self, "bootstrap", tuple(self.bootstrap))
        object.__setattr__(self, "cors_origins", check_origins(self.cors_origins))

    @property
    def max_body_bytes(self) -> int:
        """``max_body_mb`` in bytes: a larger request body is refused (413) unread."""
        return int(self.max_body_mb * 2**20)

    @property
    def listed_receipts(self) -> Path | None:
        """The receipt directory the dashboard lists: ``dashboard_receipts``, else ``receipt_dir``."""
        return self.dashboard_receipts or self.receipt_dir


def check_origins(origins) -> tuple[str, ...]:
    """``--cors-origin`` values, checked: each ``*`` or an origin ``scheme://host[:port]``.

    Raises:
        ConfigError: a value that is not an origin (a path, a trailing slash, no scheme), which a
            browser would never send, so it would silently allow nothing.
    """
    out = []
    for o in origins:
        if o != "*" and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#\s]+", o):
            raise ConfigError(f"--cors-origin {o!r} is not an origin: give scheme://host[:port] (no path, "
                              "no trailing slash), e.g. https://app.example.com, or * for any")
        out.append(o)
    return tuple(out)

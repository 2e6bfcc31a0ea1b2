"""``ServeConfig``: everything ``swarm serve`` is told, as one frozen object validated on construction.

Owns: the settings of ``serve_api`` in sections (``listen``, ``ring``, ``lifecycle``, ``receipts``), each field
with its default, check and flag (``swarm.flags``); the messages name the flags.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from swarm.config import SpecConfig
from swarm.errors import ConfigError
from swarm.flags import add_sections, build, option

DEFAULT_MAX_BODY_MB = 8.0  # --max-body-mb: a text prompt that fits any ring's context is far smaller
DEFAULT_KEEPALIVE_S = 15.0  # --keepalive-s: under the idle timeouts of common proxies (nginx 60 s, ALB 60 s)
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # --drain-timeout-s, as the stages'
DEFAULT_HEADER_TIMEOUT_S = 10.0  # --header-timeout-s: a request line and headers are a few hundred bytes
DEFAULT_BODY_TIMEOUT_S = 60.0  # --body-timeout-s: --max-body-mb's 8 MiB at ~1 Mbit/s
DEFAULT_SEND_TIMEOUT_S = 60.0  # --send-timeout-s: a client that read none of its answer this long is gone


PREFIX_HELP = ("do not offer prompts to the stages' prefix caches (by default a prompt that starts like an earlier "
               "one of this coordinator's, e.g. a conversation's next turn, prefills only what is new; the output is "
               "the same bits either way)")
WIRE_DTYPES = ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn")
WIRE_DTYPE_HELP = ("dtype of hidden states between stages (default: the stages' own). Narrower is lossy (opt-in; "
                   "recorded as wire_lossy in --json); float8 carries a scale per position")


def _seconds(flag: str, value, *, finite: bool = False, zero_ok: bool = False) -> None:
    """ConfigError unless ``value`` is a number of seconds > 0 (>= 0 with ``zero_ok``; finite with
    ``finite``); also refuses NaN."""
    if zero_ok:
        if not value >= 0 or value == math.inf:
            raise ConfigError(f"{flag} must be a number >= 0, got {value}")
    elif not value > 0 or finite and value == math.inf:
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")


@dataclass(frozen=True)
class ListenSection:
    """Where the API listens, the node's identity, and which browser origins may call it."""

    host: str = option("127.0.0.1", "address to listen on (default 127.0.0.1, loopback only)")
    port: int = option(8000, "port (default 8000; 0 picks a free one)")
    key_path: Path | None = option(None, "coordinator identity key (default: $SWARM_CACHE/keys/coordinator.key, or "
                                         "the first free coordinator-N.key beside it)", flag="--key")
    cors_origins: tuple[str, ...] = option(
        (), "let web pages on ORIGIN (scheme://host[:port], or * for any) call the API from a browser: CORS headers "
            "and preflight answers (repeatable; default none: same origin only)", flag="--cors-origin",
        metavar="ORIGIN")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        object.__setattr__(self, "cors_origins", check_origins(self.cors_origins))


@dataclass(frozen=True)
class RingSection:
    """How requests go round the ring: its clients' deadlines, how many at once, the route, speculation."""

    hop_timeout_s: float = option(60.0, "longest wait for one result while every stage still answers heartbeats "
                                        "(default 60)")
    connect_timeout_s: float = 10.0  # deadline for dialing a stage
    heartbeat_s: float = option(1.0, "after this much silence stages are probed; one that does not answer within "
                                     "twice it is treated as lost and healed onto a spare (default 1.0)")
    max_concurrency: int = option(16, "requests on the ring at once; more wait for a free slot (default 16)")
    bootstrap: tuple[str, ...] = option((), "route through the swarm joined at this bootstrap node (repeatable)",
                                        metavar="MULTIADDR")
    prefix_cache: bool = option(True, PREFIX_HELP, negate="--no-prefix-cache")
    wire_dtype: str | None = option(None, WIRE_DTYPE_HELP, choices=WIRE_DTYPES)
    spec: SpecConfig = field(default_factory=SpecConfig)  # its flags: `swarm serve`'s speculative decoding group

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        for name in ("hop_timeout_s", "connect_timeout_s", "heartbeat_s"):
            _seconds(f"--{name.replace('_', '-')}", getattr(self, name))
        object.__setattr__(self, "bootstrap", tuple(self.bootstrap))


@dataclass(frozen=True)
class LifecycleSection:
    """A request's life: its body's size, the deadlines of a slow client, keep-alives, the drain."""

    TITLE = "request lifecycle"

    keepalive_s: float = option(
        DEFAULT_KEEPALIVE_S, "a stream that waits (queued, a long prefill) sends an SSE comment this often, so proxies "
                             "do not cut it as idle; a queued stream gets its 200 after this long (default 15; 0: "
                             "never)")
    max_body_mb: float = option(DEFAULT_MAX_BODY_MB, "refuse larger request bodies (413) before parsing them "
                                                     "(default 8)")
    header_timeout_s: float = option(
        DEFAULT_HEADER_TIMEOUT_S, "close a connection whose request line and headers are not in this long after it "
                                  "opened or after its previous answer (slow headers, idle keep-alive) (default 10)")
    body_timeout_s: float = option(
        DEFAULT_BODY_TIMEOUT_S, "answer 408 and close a connection whose request body is not in this long after its "
                                "headers, however steadily it trickles (default 60)")
    send_timeout_s: float = option(
        DEFAULT_SEND_TIMEOUT_S, "close a connection one of whose answer's writes cannot complete this long (the "
                                "client read none of it meanwhile); its generation stops as if it hung up (default 60)")
    max_connections: int | None = option(
        None, "client connections open at once; at the cap the oldest one still sending its request (or idle) is "
              "closed for a new one, so /health and new requests still get in (default: the open-file limit less "
              "max(128, a quarter of it) kept for the ring, receipts and heals, e.g. 128 under ulimit -n 256, at "
              "most 4096)")
    drain_timeout_s: float = option(
        DEFAULT_DRAIN_TIMEOUT_S, "on SIGTERM: refuse new requests (503), let open ones finish this long, then end the "
                                 "rest (streams with an error event and [DONE]) and exit 0 (default 30); Ctrl-C ends "
                                 "them at once, a second Ctrl-C stops without that")

    def __post_init__(self) -> None:
        for flag, value in (("--keepalive-s", self.keepalive_s), ("--drain-timeout-s", self.drain_timeout_s)):
            _seconds(flag, value, zero_ok=True)
        if not 0 < self.max_body_mb < math.inf:
            raise ConfigError(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s"):
            # a deadline a trickle (or a reader that stalls) cannot outlast
            _seconds(f"--{name.replace('_', '-')}", getattr(self, name), finite=True)

    @property
    def max_body_bytes(self) -> int:
        """``max_body_mb`` in bytes: a larger request body is refused (413) unread."""
        return int(self.max_body_mb * 2**20)


@dataclass(frozen=True)
class ReceiptsSection:
    """Receipts of the requests served, and what the dashboard lists."""

    receipt_dir: Path | None = option(
        None, "run every request as a job and save its signed job receipt (who computed what) to DIR/<job_id>.json, "
              "verified at once and counted in /metrics; costs one more round per request to collect the stages' "
              "receipts (default: no receipts)", metavar="DIR")
    dashboard_receipts: Path | None = option(
        None, "list the job receipts in DIR (verified or failed, and which check) on /dashboard (default: "
              "--receipt-dir)", metavar="DIR")
    audit_tally: Path | None = option(
        None, "an auditor's tally (`swarm audit run --tally FILE`): /dashboard shows audited / passed / failed per "
              "stage, next to the state of the fraud proof against it", flag="--audits", metavar="FILE")

    @property
    def listed_receipts(self) -> Path | None:
        """The receipt directory the dashboard lists: ``dashboard_receipts``, else ``receipt_dir``."""
        return self.dashboard_receipts or self.receipt_dir


@dataclass(frozen=True)
class ServeConfig:
    """The settings of ``swarm serve`` (``serve_api``), in sections; each part of the server reads its
    own. ``ServeConfig()`` is the defaults; ``of`` builds one from flat field names, ``from_args`` from
    the flags ``add_cli_args`` declares.

    Raises:
        ConfigError: a value out of range, naming its flag.
    """

    listen: ListenSection = field(default_factory=ListenSection)
    ring: RingSection = field(default_factory=RingSection)
    lifecycle: LifecycleSection = field(default_factory=LifecycleSection)
    receipts: ReceiptsSection = field(default_factory=ReceiptsSection)

    @classmethod
    def of(cls, **flat) -> ServeConfig:
        """A ServeConfig from flat field names (``ServeConfig.of(port=0, max_concurrency=4)``).

        Raises:
            ConfigError: a value its section refuses. TypeError: a name no section declares.
        """
        return build(cls, flat)

    @staticmethod
    def add_cli_args(parser) -> dict:
        """Every section's flags on ``swarm serve``'s parser; returns where each section's went."""
        return add_sections(parser, ServeConfig)

    @classmethod
    def from_args(cls, args, **overrides) -> ServeConfig:
        """From ``swarm serve``'s parsed flags; ``overrides`` (flat field names: ``spec``) set the fields no
        flag gives. Raises as ``of`` does."""
        return build(cls, overrides, args)


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

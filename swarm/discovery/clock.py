"""Swarm time: this node's wall clock corrected by its offset from the swarm's, measured against peers.

Owns: the time protocol ``/swarm/time/1.0.0`` (``serve_time``), ``measure_offsets`` (Cristian's algorithm against
the nodes joined through; the median wins), ``SwarmClock`` (the clock records are stamped and checked with) and
``local_clock`` (which the tests skew with ``SWARM_CLOCK_SKEW_S``). Why: docs/architecture.md.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import trio

from swarm.errors import SwarmError

log = logging.getLogger(__name__)

PROTOCOL_ID = "/swarm/time/1.0.0"
SKEW_ENV = "SWARM_CLOCK_SKEW_S"
WARN_OFFSET_S = 10.0  # an offset this large is logged as a warning (the clock needs fixing)
RESYNC_S = 600.0  # a long-running node re-measures this often (clocks drift, NTP steps them)


def local_clock() -> float:
    """This machine's unix time in seconds, shifted by ``$SWARM_CLOCK_SKEW_S`` (tests only)."""
    return time.time() + _skew_s()


def _skew_s() -> float:
    raw = os.environ.get(SKEW_ENV)
    if not raw:
        return 0.0
    try:
        skew = float(raw)
    except ValueError:
        return 0.0
    return skew if math.isfinite(skew) else 0.0


class SwarmClock:
    """The swarm's time as this node knows it: ``local() + offset_s``; call it for unix seconds.

    Args:
        local: this machine's unix time (``local_clock``; tests pass their own).
    Attributes:
        offset_s: seconds added to ``local()`` (0 until measured).
        peers: how many nodes answered the last measurement (0: never measured; the local clock
            is then taken as the swarm's).
        measured_at: ``time.monotonic()`` of the last measurement, or None.
    """

    def __init__(self, local: Callable[[], float] = local_clock):
        self.local = local
        self.offset_s = 0.0
        self.peers = 0
        self.measured_at: float | None = None

    def __call__(self) -> float:
        return self.local() + self.offset_s

    def describe(self) -> str:
        """One phrase for logs: how far this node's clock is from the swarm's, and how that is known."""
        if not self.peers:
            return "the swarm's time could not be measured (no bootstrap node answered /swarm/time/1.0.0)"
        side = "behind" if self.offset_s > 0 else "ahead of"
        return (f"this node's clock is {abs(self.offset_s):.1f} s {side} the swarm's "
                f"(measured against {self.peers} node(s))")

    def set_offset(self, offsets: Sequence[float]) -> None:
        """Adopt the median of measured offsets (seconds to add to ``local()``); none: keep the old."""
        if not offsets:
            return
        self.offset_s = float(statistics.median(offsets))
        self.peers = len(offsets)
        self.measured_at = time.monotonic()
        if abs(self.offset_s) >= WARN_OFFSET_S:
            log.warning("clock.offset %s; records are stamped and checked in the swarm's time, "
                        "but fix this machine's clock (NTP)", self.describe())
        else:
            log.info("clock.offset offset_s=%.3f peers=%d", self.offset_s, self.peers)


def serve_time(host, clock: Callable[[], float]) -> None:
    """Answer time requests on ``host`` (a running SwarmHost) with ``clock()``.

    Request ``{"type": "time"}``; answer ``{"type": "time_ok", "unix_s": float}``, or
    ``{"type": "error", "reason"}`` for anything else.
    """

    async def handle(stream) -> None:
        msg = await stream.recv(timeout_s=10.0)
        if not (isinstance(msg, dict) and msg.get("type") == "time"):
            await stream.send({"type": "error", "reason": "a time request is {\"type\": \"time\"}"})
            return
        await stream.send({"type": "time_ok", "unix_s": float(clock())})

    host.set_handler(PROTOCOL_ID, handle)


async def measure_offsets(host, addrs: Sequence[str], local: Callable[[], float], *,
                          timeout_s: float = 3.0) -> list[float]:
    """Ask each node in ``addrs`` for its time, concurrently; return the offsets of those that answer.

    Args:
        host: this node's running SwarmHost.
        addrs: multiaddrs with ``/p2p/<PeerId>`` of nodes serving ``PROTOCOL_ID``.
        local: this node's unix clock.
        timeout_s: deadline per node (dial and answer), in seconds.
    Returns:
        Seconds to add to ``local()`` to get each answering node's time (its answer minus our
        clock at the midpoint of the round trip); nodes that fail or lie about the type are left out.
    """
    out: list[float] = []

    async def one(addr: str) -> None:
        try:
            with trio.fail_after(timeout_s):
                stream = await host.open_stream(addr, PROTOCOL_ID, timeout_s=timeout_s)
                try:
                    sent_unix, sent = local(), time.monotonic()
                    await stream.send({"type": "time"})
                    msg = await stream.recv(timeout_s=timeout_s)
                    rtt_s = time.monotonic() - sent
                finally:
                    await stream.aclose()
        except (trio.TooSlowError, SwarmError) as e:
            log.info("clock.ask_failed addr=%s error=%s", addr, e)
            return
        theirs = msg.get("unix_s") if isinstance(msg, dict) and msg.get("type") == "time_ok" else None
        if isinstance(theirs, (int, float)) and not isinstance(theirs, bool) and math.isfinite(theirs):
            out.append(float(theirs) - (sent_unix + rtt_s / 2))
        else:
            log.info("clock.bad_answer addr=%s answer=%.120s", addr, msg)

    async with trio.open_nursery() as nursery:
        for addr in dict.fromkeys(addrs):
            nursery.start_soon(one, addr)
    return out


async def sync_offset(clock, host, addrs: Sequence[str], max_age_s: float = 0.0) -> None:
    """Measure ``clock``'s offset (a ``SwarmClock``; any other clock is left alone) against the nodes
    ``addrs`` (``measure_offsets``), unless its last measurement is younger than ``max_age_s``
    seconds; no answer keeps the old offset."""
    if not isinstance(clock, SwarmClock) or not addrs:
        return
    if clock.measured_at is not None and time.monotonic() - clock.measured_at < max_age_s:
        return
    clock.set_offset(await measure_offsets(host, addrs, clock.local))

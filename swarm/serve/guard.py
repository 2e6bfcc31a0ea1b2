"""Slow, idle and too many HTTP clients, bounded: what keeps ``swarm serve`` answering under a trickle.

Owns: ``serve_http`` (hypercorn's trio worker over a ``CappedListener`` of at most ``max_connections``),
``guard_app`` (a body due within ``body_timeout_s`` of its headers, else 408), ``default_max_connections`` and
``RateLog`` (one log line per condition). Which deadline bounds which attack: docs/architecture.md.
"""

from __future__ import annotations

import errno
import logging
import math
import resource
import socket
import time
from functools import partial

import trio

from swarm.serve.requests import ApiError

log = logging.getLogger(__name__)

FD_HEADROOM = 128  # descriptors kept for the ring (libp2p connections, heal dials), receipts, the model's files
CONNECTIONS_CEILING = 4096  # the default cap where the open-file limit is huge or unlimited
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = (0.1, 2.0)  # first and last wait after an accept that found no descriptor (doubling)


def default_max_connections(soft_limit: int | None = None) -> int:
    """The default ``--max-connections``: the open-file limit less ``FD_HEADROOM`` (or a quarter of the
    limit, whichever is more), at least 16 and at most ``CONNECTIONS_CEILING``.

    Args:
        soft_limit: RLIMIT_NOFILE's soft limit (None: this process's; ``RLIM_INFINITY``: no limit).
    Returns:
        A number of client connections, e.g. 128 under ``ulimit -n 256``, 768 under 1024.
    """
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return CONNECTIONS_CEILING
    return max(16, min(CONNECTIONS_CEILING, soft_limit - max(FD_HEADROOM, soft_limit // 4)))


class RateLog:
    """One log line per condition: the first occurrence of a ``key`` is logged, the next ones within
    ``interval_s`` are only counted, and the first after it says how many there were."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0, clock=time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args) -> bool:
        """Log ``msg % args`` (plus ``repeats=N`` skipped since the last line) unless ``key`` was
        logged within ``interval_s``; returns whether it was."""
        now = self.clock()
        if key in self.last and now - self.last[key] < self.interval_s:
            self.skipped[key] = self.skipped.get(key, 0) + 1
            return False
        self.last[key] = now
        repeats = self.skipped.pop(key, 0)
        self.logger.log(level, msg + (" repeats=%d" if repeats else ""), *args, *((repeats,) if repeats else ()))
        return True


class BodyTimeout(ApiError):
    """A request body that did not arrive within ``--body-timeout-s`` of its headers (408)."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s of its headers "
                              "(--body-timeout-s)", None, "request_timeout")


class GuardedStream(trio.abc.HalfCloseableStream):
    """One client connection of a ``CappedListener``: a trio ``SocketStream`` that gives its slot back
    when closed. ``busy``: a request's body is in and the app is answering it (not evicted at the cap)."""

    def __init__(self, stream: trio.SocketStream, owner: CappedListener):
        self.stream, self.owner = stream, owner
        self.socket = stream.socket  # hypercorn reads the peer's and our address from it
        self.busy = False
        try:
            self.peer = _addr_key(stream.socket.getpeername())
        except OSError:  # gone already
            self.peer = None

    async def send_all(self, data) -> None:
        """Write ``data``; one that the client does not take within the listener's ``send_timeout_s``
        closes the connection and raises ``trio.BrokenResourceError`` (hypercorn: the client is gone)."""
        timeout_s = self.owner.send_timeout_s
        with trio.move_on_after(timeout_s) as scope:
            await self.stream.send_all(data)
        if scope.cancelled_caught:
            self.owner.rate_log.log(logging.WARNING, "send_timeout",
                                    "http.send_timeout client=%s timeout_s=%g: the client read none of its answer "
                                    "for that long (--send-timeout-s); connection closed", self.peer, timeout_s)
            await self.aclose()
            raise trio.BrokenResourceError(f"the client read nothing for {timeout_s:g} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        self.owner.release(self)
        await self.stream.aclose()


def _addr_key(addr) -> tuple | None:
    """(host, port) of a socket address, as hypercorn puts it in the ASGI scope's ``client``."""
    if isinstance(addr, (tuple, list)) and len(addr) >= 2:
        return str(addr[0]), int(addr[1])
    return None


class CappedListener(trio.abc.Listener):
    """A ``trio.SocketListener`` that keeps at most ``max_connections`` client connections open.

    At the cap, once a newcomer waits in the backlog, the oldest connection that is not ``busy``
    (sending its headers or body, or idle between requests) is closed to make room; with every one
    busy, newcomers wait in the backlog until one ends. An accept that fails for lack of descriptors
    (``EMFILE``, ``ENFILE``) closes such a connection too, or waits (0.1 s doubling to 2 s) for one
    to end; each condition is logged once per minute, never a traceback per try.
    """

    def __init__(self, inner: trio.SocketListener, max_connections: int, rate_log: RateLog | None = None,
                 send_timeout_s: float = math.inf):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.inner, self.max_connections = inner, max_connections
        self.send_timeout_s = send_timeout_s  # one write to a client must complete within this, seconds
        self.socket = inner.socket
        self.open: dict[int, GuardedStream] = {}  # in accept order: the first is the oldest
        self.by_peer: dict[tuple, GuardedStream] = {}
        self.rate_log = rate_log or RateLog(log)
        self.evicted = 0
        self._released = trio.Event()

    def release(self, conn: GuardedStream) -> None:
        """``conn`` closed: its slot is free."""
        if self.open.pop(id(conn), None) is not None:
            if self.by_peer.get(conn.peer) is conn:
                del self.by_peer[conn.peer]
            self._released.set()
            self._released = trio.Event()

    def find(self, peer) -> GuardedStream | None:
        """The open connection from ``peer`` ((host, port), as in an ASGI scope's ``client``)."""
        key = _addr_key(peer)
        return self.by_peer.get(key) if key is not None else None

    async def _evict_one(self, why: str) -> bool:
        """Close the oldest connection that is not busy; False when all are busy."""
        victim = next((c for c in self.open.values() if not c.busy), None)
        if victim is None:
            return False
        self.evicted += 1
        self.rate_log.log(logging.WARNING, "evict:" + why,
                          "http.connection_evicted why=%s open=%d max_connections=%d (the oldest connection still "
                          "sending its request or idle was closed for a new one)", why, len(self.open),
                          self.max_connections)
        await victim.aclose()
        return True

    async def _arrival_or_release(self) -> bool:
        """Wait until a newcomer waits in the backlog (True) or one of ours closed (False)."""
        released, arrived = self._released, False
        async with trio.open_nursery() as nursery:
            async def arrival():
                nonlocal arrived
                await trio.lowlevel.wait_readable(self.inner.socket)
                arrived = True
                nursery.cancel_scope.cancel()

            async def release():
                await released.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(arrival)
            nursery.start_soon(release)
        return arrived

    async def accept(self) -> GuardedStream:
        backoff_s = ACCEPT_BACKOFF_S[0]
        while True:
            if len(self.open) >= self.max_connections:
                if not await self._arrival_or_release():
                    continue
                if not await self._evict_one("max_connections"):
                    self.rate_log.log(logging.WARNING, "full",
                                      "http.connections_full open=%d max_connections=%d: every connection is answering "
                                      "a request; new ones wait in the backlog", len(self.open), self.max_connections)
                    await self._released.wait()
                continue
            try:
                stream = await self.inner.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                self.rate_log.log(logging.ERROR, "accept:" + errno.errorcode[exc.errno],
                                  "http.accept_failed errno=%s open=%d max_connections=%d: the process is out of file "
                                  "descriptors (%s); closing idle client connections and waiting, lower "
                                  "--max-connections or raise ulimit -n", errno.errorcode[exc.errno], len(self.open),
                                  self.max_connections, exc.strerror)
                if not await self._evict_one("out_of_descriptors"):
                    with trio.move_on_after(backoff_s):
                        await self._released.wait()
                    backoff_s = min(ACCEPT_BACKOFF_S[1], backoff_s * 2)
                continue
            conn = GuardedStream(stream, self)
            self.open[id(conn)] = conn
            if conn.peer is not None:
                self.by_peer[conn.peer] = conn
            return conn

    async def aclose(self) -> None:
        await self.inner.aclose()


def guard_app(app, listener: CappedListener | None, body_timeout_s: float, rate_log: RateLog | None = None):
    """``app`` (ASGI) with a body deadline: an HTTP request's body must be complete within
    ``body_timeout_s`` of its headers, else the app's ``receive()`` raises ``BodyTimeout`` (an
    ``ApiError``: 408 in OpenAI's shape, and hypercorn closes the connection, whose body was not read
    to its end). While a request is answered after its body is in, its connection counts as busy in
    ``listener`` (not evicted at the cap)."""
    rate_log = rate_log or RateLog(log)

    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        conn = listener.find(scope.get("client")) if listener is not None else None
        deadline = trio.current_time() + body_timeout_s
        body_done = not _has_body(scope)
        if body_done and conn is not None:
            conn.busy = True

        async def bounded_receive():
            nonlocal body_done
            if body_done:  # then receive() only waits for a hang-up: a long answer has no deadline
                return await receive()
            try:
                with trio.fail_at(deadline):
                    message = await receive()
            except trio.TooSlowError:
                body_done = True
                rate_log.log(logging.WARNING, "body_timeout",
                             "http.body_timeout path=%s client=%s timeout_s=%g (answered 408, connection closed)",
                             scope.get("path"), scope.get("client"), body_timeout_s)
                raise BodyTimeout(body_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
                if conn is not None:
                    conn.busy = True
            return message

        try:
            await app(scope, bounded_receive, send)
        finally:
            if conn is not None:
                conn.busy = False

    return guarded


def _has_body(scope) -> bool:
    """Whether the request announces a body (Content-Length > 0, or chunked)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


async def serve_http(app, config, sock: socket.socket, *, max_connections: int, body_timeout_s: float,
                     shutdown_trigger, send_timeout_s: float = math.inf,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` on the listening ``sock`` with hypercorn's trio worker, at most
    ``max_connections`` client connections open (``CappedListener``) and every request body due
    within ``body_timeout_s`` of its headers (``guard_app``), until ``shutdown_trigger`` returns; then
    the connections left get ``config.graceful_timeout`` to finish.

    As ``hypercorn.trio.serve`` does, except for the listener, and without the ASGI lifespan
    protocol (the app has no start-up or shutdown hooks). ``task_status.started`` gets
    ``["http://host:port"]``.

    Args:
        app: an ASGI app.
        config: a hypercorn ``Config`` (its ``keep_alive_timeout`` is the header deadline), seconds.
        sock: a bound, listening TCP socket; it is served and closed here.
        max_connections: client connections open at once.
        body_timeout_s: a request's body is due this long after its headers, seconds.
        send_timeout_s: one write of an answer must complete within this (else the connection is
            closed: the client stopped reading), seconds.
    """
    from hypercorn.trio.statsd import StatsdLogger
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

    config.set_statsd_logger_class(StatsdLogger)
    context = WorkerContext(None)
    listener = CappedListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), max_connections,
                              send_timeout_s=send_timeout_s)
    wrapped = wrap_app(guard_app(app, listener, body_timeout_s), config.wsgi_max_body_size, "asgi")
    async with trio.open_nursery() as server_nursery:
        task_status.started([f"http://{repr_socket_addr(sock.family, sock.getsockname())}"])
        try:
            async with trio.open_nursery(strict_exception_groups=True) as nursery:
                nursery.start_soon(raise_shutdown, shutdown_trigger)
                nursery.start_soon(raise_shutdown, context.terminate.wait)
                nursery.start_soon(partial(trio.serve_listeners, partial(TCPServer, wrapped, config, context,
                                                                         ConnectionState({})),
                                           [listener], handler_nursery=server_nursery))
                await trio.sleep_forever()
        except BaseExceptionGroup as error:
            _, other = error.split((ShutdownError, KeyboardInterrupt))
            if other is not None:
                raise other
        finally:
            await context.terminated.set()
            server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout

"""Binding a command's HTTP socket before any slow start-up work. Standard library only.

Owns: ``bind_tcp`` (``swarm serve``, ``swarm dashboard``, ``swarm demo --serve``: a taken port fails in one line
within a second, not after the model loaded) and ``quiet_accept_errors`` (trio's accept loops log running out
of descriptors once per condition, not a traceback every 0.1 s).
"""

from __future__ import annotations

import logging
import socket
import time

from swarm.errors import ListenError


def bind_tcp(host: str, port: int, *, flag: str = "--port", backlog: int = 128) -> socket.socket:
    """Bind and listen on ``host:port`` now.

    Args:
        host: an address or name of this machine (``127.0.0.1``, ``0.0.0.0``, ``::``, ``localhost``).
        port: TCP port; 0 picks a free one (``getsockname()`` tells which).
        flag: the flag that chose the port, named in the error.
        backlog: connections the kernel queues until the server accepts.
    Returns:
        The listening socket (SO_REUSEADDR, as hypercorn binds: a restarted server is not blocked by
        TIME_WAIT leftovers, a live listener still is).
    Raises:
        ListenError: the port is taken, the address is not this machine's, or the port needs privileges:
            "cannot listen on 127.0.0.1:8000: address already in use (pick another --port, or stop the
            process using it)".
    """
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError, OverflowError) as exc:
        raise ListenError(where, why=f"not an address ({exc})", flag="--host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ListenError(where, exc, flag) from None
    return sock


class OncePerCondition(logging.Filter):
    """Lets the first record of each condition (a message and its first argument, e.g. trio's "accept
    returned EMFILE") through, without its traceback, then drops its repeats for ``interval_s`` and says
    how many there were on the next one let through."""

    def __init__(self, interval_s: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self.last: dict[tuple, float] = {}
        self.dropped: dict[tuple, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        key = (record.msg, args[0] if args else None)
        now = self.clock()
        if key in self.last and now - self.last[key] < self.interval_s:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        self.last[key] = now
        record.exc_info, record.exc_text = None, None  # the condition, not where in trio it was seen
        repeats = self.dropped.pop(key, 0)
        if repeats:
            record.msg, record.args = f"{record.msg} (%d more since the last such line)", (*args, repeats)
        return True


_ACCEPT_FILTER = OncePerCondition()


def quiet_accept_errors(logger_name: str = "trio.serve_listeners") -> None:
    """Make trio's accept loops (``trio.serve_listeners``: hypercorn's, libp2p's) log a failing accept
    (``EMFILE``, ``ENFILE``, ...) once per condition and minute instead of a traceback every retry.
    Idempotent."""
    logger = logging.getLogger(logger_name)
    if _ACCEPT_FILTER not in logger.filters:
        logger.addFilter(_ACCEPT_FILTER)

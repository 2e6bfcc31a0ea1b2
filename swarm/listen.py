"""Binding a command's HTTP socket before any slow start-up work. Standard library only.

Owns: ``bind_tcp`` (``swarm serve``, ``swarm dashboard``, ``swarm demo --serve`` bind their HOST:PORT
first, so a taken port fails in one line within a second instead of after the model has loaded) and
``hypercorn_bind`` (hands the bound socket to hypercorn). libp2p listen addresses are checked by
``swarm.transport.host.check_listen_addrs``.
"""

from __future__ import annotations

import socket

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


def hypercorn_bind(sock: socket.socket) -> str:
    """The hypercorn ``bind`` entry that serves on ``sock`` (``fd://N``). hypercorn then owns the socket:
    ``sock`` is detached and must not be used or closed again."""
    return f"fd://{sock.detach()}"

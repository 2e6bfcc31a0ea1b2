"""Loopback ports for tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


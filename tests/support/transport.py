"""Helpers for tests on real hosts and streams: a deadline-wrapped trio.run, a scriptable raw stream,
an echo protocol handler, another process holding a node key."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from swarm.errors import StreamClosed
from swarm.transport import FramedStream

TEST_DEADLINE_S = 8.0
ECHO = "/swarm-test/echo/1"


def run(async_fn: Callable[..., Awaitable[Any]], *args: Any, timeout_s: float = TEST_DEADLINE_S) -> Any:
    """trio.run(async_fn(*args)) under a hard deadline, so a bug fails the test instead of hanging."""

    async def main() -> Any:
        with trio.fail_after(timeout_s):
            return await async_fn(*args)

    return trio.run(main)


def trio_test(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Decorator: run an async test function under ``run``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        run(functools.partial(fn, *args, **kwargs))

    return wrapper


class ScriptedRaw:
    """A RawStream whose inbound bytes the test pushes; reads return at most ``read_cap`` bytes.

    Records every read size, so a test can prove a body was never read.
    """

    def __init__(self, read_cap: int = 7) -> None:
        self.read_cap = read_cap
        self.read_sizes: list[int] = []
        self.written: list[bytes] = []
        self.closed = False
        self.reset_called = False
        self._buf = bytearray()
        self._eof = False
        self._changed = trio.Event()

    def push(self, data: bytes) -> None:
        self._buf += data
        self._changed.set()

    def push_eof(self) -> None:
        self._eof = True
        self._changed.set()

    async def read(self, n: int) -> bytes:
        self.read_sizes.append(n)
        while not self._buf:
            if self._eof or self.reset_called:
                return b""
            self._changed = trio.Event()
            await self._changed.wait()
        take = min(n, self.read_cap, len(self._buf))
        out = bytes(self._buf[:take])
        del self._buf[:take]
        return out

    async def write(self, data: bytes) -> None:
        if self.closed or self.reset_called:
            raise trio.ClosedResourceError("closed")
        await trio.lowlevel.checkpoint()
        self.written.append(bytes(data))

    async def close(self) -> None:
        self.closed = True

    async def reset(self) -> None:
        self.reset_called = True
        self._changed.set()


async def echo(stream: FramedStream) -> None:
    """Protocol handler: send every frame back with ``server_saw_peer`` added, until the stream closes."""
    try:
        while True:
            msg = await stream.recv()
            msg["server_saw_peer"] = stream.remote_peer_id
            await stream.send(msg, timeout_s=5)
    except StreamClosed:
        pass


def hold_key(path: Path) -> subprocess.Popen:
    """Another running swarm process (as ``swarm serve`` or a stage would) holding the key at ``path``
    (``claim_key``); returned once it holds it. Closing its stdin ends it."""
    code = ("import sys; from swarm.transport.identity import claim_key; claim_key(sys.argv[1]); "
            "print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc

"""A live mirror of what one session sends on, to a warm spare that shadows the next stage.

Owns: ``Mirror``: one session's ``forward`` frames copied to the shadow as ``refill`` frames, through a bounded
queue, its own task and stream (dropped, never waited on, when the shadow is slow or gone), and ``promote``,
which hands its stream and digest to the session at a heal (docs/architecture.md, "Healing").
"""

from __future__ import annotations

import logging

import trio

from swarm import receipts, wire
from swarm.errors import ProtocolError, StreamClosed, SwarmError
from swarm.frames import Error, Refill

log = logging.getLogger(__name__)

MIRROR_QUEUE_FRAMES = 64  # frames a mirror may have waiting; one more and it is dropped
MIRROR_SEND_TIMEOUT_S = 5.0  # one mirror send taking longer drops the mirror
FLUSH_TIMEOUT_S = 5.0  # how long a heal waits for the queued mirror frames to be written


class Mirror:
    """Copies of one session's ``forward`` frames to the shadow at ``addr``, as ``refill`` frames.

    Args:
        session: the session id. addr: the shadow's multiaddr (with /p2p/). until: the end layer of
            the range the shadow holds (the successor's): the ``refill`` frames' ``until``.
    Attributes:
        end: positions ``[0, end)`` the frames written so far leave in the shadow's KV cache (the
            last frame's ``pos + T``; every frame rolls back to its ``pos`` first).
        broken: why the mirror was dropped ("" while it runs).
        digest: the rolling digest of the frames written to the shadow (its input digest).
    """

    def __init__(self, session: str, addr: str, until: int, queue_frames: int = MIRROR_QUEUE_FRAMES) -> None:
        self.session, self.addr, self.until = session, addr, until
        self.stream = None
        self.end = 0
        self.broken = ""
        self.promoted = False
        self.digest = receipts.RollingDigest()
        self._send, self._recv = trio.open_memory_channel(queue_frames)
        self._idle = trio.Event()  # set while nothing is queued or being written
        self._idle.set()
        self._pending = 0

    @property
    def live(self) -> bool:
        return not self.broken and not self.promoted

    def post(self, epoch: int, pos: int, **payload) -> None:
        """Queue a copy of a forward frame (``hidden=`` its hidden-state map, or ``tokens=`` its token
        ids); never blocks. A full queue drops the mirror."""
        if not self.live:
            return
        msg = Refill(session=self.session, epoch=epoch, pos=pos, until=self.until, **payload)
        try:
            self._send.send_nowait(msg)
        except trio.WouldBlock:
            self.drop(f"more than {self._send.statistics().max_buffer_size} frames waiting (the shadow is slow)")
            return
        self._pending += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle

    def drop(self, why: str, quiet: bool = False) -> None:
        """Stop mirroring (logged once, unless ``quiet``: the session ended or was re-pointed
        elsewhere); frames still queued are discarded, the stream is closed."""
        if self.broken or self.promoted:
            return
        self.broken = why
        (log.info if quiet else log.warning)("mirror.dropped session=%s shadow=%s reason=%s", self.session,
                                             self.addr, why)
        self._send.close()
        self._idle.set()

    async def run(self, dial, alive, on_error=None, on_end=None, own_stream: bool = True) -> None:
        """The mirror's task: dial the shadow (``await dial(addr)`` -> a FramedStream), then write
        the queued frames in order, each under ``MIRROR_SEND_TIMEOUT_S``. After ``promote`` the
        task only reads the stream and hands errors to ``on_error(msg)`` (the session's successor
        now), and ``await on_end(stream)`` when it ends. ``alive()`` says whether the session still
        exists (checked every second: the mirror ends with it). With ``own_stream`` False (the coordinator's data stream to the shadow, which its
        reader task reads) the task only writes and never closes the stream. Never raises; ends
        when the mirror is dropped or the stream closes."""
        try:
            self.stream = await dial(self.addr)
        except SwarmError as exc:
            self.drop(f"cannot dial the shadow: {exc}")
            return
        async with trio.open_nursery() as nursery:
            if own_stream:
                nursery.start_soon(self._read, on_error, nursery.cancel_scope)
            nursery.start_soon(self._watch, alive, nursery.cancel_scope)
            await self._write()
            if not self.promoted or not own_stream:
                nursery.cancel_scope.cancel()
        if not own_stream:
            return
        # dropped, or (promoted) the session ended or the shadow's stream did: nothing more goes on it
        if on_end is not None:
            await on_end(self.stream)
        with trio.move_on_after(1.0):
            await self.stream.aclose()

    async def _watch(self, alive, scope) -> None:
        while alive():
            await trio.sleep(1.0)
        self.drop("the session ended", quiet=True)
        scope.cancel()

    async def _write(self) -> None:
        async with self._recv:
            async for msg in self._recv:
                if self.broken:
                    break
                try:
                    await self.stream.send(msg, timeout_s=MIRROR_SEND_TIMEOUT_S)
                except SwarmError as exc:
                    self.drop(f"a send failed: {exc}")
                    break
                self.digest.add(receipts.refill_item(msg))
                self.end = msg.pos + msg.rows
                self._pending -= 1
                if not self._pending:
                    self._idle.set()
                if self.promoted:
                    break
        self._idle.set()

    async def _read(self, on_error, scope) -> None:
        """Read what the shadow says on the mirror stream: before the promotion any error (or the
        stream ending) drops the mirror; after it errors go to ``on_error``."""
        while True:
            try:
                msg = await self.stream.recv(timeout_s=None)
            except (StreamClosed, ProtocolError) as exc:
                if not self.promoted:
                    self.drop(f"the shadow's stream ended: {exc}")
                    scope.cancel()
                return
            try:
                frame = wire.validate(msg)
            except ProtocolError:
                continue
            if not isinstance(frame, Error):
                continue
            if self.promoted:
                if on_error is not None:
                    await on_error(frame)
            else:
                self.drop(f"the shadow answered: {frame.reason}")
                scope.cancel()
                return

    async def promote(self) -> bool:
        """A heal makes the shadow the successor: wait (``FLUSH_TIMEOUT_S`` at most) until every
        queued frame is written, then stop mirroring; the caller sends on ``stream`` from now on
        and continues ``digest`` as its output digest. False (the mirror dropped) when it cannot."""
        if not self.live:
            return False
        with trio.move_on_after(FLUSH_TIMEOUT_S):
            while self.live and (self.stream is None or self._pending):
                await self._idle.wait()
                if self.stream is None:
                    await trio.sleep(0.01)
        if not self.live or self.stream is None or self._pending:
            self.drop(self.broken or "its queued frames were not written in time")
            return False
        self.promoted = True
        self._send.close()
        return True

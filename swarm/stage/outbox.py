"""The stage's way out: ordered per-stream outboxes and the persistent streams to successors.

Owns: :class:`Outboxes`: one task per stream sending in posting order (a slow peer delays only the sessions that
send to it), a chunk's output posted (digested, logged for heals, mirrored, recorded for audits), the successor
streams and each mirror's task; :func:`try_send` is the one send that may fail quietly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import trio

from swarm import receipts, wire
from swarm.errors import ProtocolError, StreamClosed, SwarmError
from swarm.frames import Error, Forward, Frame, Refill, Result
from swarm.stage.session import Session, record_answers

log = logging.getLogger(__name__)


@dataclass
class _Outbox:
    """The frames waiting to be sent on one stream, and the task sending them."""

    send: object  # trio MemorySendChannel of (session, frame, chunk id or None, perf_counter when posted)
    recv: object
    dead: bool = False  # the stream is closed or lost: drop what is queued
    done: trio.Event = field(default_factory=trio.Event)  # set when the sending task has ended


async def try_send(stream, msg: Frame) -> None:
    """Send ``msg`` on ``stream`` within 5 s; a failure is logged, not raised (the peer has gone)."""
    try:
        await stream.send(msg, timeout_s=5.0)
    except SwarmError as exc:
        log.info("send.failed reason=%s", exc)


class Outboxes:
    """Outboxes, output posting and successor streams (see the module docstring).

    Args:
        sessions: the live sessions by id (the server's dict, read only here).
        layer_range: the block's layers, for error reasons; ``num_layers``: the model's (a session
            whose span ends there is the tail).
        timing: the stage's timing counters (``frames_out``, ``outbox_s``, ``send_s`` are added to).
        hop_timeout_s: the deadline of one send, seconds.
        dial: ``await dial(addr)`` opens a stream to a successor.
        spawn: ``spawn(fn, *args)`` starts a background task (the server's nursery).
        error: ``error(reason, code, session)`` builds an error frame (counted by the server).
        metrics: the ``StageMetrics`` whose send histogram is observed, or None.
    """

    def __init__(self, sessions: dict[str, Session], layer_range, num_layers: int, timing: dict, *,
                 hop_timeout_s: float, dial: Callable[[str], Awaitable[object]], spawn: Callable[..., None],
                 error: Callable[..., dict], metrics=None) -> None:
        self.sessions, self.layer_range, self.num_layers, self.timing = sessions, layer_range, num_layers, timing
        self.hop_timeout_s, self._dial, self._spawn, self._error = hop_timeout_s, dial, spawn, error
        self.metrics = metrics
        self.successors: dict[str, object] = {}  # addr -> FramedStream, one persistent stream per hop
        self._dial_locks: dict[str, trio.Lock] = {}  # successor addr -> lock held while dialing it
        self._outboxes: dict[object, object] = {}  # stream -> send channel of its ordered outbox
        self.in_flight = 0  # frames waiting in an outbox or being sent

    async def successor_or_answer(self, stream, sid: str, addr: str):
        """:meth:`successor`, or None after answering ``stream`` with an ``unavailable`` error for
        session ``sid`` when it cannot be reached (the caller then leaves the session as it was)."""
        try:
            return await self.successor(addr)
        except SwarmError as exc:
            await stream.send(self._error(f"cannot reach successor {addr}: {exc}", "unavailable", sid))
            return None

    async def successor(self, addr: str):
        """The persistent stream to ``addr``, dialed once. One lock per address: a peer that names a
        slow or dead successor delays only the opens that name the same one."""
        s = self.successors.get(addr)
        if s is not None and not s.closed:
            return s
        lock = self._dial_locks.setdefault(addr, trio.Lock())
        async with lock:
            s = self.successors.get(addr)
            if s is None or s.closed:
                s = await self._dial(addr)
                self.successors[addr] = s
                self._spawn(self._drain_successor, addr, s)
            return s

    async def run_mirror(self, sess: Session, mirror) -> None:
        """The task of ``sess``'s mirror (:class:`swarm.mirror.Mirror`): its own stream to the
        shadow (never the successor stream other sessions share: the shadow's errors must not reach
        the coordinator as this session's), ended with the session."""

        async def relay(err):  # once promoted, the shadow is the successor: its errors go to the coordinator
            await try_send(sess.reply, err)

        async def end(s):  # the promoted shadow's stream ended: as any successor stream's end
            box = self.close(s)
            self._successor_gone(s, StreamClosed(f"the stream to {mirror.addr} ended"))
            if box is not None:
                with trio.move_on_after(1.0):
                    await box.done.wait()

        await mirror.run(self._dial, lambda: self.sessions.get(sess.session_id) is sess, relay, end)

    async def _drain_successor(self, addr: str, s) -> None:
        """Read what a successor says on our outbound stream (only errors) and relay them."""
        while True:
            try:
                msg = await s.recv()
            except (StreamClosed, ProtocolError) as exc:
                if self.successors.get(addr) is s:
                    del self.successors[addr]
                self.close(s)
                self._successor_gone(s, exc)
                return
            try:
                frame = wire.validate(msg)
            except ProtocolError as exc:
                log.info("successor.malformed addr=%s reason=%s", addr, exc)
                continue
            sess = self.sessions.get(frame.session or "") if isinstance(frame, Error) else None
            if sess is not None:
                await try_send(sess.reply, frame)

    def emit(self, sess: Session, msg: Forward | Refill, payload) -> None:
        """Post a computed chunk's output: the tail's result to the coordinator, else hidden states on."""
        if msg.epoch < sess.epoch or self.sessions.get(sess.session_id) is not sess:
            return  # cancelled or failed while computing: the rows it wrote are rolled back by the next chunk
        tail = sess.is_tail(self.num_layers)
        if isinstance(msg, Refill):  # a heal's resent positions: KV only, on within the replacement
            if not tail and sess.heal.sent_log is not None:
                sess.heal.sent_log.record(msg.pos, payload)  # a later heal of the successor resends them
            onward = sess.span.end < msg.until
            if onward:
                sent = replace(msg, tokens=None, hidden=payload, extra={})
                self.post(sess.next_stream, sess, sent)
                if sess.evidence is not None:
                    sess.evidence.ledger.output.add(receipts.refill_item(sent))
            if sess.evidence is not None and sess.evidence.windows is not None:
                sess.evidence.windows.record_chunk(msg, payload if onward else None)
            return
        if tail:
            if sess.evidence is not None:
                record_answers(sess.evidence.answers, msg.pos, msg.rows, payload)  # the ids its receipt signs
            sent = Result(session=msg.session, epoch=msg.epoch, pos=msg.pos, chunk=msg.chunk, token_ids=payload,
                          logits_from=msg.logits_from)
            self.post(sess.reply, sess, sent, msg.chunk)
            item = receipts.result_item(sent)
        else:
            sent = replace(msg, tokens=None, hidden=payload, extra={})
            if sess.heal.sent_log is not None:
                sess.heal.sent_log.record(msg.pos, payload)
            if sess.heal.mirror is not None:  # the successor's shadow gets a copy (its own bounded queue)
                sess.heal.mirror.post(msg.epoch, msg.pos, hidden=payload)
            self.post(sess.next_stream, sess, sent, msg.chunk)
            item = receipts.forward_item(sent)
        evidence = sess.evidence
        if evidence is not None:  # in posting order = the order the stream carries them
            evidence.ledger.output.add(item)
            if evidence.windows is not None:  # the rows behind the receipt's window root (swarm.openings)
                evidence.windows.record_chunk(msg, payload)

    def post(self, stream, sess: Session, msg: Frame, chunk: int | None = None) -> None:
        """Queue ``msg`` on ``stream``'s outbox: one task per stream sends in posting order, so a slow
        peer delays only the sessions that send to it. Nothing is queued on a closed stream."""
        if stream is None or stream.closed:
            return
        box = self._outboxes.get(stream)
        if box is None:
            box = _Outbox(*trio.open_memory_channel(math.inf))
            self._outboxes[stream] = box
            self._spawn(self._outbox, stream, box)
        box.send.send_nowait((sess, msg, chunk, time.perf_counter()))
        self.in_flight += 1

    async def _outbox(self, stream, box: _Outbox) -> None:
        """Send one stream's queued frames in order. Data frames of a session that is gone are
        dropped; nothing is written once the stream is closed (py-libp2p 0.8.1 can drop the whole
        connection when a stream the peer reset is written to). A failed send to a successor fails
        every session sending on that stream, and the stream is no longer used (a new session that
        names the successor dials it afresh)."""
        try:
            async with box.recv:
                async for sess, msg, chunk, posted in box.recv:
                    try:
                        gone = not isinstance(msg, Error) and self.sessions.get(sess.session_id) is not sess
                        if box.dead or stream.closed or gone:
                            continue
                        t_send = time.perf_counter()
                        await stream.send(msg, timeout_s=self.hop_timeout_s)
                    except SwarmError as exc:
                        if stream is not sess.reply:
                            box.dead = True  # a successor that does not take frames takes none of them
                            for addr in [a for a, s in self.successors.items() if s is stream]:
                                del self.successors[addr]
                            self._successor_gone(stream, exc)
                    else:
                        if chunk is not None:
                            sess.frames_out += 1
                            sess.heal.sent = max(sess.heal.sent, chunk)
                            timing = self.timing
                            timing["frames_out"] += 1
                            timing["outbox_s"] += t_send - posted
                            t_done = time.perf_counter()
                            timing["send_s"] += t_done - t_send
                            if self.metrics is not None:
                                self.metrics.send_seconds.observe(t_done - posted)
                    finally:
                        self.in_flight -= 1
        finally:
            box.done.set()

    def _successor_gone(self, stream, exc: SwarmError) -> None:
        """``stream`` to a successor failed a send or ended (its peer closed or reset it, or the
        connection under it died, e.g. a relayed hop whose relay went away): every session that sends
        on it has lost its successor (:meth:`_lose_successor`). Told at once either way: a stream that
        ended while its sessions were between chunks would otherwise swallow their next frames, and the
        coordinators would find out only by probing for the gap (seconds)."""
        for sess in [s for s in self.sessions.values() if s.next_stream is stream]:
            self._lose_successor(sess, exc)

    def _lose_successor(self, sess: Session, exc: SwarmError) -> None:
        """A session's successor stopped taking frames: tell its coordinator (``error`` code
        ``unavailable``), and keep the session, its KV cache and the hidden states it sent, so a
        heal can re-point it at a replacement (``repair``) without recomputing anything here.
        Frames computed meanwhile go nowhere; the coordinator's ``close`` (or its stream closing,
        or ``--session-ttl-s``) drops the session when it does not heal."""
        sess.next_stream, sess.heal.successor_lost = None, True
        log.warning("session.successor_lost session=%s next=%s reason=%s", sess.session_id, sess.next_addr, exc)
        # with its epoch: a coordinator that repaired the session since reads it as stale
        self.post(sess.reply, sess, self._error(f"stage {self.layer_range}: lost its successor {sess.next_addr}: "
                                                f"{exc}"[:300], "unavailable", sess.session_id, epoch=sess.epoch))

    def close(self, stream) -> _Outbox | None:
        """Stop ``stream``'s outbox: frames still queued are dropped, not sent."""
        box = self._outboxes.pop(stream, None)
        if box is not None:
            box.dead = True
            box.send.close()
        return box

"""A heal's ``repair`` at a stage: re-pointing a surviving session, keeping its KV cache.

Owns: :class:`Repairs`: a ``repair`` frame checked (from the session's coordinator, signed like ``open``), the
session re-pointed at a new ``prev`` or ``next``, its ``SentLog`` resent to the new successor as ``refill``
frames, its mirror or a shadow session promoted, and the count of repairs applied.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from swarm import receipts
from swarm.addrs import peer_id_from_addr
from swarm.errors import ProtocolError
from swarm.frames import Refill, Repair, RepairOk
from swarm.stage.session import Session

log = logging.getLogger(__name__)

REFILL_ROWS = 64  # positions per refill frame a stage resends (about 150 KB at D = 576, float32)


class Repairs:
    """Apply heals' ``repair`` frames to surviving sessions (see the module docstring).

    Args:
        sessions: the live sessions by id (the server's dict).
        block: the stage's ``LayerBlock`` (``layer_range``, ``num_layers``).
        self_peer: ``self_peer()`` is this stage's PeerId (never its own successor).
        error: ``error(reason, code, session)`` builds an error frame (counted by the server).
        refuse: ``await refuse(stream, sess, kind)`` answers a frame from a peer not assigned.
        successor_or_answer: ``await successor_or_answer(stream, sid, addr)``: the stream to a
            successor, or None after answering ``stream`` why it cannot be reached.
        post: ``post(stream, sess, frame)`` queues a frame on a stream's outbox, in order.
    """

    def __init__(self, sessions: dict[str, Session], block, *, self_peer: Callable[[], str],
                 error: Callable[..., dict], refuse: Callable[..., Awaitable[None]],
                 successor_or_answer: Callable[..., Awaitable[object]], post: Callable[..., None]) -> None:
        self.sessions, self.block, self._self_peer, self._error = sessions, block, self_peer, error
        self._refuse, self._successor_or_answer, self._post = refuse, successor_or_answer, post
        self.applied = 0  # heal repairs applied (metrics)

    async def repair(self, stream, msg: Repair) -> None:
        """Re-point a surviving session after a heal, keeping its KV cache; answer ``repair_ok``.

        From the coordinator that opened the session, signed like ``open``. Sets the epoch (older
        frames are stale); ``prev`` makes forwards acceptable from the stage that replaced the
        predecessor (closing the input digest), ``next`` dials the replacement successor (closing
        the output digest); ``resend`` posts the hidden states this stage sent for positions
        ``[0, resend)`` to it as ``refill`` frames (``REFILL_ROWS`` positions each), which reach
        the replacement before any forward of the new epoch. ``repair_ok`` carries the cache's
        ``kv_len``, which the coordinator checks covers what the repair keeps.

        Answers ``error`` (the session unchanged) with code ``no_session`` when the session is
        gone, ``no_state`` when the log holds fewer positions than asked (or was dropped), and
        ``unavailable`` when the new successor cannot be dialed; the coordinator then falls back
        to a full replay.

        Raises:
            ProtocolError: an unsigned frame, or one naming what the session has not (a
                predecessor of the head, a successor of the tail, this stage as the successor).
        """
        sid = msg.session
        sess = self.sessions.get(sid)
        if sess is None:
            await stream.send(self._error(f"no session {sid!r} at stage {self.block.layer_range} to repair",
                                          "no_session", sid))
            return
        coordinator = stream.remote_peer_id
        if coordinator != sess.coordinator:
            await self._refuse(stream, sess, "repair")
            return
        if not receipts.assignment_ok(msg, coordinator):
            raise ProtocolError(f"repair frame is not signed by the peer that sent it ({coordinator})")
        if sess.heal.shadow:
            await self._promote_shadow(stream, sess, msg)
            return
        self._check(sess, msg)
        short = self._log_short(sess, msg)
        if short is not None:
            await stream.send(self._error(short, "no_state", sid))
            return
        relinked = await self._new_successor(stream, sess, msg)
        if relinked is None:
            return
        new_stream, start, promoted = relinked
        self._relink(sess, msg, new_stream, promoted)
        resent = self._resend(sess, msg, start)
        log.info("session.repair session=%s epoch=%d prev=%s next=%s resent=%d kv_len=%d%s", sid, sess.epoch,
                 msg.prev, msg.next, resent, sess.cache.kv_len,
                 f" promoted_mirror=[0, {start})" if msg.mirror else "")
        self.applied += 1
        await stream.send(RepairOk(session=sid, kv_len=sess.cache.kv_len, resent=resent,
                                   mirrored=start if msg.mirror else None))

    def _check(self, sess: Session, msg: Repair) -> None:
        """Raise ProtocolError when the repair names what the session has not."""
        prev, next_addr = msg.prev, msg.next
        if prev is not None and sess.is_head:
            raise ProtocolError(f"stage {sess.span} is the head: it has no predecessor to replace")
        if next_addr is not None and sess.is_tail(self.block.num_layers):
            raise ProtocolError(f"stage {sess.span} is the tail: it has no successor to replace")
        if next_addr is not None and peer_id_from_addr(next_addr) == self._self_peer():
            raise ProtocolError("the successor named in 'next' is this stage itself")

    def _log_short(self, sess: Session, msg: Repair) -> str | None:
        """Why the session cannot resend the positions the repair asks for, or None when it can."""
        resend = msg.resend
        if resend is None or msg.mirror:  # a promoted mirror needs only what it did not deliver
            return None
        log_ = sess.heal.sent_log
        held = log_.length if log_ is not None else 0
        if held >= resend:
            return None
        why = f" ({log_.broken})" if log_ is not None and log_.broken else \
            " (it keeps none: --heal-log-mb)" if log_ is None and not sess.is_tail(self.block.num_layers) else ""
        return f"stage {sess.span} holds the hidden states it sent for {held} positions{why}; the repair asks " \
               f"for {resend}"

    async def _new_successor(self, stream, sess: Session, msg: Repair) -> tuple[object, int, object] | None:
        """The stream to the repair's successor (None when it names none), the positions it holds
        already and the mirror promoted to it (a promoted mirror's; else 0 and None); None after
        answering ``stream`` why not."""
        sid, next_addr, resend, mirror = sess.session_id, msg.next, msg.resend, sess.heal.mirror
        if msg.mirror:  # the new successor is the shadow this stage mirrors to: it lacks little or nothing
            if mirror is None or mirror.addr != next_addr or not await mirror.promote():
                why = "it mirrors to no shadow" if mirror is None else f"it mirrors to {mirror.addr}" \
                    if mirror.addr != next_addr else f"its mirror was dropped ({mirror.broken})"
                await stream.send(self._error(f"stage {sess.span} cannot promote {next_addr}: {why}",
                                              "no_state", sid))
                return None
            start = min(mirror.end, resend)
            sess.heal.mirror = None
            held = sess.heal.sent_log.length if sess.heal.sent_log is not None else 0
            if start < resend and held < resend:
                await stream.send(self._error(
                    f"stage {sess.span}: its mirror delivered {start} positions and it holds the hidden states it "
                    f"sent for {held}; the repair asks for {resend}", "no_state", sid))
                return None
            return mirror.stream, start, mirror
        if next_addr is None:
            return None, 0, None
        new_stream = await self._successor_or_answer(stream, sid, next_addr)
        if new_stream is None:
            return None
        if mirror is not None:  # re-pointed at another stage: the shadow is of no use any more
            mirror.drop(f"the successor is now {next_addr}", quiet=True)
            sess.heal.mirror = None
        return new_stream, 0, None

    def _relink(self, sess: Session, msg: Repair, new_stream, promoted) -> None:
        """Take the repair's epoch, predecessor and successor, closing the digests they end."""
        prev = msg.prev
        sess.epoch = max(sess.epoch, msg.epoch)
        if prev is not None:
            if sess.evidence is not None:
                sess.evidence.ledger.cut("input", sess.source)
            sess.source = prev
        if new_stream is not None:
            if sess.evidence is not None:
                sess.evidence.ledger.cut("output", peer_id_from_addr(sess.next_addr or ""))
                if promoted is not None:  # the shadow's input digest began with the mirrored frames
                    sess.evidence.ledger.output = promoted.digest
            sess.next_addr, sess.next_stream, sess.heal.successor_lost = msg.next, new_stream, False
            sess.heal.sent = -1  # progress on the new hop starts afresh

    def _resend(self, sess: Session, msg: Repair, start: int) -> int:
        """Post the hidden states sent for ``[start, resend)`` to the successor as ``refill``
        frames; returns how many positions that is."""
        resend = msg.resend
        for pos, tensor in (sess.heal.sent_log.frames(resend, REFILL_ROWS, start) if resend and start < resend else []):
            out = Refill(session=sess.session_id, epoch=sess.epoch, pos=pos, until=msg.until, hidden=tensor)
            self._post(sess.next_stream, sess, out)
            if sess.evidence is not None:
                sess.evidence.ledger.output.add(receipts.refill_item(out))
        return max(0, (resend or 0) - start)

    async def _promote_shadow(self, stream, sess: Session, msg: Repair) -> None:
        """A repair at a shadow: it becomes the stage (a heal swapped it in for the one it shadowed).

        Only ``next`` may be named (the successor it now sends to; none at the tail); its source
        stays the predecessor that mirrored to it. The epoch is left as it is: mirrored frames
        still on their way are computed (their rows are rolled back by later frames as any frame's
        are), and the first frame of the heal's epoch raises it. Its output digest is empty (a
        shadow sends nothing), so nothing is closed. Answers ``repair_ok`` with the positions its
        cache will hold once its queued frames are computed."""
        sid, next_addr = sess.session_id, msg.next
        if msg.prev is not None or msg.resend is not None:
            raise ProtocolError("a repair that promotes a shadow names only 'next'")
        tail = sess.is_tail(self.block.num_layers)
        if tail == (next_addr is not None) or peer_id_from_addr(next_addr or "") == self._self_peer():
            raise ProtocolError(f"shadow {sess.span}: the repair that promotes it must name a successor exactly when "
                                "it is not the tail, and not itself")
        if next_addr is not None:
            new_stream = await self._successor_or_answer(stream, sid, next_addr)
            if new_stream is None:
                return
            sess.next_stream, sess.next_addr, sess.heal.successor_lost = new_stream, next_addr, False
        sess.heal.shadow = False
        kv_len = sess.scheduling.queued_end if sess.scheduling.queue else sess.cache.kv_len
        log.info("session.promoted session=%s layers=%s next=%s kv_len=%d", sid, sess.span, next_addr, kv_len)
        await stream.send(RepairOk(session=sid, kv_len=kv_len, resent=0))

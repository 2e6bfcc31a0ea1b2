"""The stage receipt: sign what this stage received and sent for a job, and pass the request on.

Owns: signing the stage receipt of a session (job id, nonce, model and range digests, layer range,
dtypes, positions, this stage's PeerId, and the rolling digests of every frame received and sent,
kept in the session's ``receipts.StageLedger``: the server adds each forward frame received, the
outbox each frame posted), posting it to the coordinator and passing the request on to the
successor behind the session's frames. The schema and canonical bytes live in ``swarm.receipts``.

``SigningMixin`` is mixed into :class:`swarm.stage.server.StageServer`, which provides ``block``,
``host``, ``key``, ``model_name`` and ``model_digest``; ``_post`` comes from the outbox. May import:
``swarm.receipts``, ``swarm.wire``, ``swarm.transport.identity`` (lazily), this package's ``session``.
"""

from __future__ import annotations

import logging

from swarm import receipts, wire
from swarm.stage.session import Session

log = logging.getLogger(__name__)


class SigningMixin:
    """The stage receipt (see the module docstring)."""

    def _sign_receipt(self, sess: Session) -> None:
        """Sign this stage's receipt for the session, post it to the coordinator, pass the request on.

        The request travels the data path (coordinator -> head -> ... -> tail) behind every frame of
        the session; it is queued behind the session's chunks and each outbox keeps posting order,
        so every receipt covers all frames its predecessor sent: the digests of neighbours match.
        """
        b, sid = self.block, sess.session_id
        tail = sess.is_tail(b.num_layers)
        body = sess.ledger.body(
            session=sid, coordinator=sess.coordinator, peer_id=self.host.peer_id, model=self.model_name,
            model_digest=self.model_digest, range_digest=b.digest_of(sess.span), layers=sess.span.as_list(),
            num_layers=b.num_layers, dtype=str(b.dtype).removeprefix("torch."),
            wire_dtype="token_ids" if tail else wire.DTYPE_NAMES.get(sess.wire_dtype or b.dtype, "?"),
            positions=sess.positions, reused=sess.reused)
        from swarm.transport.identity import sign

        signed = receipts.sign_receipt(body, lambda data: sign(self.key, data))
        self.receipts_signed += 1
        log.info("receipt.signed session=%s job=%s in=%d out=%d", sid, sess.ledger.job_id,
                 sess.ledger.input.frames, sess.ledger.output.frames)
        self._post(sess.reply, sess, wire.frame("receipt_ok", session=sid, receipt=signed))
        if not tail:
            self._post(sess.next_stream, sess, wire.frame("receipt", session=sid))

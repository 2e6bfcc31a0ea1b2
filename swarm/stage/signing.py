"""The stage receipt: sign what this stage received and sent for a job, and pass the request on.

Owns: :class:`ReceiptSigner`: a session's stage receipt signed (its rolling digests, reproducibility class and
window root, whose rows go to retention), posted to the coordinator, and the request passed on to the successor
behind the session's frames. The schema and canonical bytes are ``swarm.receipts``'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from swarm import openings, receipts, wire
from swarm.frames import Receipt, ReceiptOk
from swarm.stage.session import Session

log = logging.getLogger(__name__)


class ReceiptSigner:
    """The stage receipt (see the module docstring).

    Args:
        block: the stage's ``LayerBlock`` (layers, dtype, the digest of a span's tensors).
        model_name: the model's name; ``model_digest``: the digest of its weights.
        post: ``post(stream, sess, frame)`` queues a frame on a stream's outbox, in order.
    """

    def __init__(self, block, model_name: str, model_digest: str, post: Callable[..., None], *,
                 tile_of: Callable[[Session], int] = lambda sess: 1,
                 retain: Callable[[Session, dict, object], None] | None = None,
                 window: int = openings.WINDOW_POSITIONS) -> None:
        self.block, self.model_name, self.model_digest, self._post = block, model_name, model_digest, post
        self._tile_of, self._retain, self.window = tile_of, retain, window
        self.signed = 0  # receipts signed (metrics)

    def repro_class(self, sess: Session | None = None):
        """The reproducibility class this stage signs for ``sess`` (its span and GEMM tile), or for
        the whole block at tile 1 (``info``, the DHT record): :func:`swarm.kernels.facts.stage_class`."""
        from swarm.kernels.facts import stage_class

        if sess is None:
            return stage_class(self.block)
        return stage_class(self.block, sess.span, self._tile_of(sess))

    def sign(self, sess: Session, key, peer_id: str) -> None:
        """Sign this stage's receipt for the session, post it to the coordinator, pass the request on.

        The request travels the data path (coordinator -> head -> ... -> tail) behind every frame of
        the session; it is queued behind the session's chunks and each outbox keeps posting order,
        so every receipt covers all frames its predecessor sent: the digests of neighbours match.

        Args:
            sess: a session opened with a job (its ``evidence`` holds the rolling digests).
            key: this node's ed25519 KeyPair; ``peer_id``: its PeerId, named in the receipt.
        """
        b, sid, evidence = self.block, sess.session_id, sess.evidence
        tail = sess.is_tail(b.num_layers)
        log_ = evidence.windows  # absent without --audit-retention-mb, broken when the job outgrew it
        commitment = None if log_ is None or log_.broken else openings.Commitment(log_.snapshot(), self.window)
        if log_ is not None and log_.broken:
            log.warning("receipt.no_windows session=%s job=%s reason=%s", sid, evidence.ledger.job_id, log_.broken)
        body = evidence.ledger.body(
            session=sid, coordinator=sess.coordinator, peer_id=peer_id, model=self.model_name,
            model_digest=self.model_digest, range_digest=b.digest_of(sess.span), layers=sess.span.as_list(),
            num_layers=b.num_layers, dtype=str(b.dtype).removeprefix("torch."),
            wire_dtype="token_ids" if tail else wire.DTYPE_NAMES.get(sess.wire_dtype or b.dtype, "?"),
            positions=sess.positions, reused=sess.reused, repro=self.repro_class(sess).as_dict(),
            windows=None if commitment is None else commitment.field(),
            answers=_answers(evidence.answers) if tail else None)
        from swarm.transport.identity import sign

        signed = receipts.sign_receipt(body, lambda data: sign(key, data))
        self.signed += 1
        if commitment is not None and self._retain is not None:
            self._retain(sess, signed, commitment)  # the rows an audit opens, kept after the session ends
        log.info("receipt.signed session=%s job=%s in=%d out=%d", sid, evidence.ledger.job_id,
                 evidence.ledger.input.frames, evidence.ledger.output.frames)
        self._post(sess.reply, sess, ReceiptOk(session=sid, receipt=signed))
        if not tail:
            self._post(sess.next_stream, sess, Receipt(session=sid))


def _answers(answers: list) -> dict:
    """The tail's signed answers: ``{"from": p0, "ids": [...]}``, the token id it last sent after each
    position from ``p0`` (its first answered position) on; null where it sent none (see
    ``swarm.receipts``: a client proves with it what the ring answered)."""
    first = next((p for p, t in enumerate(answers) if t is not None), len(answers))
    return {"from": first, "ids": list(answers[first:])}

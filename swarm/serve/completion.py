"""One request's generation on the ring, as ``swarm serve`` runs it.

Owns: ``generate_ids`` (a pool's ring client, ``swarm.coordinator.decoding.decode``, the request's metrics and
job receipt), ``Detok`` (final text, stop strings), ``map_error`` (a ring's fault as the client's HTTP error)
and the answer's ``finish_reason`` and ``usage``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from swarm import receipts
from swarm.coordinator.text import Detokenizer
from swarm.errors import (ConfigError, ContextOverflow, HopTimeout, ModelError, RemoteError, StageLost,
                          collapse)
from swarm.serve.requests import ApiError, Request
from swarm.heal import HealError, NoSpare

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from swarm.coordinator.ring import RingClient
    from swarm.serve.pool import ClientPool
    from swarm.serve.state import ServeState

log = logging.getLogger(__name__)


class Detok(Detokenizer):
    """A request's detokenizer (``update(ids)``: the text safe to emit now, held back where a stop
    string might still be forming), carrying its output ids and decode record once the ring is done."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], context: Sequence[int] = ()):
        super().__init__(tokenizer, stop, context)
        self.ids: list[int] = []
        self.record: dict = {}


def map_error(exc: BaseException) -> ApiError:
    """A SwarmError from the ring, as the HTTP error a client should see."""
    text = str(exc)
    if isinstance(exc, ContextOverflow):
        return ApiError(400, text, None, "context_length_exceeded")
    if isinstance(exc, RemoteError) and ("busy" in text or "draining" in text):
        return ApiError(503, f"the ring cannot take this request now: {text}", None, "ring_busy", "server_error",
                        retry_after_s=1)
    if isinstance(exc, (StageLost, HopTimeout, NoSpare, HealError)):
        return ApiError(503, f"the ring is unavailable: {text}", None, "ring_unavailable", "server_error",
                        retry_after_s=5)
    if isinstance(exc, (ConfigError, ModelError)):
        return ApiError(400, text)
    return ApiError(502, f"a stage failed the request: {text}", None, "stage_error", "server_error")


async def generate_ids(state: ServeState, req: Request, on_text: Callable[[str], None] | None = None,
                       stop: trio.Event | None = None,
                       on_open: Callable[[], None] | None = None) -> tuple[list[int], dict, Detok]:
    """Run one request on its own ring client; ``on_text(piece)`` gets text as it becomes final,
    ``on_open()`` is called once every stage admitted the session. Once ``stop`` is set, a request
    still waiting for a ring client leaves the queue at once (nothing was opened: no output), and
    one on the ring ends after its next result (a prefill chunk's or a token's), closing its
    session normally.

    Raises:
        SwarmError: from the ring (see ``map_error``).
    """
    from swarm.coordinator.decoding import DecodeOptions, decode
    from swarm.coordinator.drafters import make_drafter

    # a completion continues the prompt's text, so it is decoded after the prompt (a SentencePiece
    # word keeps its leading space); a chat's answer is a message of its own
    detok = Detok(state.tokenizer, req.stop, () if req.chat else req.prompt_ids)
    gaps: list[float] = []  # seconds between consecutive tokens as they arrived (inter-token latency)
    arrived = {"n": 0, "t": None}

    def on_ids(ids):
        now, new = time.perf_counter(), len(ids) - arrived["n"]
        if new > 0:
            fresh = [] if arrived["t"] is None else [now - arrived["t"]] + [0.0] * (new - 1)  # accepted together:
            gaps.extend(fresh)  # they arrive together
            if state.metrics is not None:
                state.metrics.tokens_arrived(new, fresh)
            arrived.update(n=len(ids), t=now)
        piece = detok.update(ids)
        if piece and on_text:
            on_text(piece)

    drafter = make_drafter(state.config.ring.spec.draft, target_vocab=state.vocab_size, sampling=req.sampling) \
        if state.config.ring.spec.draft != "none" else None
    receipt_dir = state.config.receipts.receipt_dir
    job = {"id": uuid.uuid4().hex, "nonce": receipts.new_nonce()} if receipt_dir is not None else None
    client = await _acquire_unless(state.pool, stop)
    if client is None:  # stopped while queued: nothing was sent to the ring
        if state.metrics is not None:
            state.metrics.request_done("abandoned")
        return [], {"stopped": True}, detok
    state.active += 1
    healthy = False
    try:
        options = DecodeOptions(req.max_tokens, state.stop_ids, state.config.ring.spec, drafter, req.sampling,
                                state.config.ring.wire_dtype, prefix_cache=state.config.ring.prefix_cache, job=job,
                                prefix_salt=req.cache_scope)
        decoded = await decode(client, req.prompt_ids, options, on_ids=on_ids, on_open=on_open,
                               should_stop=lambda ids: detok.hit or (stop is not None and stop.is_set()),
                               answer_len=lambda ids: detok.hit_at if detok.hit else len(ids))
        detok.ids, detok.record = decoded.output_ids, decoded.as_record()
        healthy = True
        state.pool.note_measured(client, decoded)  # routed from the DHT: routes believe these timings
        if detok.record.get("heal_events"):
            state.ring = client.healed_ring()  # new ring clients start from the healed ring
        ring_entries = [i.entry() for i in client.infos]  # after any heal: the ring that finished the job
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    finally:
        await state.pool.release(client, healthy)
        state.active -= 1
        state.served += 1
        if state.metrics is not None and not healthy:
            state.metrics.request_done("error")
    out, record = detok.ids, detok.record
    parts = record.pop("receipt_parts", None)
    state.cached_tokens += int(record.get("cached_tokens") or 0)
    if state.metrics is not None:
        state.metrics.request_done("abandoned" if stop is not None and stop.is_set() else "ok", record, len(out),
                                   gaps=gaps)
    if job is not None and parts is not None:
        record["receipt"] = await _save_receipt(state, job, parts, req.prompt_ids, out, ring_entries, record)
        if record["receipt"] is not None and state.host is not None and state.nursery is not None:
            from swarm.coordinator.jobs import offer_for_audit

            # fire-and-forget, in the server's nursery: the answer never waits for auditors
            state.nursery.start_soon(offer_for_audit, state.host, record["receipt"], state.discovery,
                                     state.ring.spares)
    tail = detok.update(out, final=True)
    if tail and on_text:
        on_text(tail)
    return out, record, detok


async def _acquire_unless(pool: ClientPool, stop: trio.Event | None) -> RingClient | None:
    """A ring client from ``pool``, or None if ``stop`` is set first (the request leaves the queue)."""
    if stop is None:
        return await pool.acquire()
    if stop.is_set():
        return None
    got: list = []
    try:
        async with trio.open_nursery() as nursery:
            async def take():
                got.append(await pool.acquire())
                nursery.cancel_scope.cancel()

            async def leave():
                await stop.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(take)
            nursery.start_soon(leave)
    except BaseExceptionGroup as group:  # the pool's own error (no route: a 503 naming why), not a 500
        raise collapse(group) from None
    return got[0] if got else None


async def _save_receipt(state: ServeState, job: dict, parts: dict, prompt_ids: list[int], out: list[int],
                        ring_entries: list[dict], record: dict) -> dict | None:
    """Sign, save and verify one request's job receipt (in a worker thread); counted in the
    metrics. A receipt that cannot be written is logged, and the answer still goes out."""
    from swarm.coordinator.jobs import write_job_receipt

    try:
        res = await trio.to_thread.run_sync(lambda: write_job_receipt(
            state.config.receipts.receipt_dir, state.key, job, parts, model=state.model_id,
            model_digest=state.model_digest,
            num_layers=state.num_layers, prompt_ids=prompt_ids, output_ids=out, ring=ring_entries, record=record))
    except ConfigError as exc:
        log.warning("receipt.unwritten job=%s reason=%s", job["id"], exc)
        return None
    if state.metrics is not None:
        state.metrics.receipt_written(Path(res["path"]).name, None if res["verified"] else res.get("check", "?"))
    log.info("request.receipt job=%s verified=%s path=%s", job["id"], res["verified"], res["path"])
    return res


def finish_reason(out: list[int], req: Request, state: ServeState, detok: Detok, record: dict) -> str:
    if detok.hit or (out and out[-1] in state.stop_ids):
        return "stop"
    return "length"


def usage(req: Request, out: list[int], record: dict | None = None) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt's leading
    positions every stage took from its prefix cache (not prefilled again)."""
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(out),
            "total_tokens": len(req.prompt_ids) + len(out),
            "prompt_tokens_details": {"cached_tokens": int((record or {}).get("cached_tokens") or 0)}}

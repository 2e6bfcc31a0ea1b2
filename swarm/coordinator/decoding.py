"""Decoding one prompt on a connected ring: ``decode`` (``DecodeOptions`` -> ``DecodeResult``).

Owns: opening the session, driving a ``SpecLoop`` (prefill chunks, then verify chunks) through the
ring client, turning a lost or frozen stage into ``swarm.heal.run_heal`` over ``RingOps`` and
going on, the context budget, and collecting the stages' receipt parts of a job.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, fields

import trio

from swarm import wire
from swarm.config import SamplingParams, SpecConfig
from swarm.errors import ConfigError, ContextOverflow, StageLost
from swarm.heal import HealEvent, plan_replay, run_heal
from swarm.coordinator.books import Generation
from swarm.coordinator.ring import RingClient
from swarm.coordinator.spec import NoDrafter, SpecLoop
from swarm.coordinator.heal_ops import RingOps

log = logging.getLogger(__name__)


# A lost stream or missed heartbeats is healed; a hop timeout while every stage still answers
# heartbeats means a stage is computing something long (e.g. a huge prefill chunk): fail with
# that message rather than replacing a healthy, busy stage.
HEALABLE = (StageLost,)


OPEN_ATTEMPTS = 2  # opens of a session tried when a stage paused during one (no stage lost)


@dataclass(frozen=True)
class DecodeOptions:
    """How ``decode`` generates: its limits, speculation, sampling, wire dtype, heals, receipts and
    prefix reuse. Validated on construction.

    Attributes:
        max_new_tokens: stop after this many new tokens (>= 0; capped by the ring's context, which
            the result reports as ``context_limited``).
        stop_ids: stop after emitting one of these token ids.
        spec: K, depth, prefill chunk (None: plain decoding, K = 0, depth 1).
        drafter: a ``swarm.coordinator.spec.Drafter`` (None: none).
        sampling: temperature / top-k / top-p / seed (None: greedy). The tail draws the token of
            every position with noise keyed by (seed, position) (``swarm.model.sampling``), and
            drafts are verified by exact match against it: the output is the same for any drafter,
            K and depth, and is an exact sample of the model.
        wire_dtype: dtype of hidden states between stages (None: each stage's own dtype). Narrower
            dtypes (bfloat16, float16, float8_e4m3fn with a scale per position) are lossy: opt-in,
            and recorded as ``wire_lossy`` in the result.
        heal: heal onto spares (default); False fails on the first lost stage.
        job: ``{"id", "nonce"}``: every stage keeps receipt digests for the session, and at the end
            the signed stage receipts are collected (``swarm.receipts``). None: no digests.
        shadow: (with ``heal``) open the session also at a warm spare for each stage that has one,
            as a shadow its predecessor mirrors every forward frame to (the coordinator the head's
            token ids): a heal onto it then refills (almost) nothing (``replay: "shadow"``). Costs
            each spare the compute of its stage and each predecessor one more copy of every frame
            on its uplink; a slow or dead shadow is dropped, never slowing the ring. Default off.
        prefix_cache: offer the prompt to the stages' prefix caches: the prefill starts after the
            leading positions every stage still holds from an earlier session of this coordinator
            (``cached_tokens``), and at the end each stage keeps the KV of prompt + output for the
            next one (a chat's next turn). Same output bits as without (resumed == fresh).
        prefix_salt: with ``prefix_cache``, the scope of this generation's prefix blocks: it is mixed
            into the namespace every stage roots its block keys in, so blocks are reused only by a
            later generation of this coordinator with the same salt ("" is a scope too: the unsalted
            one). ``swarm serve`` puts a request's ``cache_salt`` (or ``user``) here, so neither
            ``cached_tokens`` nor the prefill time tells one client another's prompt.
    Raises:
        ConfigError: ``max_new_tokens`` is negative.
    """

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    spec: SpecConfig | None = None
    drafter: object | None = None
    sampling: SamplingParams | None = None
    wire_dtype: str | None = None
    heal: bool = True
    job: dict | None = None
    shadow: bool = False
    prefix_cache: bool = False
    prefix_salt: str = ""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not isinstance(self.prefix_salt, str):
            raise ConfigError(f"prefix_salt must be a string, got {type(self.prefix_salt).__name__}")
        object.__setattr__(self, "stop_ids", frozenset(self.stop_ids))
        if self.spec is None:
            object.__setattr__(self, "spec", SpecConfig())
        if self.sampling is None:
            object.__setattr__(self, "sampling", SamplingParams())


@dataclass(frozen=True)
class DecodeResult:
    """What ``decode`` produced and how it went.

    Attributes:
        output_ids: the new token ids (committed output; the prompt not included).
        tokens_per_s: decode rate after the first token (None with fewer than two tokens).
        ttft_s: seconds from the start to the first new token (None: stopped before it).
        cached_tokens: leading prompt positions every stage took from its prefix cache.
        total_s: seconds from the start to the last result.
        context_limited: ``max_new_tokens`` was capped by the ring's maximum context.
        stopped: ``should_stop`` ended the generation.
        sampling: the sampling settings as sent on the wire (``SamplingParams.to_wire``).
        wire_dtype: the wire dtype, ``"stage"`` for each stage's own.
        wire_lossy: a stage's hidden states crossed the wire in a narrower dtype than its own.
        kernels_proven: every stage's start-up check proved row-invariant kernels.
        heal_events: ``HealEvent.as_dict()`` of each heal, in order.
        spec: drafter name, k, depth, prefill_chunk and the speculation statistics.
        receipt_parts: with a job: stage_receipts (ring order, None where missing), problems, sent
            and received digests, segments, collect_s; else None.
    """

    output_ids: list[int]
    tokens_per_s: float | None
    ttft_s: float | None
    cached_tokens: int
    total_s: float
    context_limited: bool
    stopped: bool
    sampling: dict
    wire_dtype: str
    wire_lossy: bool
    kernels_proven: bool
    heal_events: list[dict]
    spec: dict
    receipt_parts: dict | None = None

    def as_record(self) -> dict:
        """The result record as a dict, without ``output_ids`` (what ``generate``'s JSON and a job
        receipt's ``record`` carry), ``receipt_parts`` only with a job."""
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("output_ids", "receipt_parts")}
        if self.receipt_parts is not None:
            record["receipt_parts"] = self.receipt_parts
        return record


async def decode(ring: RingClient, prompt_ids: list[int], options: DecodeOptions, *, on_ids=None,
                 should_stop=None, on_open=None, answer_len=None) -> DecodeResult:
    """Generate over a connected ring, speculatively when ``options`` gives a drafter and ``spec.k``.

    Prefill goes round in chunks of ``spec.prefill_chunk`` positions, pipelined across stages;
    decode sends verify chunks ``[last committed] + K drafts`` with up to ``spec.depth`` in flight
    (``swarm.coordinator.spec.SpecLoop``). Output is token-for-token plain greedy (or plain keyed sampling).
    When a stage is lost (its stream ends) or frozen (it stops answering heartbeats), and the ring
    file lists a warm spare for its layers, the ring heals (``swarm.heal.run_heal``): the spare
    is swapped in, the session reopened, prompt + committed output replayed in prefill chunks, the
    driver token checked, and generation continues; the output equals an uninterrupted run. A stage
    found lost while the session opens (one that died since an earlier session of this client, as in
    ``swarm serve``'s kept clients) is healed the same way, before anything is committed: the session
    is opened afresh on the healed ring and the prefill runs from the start (``cached_tokens`` 0).

    Args:
        ring: a RingClient after ``connect``.
        prompt_ids: the prompt's token ids (non-empty).
        options: limits, speculation, sampling, wire dtype, heals, job, shadows, prefix reuse.
        on_ids: called with the full list of new ids after each commit (for streaming).
        should_stop: called with the new ids after the session opened and after every result (also
            a prefill chunk's, so a long prefill stops within one chunk); True ends the generation
            there (e.g. a stop string appeared, or the client left). ``stopped`` in the result says so.
        on_open: called once the session is open at every stage (the ring admitted it), before
            the prefill (``swarm serve`` sends a streaming response's status only then).
        answer_len: called with the new ids once generation ended: how many leading ids the answer
            holds (e.g. up to the one that completed a stop string). Under speculation the last
            verify chunk may commit ids past it; they are left out of ``output_ids``, the job
            receipt and what the prefix caches keep, as plain decoding would never have made them.
    Returns:
        a DecodeResult (``as_record()`` gives the dict ``--json`` prints).
    Raises:
        ContextOverflow: the prompt does not fit the ring's context (checked before anything is sent;
            a generation that would outgrow it is capped instead, ``context_limited``). StageLost,
            HopTimeout, RemoteError;
        swarm.heal.NoSpare / ReplayMismatch / HealError when a heal is impossible.
    """
    spec, sampling, job = options.spec, options.sampling, options.job
    budget = _context_budget(ring, prompt_ids, options.max_new_tokens)
    loop = SpecLoop(prompt_ids, budget, options.stop_ids, options.drafter or NoDrafter(), k=spec.k, depth=spec.depth,
                    prefill_chunk=spec.prefill_chunk, rotary_switch=ring.rotary_switch)
    gen = Generation(uuid.uuid4().hex, len(prompt_ids) + budget, None if sampling.greedy else sampling.to_wire(),
                     options.wire_dtype, job, options.prefix_cache, options.prefix_salt)
    ops = RingOps(ring, loop, gen)
    shadowed = options.heal and options.shadow and await ops.prepare_shadows() > 0
    heal_events: list[HealEvent] = []

    async def heal_after(exc: StageLost) -> bool:
        return await _heal(ops, plan_replay(prompt_ids, loop.output), exc, heal_events)

    t0 = time.perf_counter()
    keep = None
    try:  # from the open on: a session opened at only some stages is closed there in the end too
        cached = await _open_session(ring, loop, gen, prompt_ids, options, shadowed, heal_after)
        if on_open is not None:
            on_open()
        t_first, stopped = await _drive(ring, loop, gen, options.heal, heal_after, on_ids, should_stop)
        t_end = time.perf_counter()
        out = loop.output
        if answer_len is not None:
            out = out[:max(0, min(len(out), answer_len(out)))]
        parts = await _receipt_parts(ring, gen.session) if job is not None else None
        if options.prefix_cache and not loop.rotary_long:  # LongRoPE's long rows fit no shorter prompt
            keep = list(prompt_ids) + list(out)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await ring.close_session(gen.session, keep=keep)
    decode_s = t_end - t_first if t_first is not None else 0.0  # None: stopped before the first token
    return DecodeResult(
        output_ids=out,
        tokens_per_s=(len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        ttft_s=t_first - t0 if t_first is not None else None,
        cached_tokens=cached,
        total_s=t_end - t0,
        context_limited=budget < options.max_new_tokens,
        stopped=stopped,
        sampling=sampling.to_wire(),
        wire_dtype=options.wire_dtype or "stage",
        wire_lossy=any(wire.is_lossy(options.wire_dtype, i.dtype) for i in ring.infos),
        kernels_proven=all(i.rows_proven for i in ring.infos),
        heal_events=[e.as_dict() for e in heal_events],
        spec={"draft": getattr(options.drafter, "name", "none"), "k": spec.k, "depth": spec.depth,
              "prefill_chunk": spec.prefill_chunk, **loop.stats.as_dict()},
        receipt_parts=parts,
    )


def _context_budget(ring: RingClient, prompt_ids: list[int], max_new_tokens: int) -> int:
    """How many new tokens fit the ring's context after the prompt (at most ``max_new_tokens``);
    warns about stages whose kernels are unproven.

    Raises:
        ContextOverflow: the prompt alone does not fit (nothing was sent).
    """
    max_ctx = min(i.max_ctx for i in ring.infos)
    if len(prompt_ids) >= max_ctx:
        raise ContextOverflow(f"the prompt has {len(prompt_ids)} tokens; the ring's maximum context is {max_ctx} "
                              "(nothing was sent)")
    budget = min(max_new_tokens, max_ctx - len(prompt_ids))
    if budget < max_new_tokens:
        # said once: the caller reports context_limited (swarm coordinate prints a note)
        log.info("context.limit prompt_tokens=%d max_ctx=%d new_tokens_capped_at=%d", len(prompt_ids), max_ctx, budget)
    unproven = [i.index for i in ring.infos if not i.rows_proven]
    if unproven:
        log.warning("kernels.unproven stages=%s: their start-up check failed, so speculative or healed output may "
                    "differ from plain greedy in the last bits (see those stages' logs)", unproven)
    return budget


async def _heal(ops: RingOps, replay, exc: StageLost, heal_events: list[HealEvent]) -> bool:
    """Heal after ``exc`` (``run_heal``) and append the event to ``heal_events``; False when the
    re-check found every stage answering (nothing was replaced)."""
    detected = time.monotonic()
    log.warning("heal.start cause=%s", exc)
    event = await run_heal(ops, replay, detected, str(exc))
    if event is None:
        return False
    log.warning("heal.done stage=%d layers=[%d, %d) spare=%s replay=%s detect_s=%.2f swap_s=%.2f "
                "replay_tokens=%d survivor_tokens=%d replay_s=%.2f total_s=%.2f%s", event.stage,
                *event.layers, event.spare, event.replay, event.detect_s, event.swap_s,
                event.replay_tokens, event.survivor_tokens, event.replay_s, event.total_s,
                f" fallback={event.fallback}" if event.fallback else "")
    heal_events.append(event)
    return True


async def _open_session(ring: RingClient, loop: SpecLoop, gen: Generation, prompt_ids: list[int],
                        options: DecodeOptions, shadowed: bool, heal_after) -> int:
    """Open the generation's session at every stage (healing a stage found lost meanwhile).

    Returns:
        the leading prompt positions taken from the stages' prefix caches (``cached_tokens``).
    """
    for attempt in range(1, OPEN_ATTEMPTS + 1):
        try:
            reused = await ring.open_session(gen.session, gen.max_len, gen.sampling,
                                             options.wire_dtype, job=options.job, shadow=shadowed,
                                             prefix_ids=list(prompt_ids) if options.prefix_cache else None,
                                             prefix_salt=options.prefix_salt)
            cached = min(reused, len(prompt_ids) - 1)
            return loop.skip_prefix(cached)  # 0 for a prompt past LongRoPE's switch
        except HEALABLE as exc:
            # e.g. a stage that died since the last session of a kept client (swarm serve). The open went
            # tail first, so some stages may hold the session: the heal's reset closes it there, opens a
            # fresh one on the healed ring (a replacement holds no prefix: nothing is reused), and the
            # prefill runs from position 0 (nothing committed)
            if not options.heal:
                raise
            if await heal_after(exc):
                return 0
            if attempt == OPEN_ATTEMPTS:
                log.warning("heal.skipped cause=%s: every stage answers and nothing is stuck, so no stage is "
                            "replaced; the session could not be opened", exc)
                raise
            # a stage paused during the open and answers again (issue 31's chaos soak: a 503): the
            # session is closed where it was opened and opened again under a fresh id
            log.warning("heal.skipped cause=%s: every stage answers again and nothing is stuck; opening the "
                        "session again", exc)
            with trio.move_on_after(2.0):
                await ring.close_session(gen.session, timeout_s=1.0)
            gen.session = uuid.uuid4().hex
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _drive(ring: RingClient, loop: SpecLoop, gen: Generation, heal: bool, heal_after, on_ids,
                 should_stop) -> tuple[float | None, bool]:
    """Send the loop's chunks and commit the tail's results until the loop is done or ``should_stop``
    says so, healing lost stages (with ``heal``).

    Returns:
        (``time.perf_counter()`` of the first new token or None, whether ``should_stop`` ended it).
    """
    t_first = None
    while not loop.done:
        if should_stop is not None and should_stop(loop.output):
            return t_first, True
        try:
            for chunk in loop.next_chunks():
                await ring.send_chunk(gen.session, chunk)
            msg = await ring.next_result(gen.session)
        except HEALABLE as exc:
            if not heal:
                raise
            if not await heal_after(exc):  # re-checked: every stage answers and moves again (a pause)
                log.warning("heal.skipped cause=%s: every stage answers again and nothing is stuck; no stage "
                            "replaced, generation goes on", exc)
            continue
        epoch = loop.epoch
        new = loop.on_result(msg.chunk, msg.epoch, msg.token_ids)
        if loop.epoch != epoch and not loop.done:
            await ring.cancel(gen.session, loop.epoch)
        if new:
            t_first = t_first or time.perf_counter()
            if on_ids:
                on_ids(loop.output)
    return t_first, False


async def _receipt_parts(ring: RingClient, session: str) -> dict:
    """The stages' signed receipts of ``session`` (the one that finished the job: after a heal, the
    replayed one) and this client's digests of what it sent and received (``write_job_receipt``)."""
    t_collect = time.perf_counter()
    stage_receipts, problems = await ring.collect_receipts(session)
    book = ring.books[session]
    sent, received = book.ledger
    parts = {"stage_receipts": stage_receipts, "problems": problems, "sent": sent.as_dict(),
             "received": received.as_dict(), "segments": list(book.segments),
             "collect_s": time.perf_counter() - t_collect}
    for p in problems:
        log.warning("receipt.missing %s", p)
    return parts

"""The stage server: one block of layers served on ``/swarm/ring/1``, frame by frame.

Owns: ``StageServer``: its ``info``, the task per inbound stream (frames read in order, each
validated, an invalid one answered with an error naming the problem), the dispatch of ``info``,
``drain``, ``open``, ``forward``, ``refill``, ``repair``, ``receipt``, ``cancel``, ``progress`` and
``close`` frames, and
the sessions' lifecycle (admission at ``open``: signed assignment, allowed coordinators, ``--max-ctx``,
``--kv-budget-mb``; who may steer a session; failing one session alone; expiry after
``--session-ttl-s``; the drain; a heal's ``repair``: re-pointing a surviving session at a
replacement neighbour and resending the hidden states it sent, promoting a shadow session, or
promoting the session's mirror to the shadow it copies to; ``open`` with ``mirror`` starts that
mirror, :class:`swarm.mirror.Mirror`). A checked ``forward``, ``refill`` or ``receipt`` is queued
for the scheduler.

The rest of the class comes from the mixins of this package, one concern each: ``scheduler``
(steps, the compute, kernel proofs), ``outbox`` (ordered sending, successor streams) and
``signing`` (the stage receipt); ``session`` holds the per-session state, ``daemon`` the process
around the server. May import: trio, ``swarm.wire``, ``swarm.receipts``, ``swarm.config``,
``swarm.errors``, ``swarm.mirror``, ``swarm.addrs``, the modules of this package.
"""

from __future__ import annotations

import logging
import time

import trio

from swarm import receipts, wire
from swarm.addrs import peer_id_from_addr
from swarm.config import StageConfig
from swarm.errors import ConfigError, ContextOverflow, ProtocolError, StreamClosed, SwarmError
from swarm.ranges import LayerRange
from swarm.mirror import Mirror
from swarm.stage.outbox import OutboxMixin
from swarm.stage.scheduler import MAX_QUEUED, SchedulerMixin
from swarm.stage.session import Job, SentLog, Session, session_of
from swarm.stage.signing import SigningMixin
from swarm.wire import PROTOCOL_ID

log = logging.getLogger(__name__)


class StageServer(SchedulerMixin, OutboxMixin, SigningMixin):
    """Serves a loaded LayerBlock on a SwarmHost. Create, then ``await serve(host)``."""

    def __init__(self, config: StageConfig, block, model_name: str, model_digest: str, key=None):
        self.config = config
        self.key = key  # the node's ed25519 KeyPair: signs receipts (serve() sets it to the host key)
        self.block = block
        self.model_name = model_name
        self.model_digest = model_digest
        self.sessions: dict[str, Session] = {}
        # KV bytes of opens admitted but still in progress (dialing the successor, proving a tile,
        # reusing a prefix): counted against --kv-budget-mb so concurrent opens cannot over-admit
        self.opening: dict[str, int] = {}
        self.refusals: dict[str, int] = {}  # error frames sent, by reason (metrics)
        self.repairs = 0  # heal repairs applied (metrics)
        self.receipts_signed = 0
        self._in_flight = 0  # chunks being computed or frames waiting in an outbox (see idle())
        self._init_outboxes()
        self._init_scheduler()  # proves the kernels
        self.metrics = None  # swarm.stage.metrics.StageMetrics with --metrics-listen (its histograms cost a little per step)
        if config.metrics_listen:
            from swarm.stage.metrics import StageMetrics

            self.metrics = StageMetrics(self)
        self.host = None
        self.nursery = None  # background tasks (successor drains), set by serve()
        self.draining = False  # no new sessions; set by drain()
        self.drain_requested = trio.Event()  # a drain frame from an --admin peer
        self.model_id: str | None = None  # weights id (swarm.weights.manifest), set when the stage joins a swarm
        self.move_to: LayerRange | None = None  # set by a rebalance: restart on this block after the drain
        self.announcer = None  # swarm.discovery.announce.Announcer while the stage announces
        self.reachable: bool | None = None  # what the dial-back found (None: not asked, or no answer)
        self._storing: set = set()  # trio.Events of sessions' KV being kept in the prefix cache now
        self.prefix = None  # swarm.stage.prefix.PrefixStore: finished sessions' KV as reusable blocks
        if config.prefix_cache_mb > 0:
            from swarm.stage.prefix import PrefixStore

            self.prefix = PrefixStore(config.prefix_block, budget_bytes=self._prefix_allowed)
        if config.max_ctx is not None:
            if config.max_ctx > block.max_ctx:
                raise ConfigError(f"--max-ctx {config.max_ctx} exceeds the model's maximum context of {block.max_ctx}")
            block.max_ctx = config.max_ctx

    def _error(self, reason: str, code: str = "bad_request", session: str | None = None,
               why: str | None = None) -> dict:
        """``wire.error_frame``, counted for the metrics by ``why`` (default: the code), e.g. busy,
        forbidden, overflow, draining (``swarm_stage_refusals_total``)."""
        key = why or code
        self.refusals[key] = self.refusals.get(key, 0) + 1
        return wire.error_frame(reason, code, session)

    def info(self) -> dict:
        b = self.block
        return wire.frame(
            "info_ok", peer_id=self.host.peer_id, model=self.model_name, model_digest=self.model_digest,
            model_id=self.model_id,
            layers=b.layer_range.as_list(), num_layers=b.num_layers, hidden_size=b.hidden_size,
            vocab_size=b.vocab_size, dtype=str(b.dtype).removeprefix("torch."), max_ctx=b.max_ctx,
            sessions=len(self.sessions), kv_bytes=sum(x.cache.nbytes() for x in self.sessions.values()),
            kv_reserved_bytes=self.reserved_bytes(), draining=self.draining,
            batching={"max_batch_rows": self.max_batch_rows, "batch_tile": self.tile or 0,
                      "prefill_slice": self.config.prefill_slice,
                      "prefill_slice_shared": self.config.prefill_slice_shared, **self.stats},
            kernels=self.kernels,
            prefix_cache=self.prefix_stats(),
            hops=[s.hop_state() for s in list(self.successors.values()) if not s.closed],
            timing=dict(self.timing),
        )

    async def handle_stream(self, stream) -> None:
        """Serve every frame arriving on one inbound stream until the peer closes it."""
        peer = getattr(stream, "remote_peer_id", "?")
        log.debug("stream.open peer=%s", peer)
        try:
            while True:
                try:
                    msg = await stream.recv()
                except StreamClosed as exc:
                    log.debug("stream.ended peer=%s reason=%s", peer, exc)
                    break
                except ProtocolError as exc:  # the byte stream is broken: say why, then drop it
                    log.warning("frame.invalid peer=%s reason=%s", peer, exc)
                    await self._try_send(stream, self._error(str(exc)))
                    break
                await self.handle_frame(stream, msg)
        except StreamClosed as exc:  # we answered a peer that had already gone
            log.info("stream.gone peer=%s reason=%s", peer, exc)
        except Exception:  # root of a connection task: log, never take the daemon down
            log.exception("stream.crashed peer=%s", peer)
        finally:
            self._drop_sessions_of(stream)
            box = self._close_outbox(stream)
            with trio.move_on_after(1):
                if box is not None:  # never close a stream under a send in progress
                    await box.done.wait()
                await stream.aclose()

    async def handle_frame(self, stream, msg) -> None:
        """Validate and serve one decoded frame from ``stream``; an invalid one gets an error reply
        naming the problem (and fails its session where it belongs to one), nothing else."""
        t0, chunks = time.perf_counter(), self.timing["chunks"]
        try:
            await self.dispatch(stream, wire.validate(msg))
            if self.timing["chunks"] != chunks:  # a forward was queued: its validation and decoding
                self.timing["parse_s"] += time.perf_counter() - t0
        except (ProtocolError, ContextOverflow) as exc:
            log.warning("frame.rejected peer=%s reason=%s", getattr(stream, "remote_peer_id", "?"), exc)
            code = "overflow" if isinstance(exc, ContextOverflow) else "bad_request"
            await self._try_send(stream, self._error(str(exc), code, session=session_of(msg)))
        except (StreamClosed, trio.Cancelled):
            raise
        except Exception as exc:  # a bug reached by some frame: answer it, keep the stream and its sessions
            log.exception("frame.crashed peer=%s", getattr(stream, "remote_peer_id", "?"))
            await self._try_send(stream, self._error(f"internal error: {type(exc).__name__}: {exc}"[:300],
                                                          "internal", session=session_of(msg)))

    async def dispatch(self, stream, msg: dict) -> None:
        kind = msg["type"]
        sess = self.sessions.get(session_of(msg) or "")
        if sess is not None and stream.remote_peer_id in (sess.coordinator, sess.source):
            sess.last_active = trio.current_time()
        if kind == "info":
            await stream.send(self.info())
        elif kind == "drain":
            if stream.remote_peer_id not in self.config.admins:
                log.warning("drain.refused peer=%s", stream.remote_peer_id)
                await stream.send(self._error(f"PeerId {stream.remote_peer_id} may not drain this stage "
                                                   "(not in --admin)", "forbidden"))
                return
            log.warning("drain.requested peer=%s", stream.remote_peer_id)
            await stream.send(wire.frame("drain_ok", sessions=len(self.sessions)))  # before the host may stop
            self.drain_requested.set()
        elif kind == "open":
            await self._open(stream, msg)
        elif kind in ("forward", "refill"):
            await self._forward(stream, msg)
        elif kind == "repair":
            await self._repair(stream, msg)
        elif kind == "receipt":
            await self._receipt(stream, msg)
        elif kind in ("cancel", "progress", "close"):
            sess = self.sessions.get(msg["session"])
            if sess is not None and stream.remote_peer_id != sess.coordinator:
                await self._refuse(stream, sess, kind)
            elif kind == "cancel":
                if sess is not None and msg["epoch"] > sess.epoch:
                    sess.epoch = msg["epoch"]  # queued frames of older epochs are now dropped unseen
                    log.debug("session.cancel session=%s epoch=%d", sess.session_id, sess.epoch)
            elif kind == "progress":
                await stream.send(wire.frame("progress_ok", session=msg["session"], known=sess is not None,
                                             received=sess.received if sess else -1,
                                             sent=sess.sent if sess else -1, busy=bool(sess and sess.busy)))
            else:
                self.sessions.pop(msg["session"], None)
                log.info("session.close session=%s", msg["session"])
                if sess is not None and msg.get("keep") and self.prefix is not None and sess.prefix_ns:
                    self.nursery.start_soon(self._keep_prefix, sess, msg["keep"])
                await stream.send(wire.frame("close_ok", session=msg["session"]))
        else:
            raise ProtocolError(f"a stage does not accept {kind!r} frames")

    async def _open(self, stream, msg: dict) -> None:
        sid, next_addr = msg["session"], msg["next"]
        coordinator = stream.remote_peer_id
        if self.draining:
            await stream.send(self._error(f"stage {self.block.layer_range} is draining (shutting down) and "
                                          "admits no new sessions", "unavailable", sid, why="draining"))
            return
        allowed = self.config.allow_coordinators
        if allowed and coordinator not in allowed:
            log.warning("session.refused session=%s peer=%s reason=not-an-allowed-coordinator", sid, coordinator)
            await stream.send(self._error(f"PeerId {coordinator} may not open sessions on this stage "
                                               "(not in --allow-coordinator)", "forbidden", sid))
            return
        if not receipts.assignment_ok(msg, coordinator):
            raise ProtocolError(f"open frame is not signed by the peer that sent it ({coordinator})")
        try:
            span = self.block.check_span(None if msg.get("layers") is None else LayerRange(*msg["layers"]))
        except ConfigError as exc:
            raise ProtocolError(f"open frame: {exc}") from None
        head, tail = span.start == 0, span.end == self.block.num_layers
        prev = msg.get("prev")
        if head and prev is not None:
            raise ProtocolError(f"stage {span} is the head: its input comes from the coordinator, "
                                "not from a 'prev' stage")
        if not head and prev is None:
            raise ProtocolError(f"stage {span} is not the head and needs 'prev' (the PeerId of "
                                "its predecessor)")
        existing = self.sessions.get(sid)
        if existing is not None and existing.coordinator != coordinator:
            await self._refuse(stream, existing, "open")
            return
        shadow, mirror = bool(msg.get("shadow")), msg.get("mirror")
        if tail and next_addr is not None:
            raise ProtocolError(f"stage {span} is the tail and takes no successor")
        if next_addr is not None and peer_id_from_addr(next_addr) == self.host.peer_id:
            raise ProtocolError("the successor named in 'next' is this stage itself")
        if shadow and (next_addr is not None or mirror is not None):
            raise ProtocolError("a shadow sends nothing on: its open frame names no 'next' and no 'mirror'")
        if not tail and next_addr is None and not shadow:
            raise ProtocolError(f"stage {span} is not the tail and needs a successor")
        if mirror is not None and (tail or peer_id_from_addr(mirror) in (self.host.peer_id, "")
                                   or msg["mirror_until"] <= span.end):
            raise ProtocolError(f"stage {span} cannot mirror to {mirror} up to layer {msg['mirror_until']}: a "
                                "mirror goes to another stage (/p2p/ address) holding the layers after this one's")
        max_len = msg["max_len"] or self.block.max_ctx
        if max_len > self.block.max_ctx:
            raise ContextOverflow(f"the session asks for {max_len} positions; this stage's maximum context is "
                                  f"{self.block.max_ctx}")
        # a non-tail stage keeps the hidden states it sends on (SentLog): reserved with the KV cache
        row_bytes = self.block.hidden_size * wire_itemsize(msg.get("wire_dtype"), self.block.dtype)
        log_rows = 0 if tail else max_len
        if not tail and self.config.heal_log_mb is not None:
            log_rows = min(max_len, int(self.config.heal_log_mb * 2**20) // row_bytes)
        need = max_len * self.block.kv_bytes_per_position(span) + log_rows * row_bytes
        if self.config.kv_budget_mb is not None:
            budget = self.config.kv_budget_bytes
            others = [s for s in self.sessions.values() if s.session_id != sid]
            held = self.reserved_bytes(besides=sid)
            if need > budget:
                raise ContextOverflow(
                    f"the session needs {_mib(need)} of KV cache for {max_len} positions, more than this stage's "
                    f"whole KV budget of {self.config.kv_budget_mb:g} MiB (--kv-budget-mb); ask for fewer positions")
            if self.prefix is not None and held + need + self.prefix.nbytes > budget:
                self.prefix.evict_to(max(0, budget - held - need))  # cold prefixes make room, live sessions never
            if held + need > budget:
                log.warning("session.busy session=%s need=%d held=%d budget=%d", sid, need, held, budget)
                await stream.send(self._error(
                    f"stage {self.block.layer_range} is busy: its KV budget of {self.config.kv_budget_mb:g} MiB "
                    f"(--kv-budget-mb) is taken: {len(others) + len(self.opening)} sessions hold {_mib(held)} and "
                    f"this one needs {_mib(need)} for {max_len} positions; retry when a session ends", "busy", sid))
                return
        self.opening[sid] = need  # held from here, until the session is recorded or the open fails
        try:
            if msg.get("batch") and self.kernels["batch_ok"] is None:
                await self._prove_batch_tile()
            if span != self.block.layer_range:  # the receipt signs the digest of the tensors it runs: hash once
                await trio.to_thread.run_sync(self.block.digest_of, span)
            session = Session(sid, self.block.new_cache(max_len, span), stream, next_addr, coordinator=coordinator,
                              source=prev or coordinator, reserved=need, last_active=trio.current_time(), span=span)
            session.batch = bool(msg.get("batch"))
            if log_rows:
                session.sent_log = SentLog(self.block.hidden_size, log_rows)
            if msg.get("wire_dtype") is not None:
                session.wire_dtype = wire.WIRE_DTYPES[msg["wire_dtype"]]
            if msg.get("job") is not None:
                job_id, nonce = receipts.check_job_field(msg["job"])  # validate() has checked it
                session.ledger = receipts.StageLedger(job_id, nonce)
            if msg.get("sampling") is not None:
                from swarm.config import SamplingParams

                try:
                    params = SamplingParams.from_wire(msg["sampling"])
                except ConfigError as exc:
                    raise ProtocolError(f"open frame: {exc}") from exc
                session.sampling = None if params.greedy else params
            if next_addr is not None:
                session.next_stream = await self._successor_or_answer(stream, sid, next_addr)
                if session.next_stream is None:
                    return
            session.shadow = shadow
            if msg.get("prefix") is not None and self.prefix is not None and not shadow:
                await self._reuse_prefix(session, msg["prefix"])
            self.sessions[sid] = session
            if mirror is not None:  # dialed in the background: a slow shadow never delays this open
                session.mirror = Mirror(sid, mirror, msg["mirror_until"])
                self.nursery.start_soon(self._run_mirror, session, session.mirror)
            log.info("session.open session=%s layers=%s next=%s max_len=%d%s%s", sid, span, next_addr, max_len,
                     " shadow" if shadow else "", f" mirror={mirror}" if mirror else "")
            reused = {"reused": session.reused} if session.prefix_ns else {}
            await stream.send(wire.frame("open_ok", session=sid, **reused))
        finally:
            self.opening.pop(sid, None)

    # ---- prefix cache (issue 17) ---------------------------------------------------------------

    def reserved_bytes(self, besides: str | None = None) -> int:
        """KV bytes reserved against ``--kv-budget-mb``: every live session's, and every open still
        in progress (``opening``), leaving out session ``besides`` (a session re-opened by its owner)."""
        held = sum(s.reserved for s in list(self.sessions.values()) if s.session_id != besides)
        return held + sum(n for sid, n in self.opening.items() if sid != besides)

    def _prefix_allowed(self) -> int:
        """Bytes the prefix cache may hold now: ``--prefix-cache-mb``, and within ``--kv-budget-mb``
        what live sessions do not reserve."""
        allowed = int(self.config.prefix_cache_mb * 2**20)
        budget = self.config.kv_budget_bytes
        if budget is not None:
            allowed = min(allowed, max(0, budget - self.reserved_bytes()))
        return allowed

    def prefix_stats(self) -> dict | None:
        """The prefix cache's counters (``info`` and ``/health``), None when it is off."""
        if self.prefix is None:
            return None
        return {**self.prefix.stats, "budget_bytes": self._prefix_allowed(), "block_tokens": self.config.prefix_block}

    def _prefix_namespace(self, sess: Session, upstream: str) -> str:
        """What a session's cached blocks are scoped by: the coordinator's fingerprint of the path
        before this stage (``upstream``), the coordinator's PeerId (it alone vouches for the ids),
        and what decides this stage's bits: weights, layers, dtype, GEMM tile."""
        import hashlib

        b = self.block
        text = repr([upstream, sess.coordinator, b.digest_of(sess.span), sess.span.as_list(), str(b.dtype),
                     self._tile_of(sess)])
        return hashlib.sha256(text.encode()).hexdigest()

    async def _reuse_prefix(self, sess: Session, prefix: dict) -> None:
        """Fill a new session's KV cache from the prefix cache: the leading whole blocks of the
        prompt ``prefix["ids"]`` that this stage holds, never the prompt's last position (its row
        gives the first token). Checked block by block (a corrupt one ends the reuse there and is
        dropped). Sets ``sess.reused``; the coordinator starts the prefill at the fewest any stage
        reused, rolling the others back to it."""
        store, ids = self.prefix, prefix["ids"]
        sess.prefix_ns = self._prefix_namespace(sess, prefix["ns"])
        if self._storing and ids:  # a session closed just before (a chat's previous turn) is still being kept
            with trio.move_on_after(5.0):
                for done in list(self._storing):
                    await done.wait()
        keys = store.lookup(sess.prefix_ns, ids, len(ids) - 1) if len(ids) > 1 else []  # [] only names the scope
        if not keys:
            return
        store.pin(keys)
        try:
            sess.reused = await trio.to_thread.run_sync(store.load, keys, sess.cache, limiter=self._compute)
        finally:
            store.unpin(keys)
        log.info("prefix.reused session=%s positions=%d", sess.session_id, sess.reused)

    async def _keep_prefix(self, sess: Session, keep: list[int]) -> None:
        """After a session closed: keep the KV of the whole blocks of ``keep`` (its committed ids) that
        its cache computed, rows ``[0, len(keep) - 1)`` (the last committed token was never fed).
        Under the compute limiter, so no step is writing this cache meanwhile."""
        def store() -> int:
            return self.prefix.store(sess.prefix_ns, keep, sess.cache, min(sess.cache.kv_len, len(keep) - 1))

        done = trio.Event()
        self._storing.add(done)
        try:
            stored = await trio.to_thread.run_sync(store, limiter=self._compute)
        except Exception:  # a cache that cannot be kept costs a later prefill, never this stage
            log.exception("prefix.store_failed session=%s", sess.session_id)
            return
        finally:
            self._storing.discard(done)
            done.set()
        log.debug("prefix.stored session=%s blocks=%d", sess.session_id, stored)

    async def _forward(self, stream, msg: dict) -> None:
        """Check a forward (or refill) frame and queue it for the scheduler (:meth:`scheduler`).

        A ``refill`` is computed like a forward but only fills the KV cache of the stages replacing
        a lost range (see :meth:`_repair`): it is no chunk of the coordinator's, so progress
        counters do not move, and it may only reach stages whose layers end by its ``until``."""
        kind, sid = msg["type"], msg["session"]
        sess = self.sessions.get(sid)
        if sess is None:
            await stream.send(self._error(f"no session {sid!r} at stage {self.block.layer_range}", "no_session", sid))
            return
        if stream.remote_peer_id != sess.source:
            await self._refuse(stream, sess, kind)
            return
        if kind == "forward":
            sess.received = max(sess.received, msg["chunk"])
        if sess.ledger is not None:  # every frame received, also the stale ones dropped below
            sess.ledger.input.add(receipts.forward_item(msg) if kind == "forward" else receipts.refill_item(msg))
        if msg["epoch"] < sess.epoch:
            return  # stale speculation: drop before computing
        sess.epoch = msg["epoch"]
        block = self.block
        if kind == "refill" and sess.span.end > msg["until"]:
            await self._fail_session(sess, ProtocolError(
                f"a refill for the layers below {msg['until']} reached stage {sess.span}, whose layers go past them"))
            return
        try:
            # a shadow is sent every frame at the ring's pace, not the coordinator's few in flight: it
            # may fall behind further before it gives up (a heal then refills it as a plain spare)
            limit = MAX_QUEUED * (SHADOW_QUEUE_FACTOR if sess.shadow else 1)
            if len(sess.queue) >= limit:
                raise ProtocolError(f"more than {limit} chunks of the session are waiting at this stage")
            # the chunk may start anywhere up to where the chunks queued before it will have left the cache
            inputs = wire.forward_inputs(msg, is_head=sess.is_head, vocab_size=block.vocab_size,
                                         hidden_size=block.hidden_size,
                                         kv_len=sess.queued_end if sess.queue else sess.cache.kv_len,
                                         max_len=sess.cache.max_len)
        except (ProtocolError, ContextOverflow) as exc:
            await self._fail_session(sess, exc)
            return
        sess.frames_in += 1
        x = inputs["token_ids"] if sess.is_head else inputs["hidden"]
        if msg.get("logits_from", msg["pos"]) > msg["pos"] + x.shape[1]:
            await self._fail_session(sess, ProtocolError(f"forward frame 'logits_from' {msg['logits_from']} lies past "
                                                         f"its last row {msg['pos'] + x.shape[1] - 1}"))
            return
        sess.queued_end = msg["pos"] + x.shape[1]
        self._enqueue(sess, Job(msg, x))
        self.timing["chunks"] += 1

    async def _repair(self, stream, msg: dict) -> None:
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
        """
        sid = msg["session"]
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
        prev, next_addr, resend = msg.get("prev"), msg.get("next"), msg.get("resend")
        tail = sess.is_tail(self.block.num_layers)
        if sess.shadow:
            await self._promote_shadow(stream, sess, msg)
            return
        if prev is not None and sess.is_head:
            raise ProtocolError(f"stage {sess.span} is the head: it has no predecessor to replace")
        if next_addr is not None and tail:
            raise ProtocolError(f"stage {sess.span} is the tail: it has no successor to replace")
        if next_addr is not None and peer_id_from_addr(next_addr) == self.host.peer_id:
            raise ProtocolError("the successor named in 'next' is this stage itself")
        if resend is not None and not msg.get("mirror"):  # a promoted mirror needs only what it did not deliver
            log_ = sess.sent_log
            held = log_.length if log_ is not None else 0
            if held < resend:
                why = f" ({log_.broken})" if log_ is not None and log_.broken else \
                    " (it keeps none: --heal-log-mb)" if log_ is None and not tail else ""
                await stream.send(self._error(
                    f"stage {sess.span} holds the hidden states it sent for {held} positions{why}; the repair asks "
                    f"for {resend}", "no_state", sid))
                return
        new_stream, mirror, start = None, sess.mirror, 0
        if msg.get("mirror"):  # the new successor is the shadow this stage mirrors to: it lacks little or nothing
            if mirror is None or mirror.addr != next_addr or not await mirror.promote():
                why = "it mirrors to no shadow" if mirror is None else f"it mirrors to {mirror.addr}" \
                    if mirror.addr != next_addr else f"its mirror was dropped ({mirror.broken})"
                await stream.send(self._error(f"stage {sess.span} cannot promote {next_addr}: {why}",
                                                   "no_state", sid))
                return
            new_stream, start = mirror.stream, min(mirror.end, resend)
            sess.mirror = None
            held = sess.sent_log.length if sess.sent_log is not None else 0
            if start < resend and held < resend:
                await stream.send(self._error(
                    f"stage {sess.span}: its mirror delivered {start} positions and it holds the hidden states it "
                    f"sent for {held}; the repair asks for {resend}", "no_state", sid))
                return
        elif next_addr is not None:
            new_stream = await self._successor_or_answer(stream, sid, next_addr)
            if new_stream is None:
                return
            if mirror is not None:  # re-pointed at another stage: the shadow is of no use any more
                mirror.drop(f"the successor is now {next_addr}", quiet=True)
                sess.mirror = None
        sess.epoch = max(sess.epoch, msg["epoch"])
        if prev is not None:
            if sess.ledger is not None:
                sess.ledger.cut("input", sess.source)
            sess.source = prev
        if new_stream is not None:
            if sess.ledger is not None:
                sess.ledger.cut("output", peer_id_from_addr(sess.next_addr or ""))
                if msg.get("mirror"):  # the shadow's input digest began with the mirrored frames
                    sess.ledger.output = mirror.digest
            sess.next_addr, sess.next_stream = next_addr, new_stream
            sess.sent = -1  # progress on the new hop starts afresh
        for pos, tensor in (sess.sent_log.frames(resend, REFILL_ROWS, start) if resend and start < resend else []):
            out = wire.frame("refill", session=sid, epoch=sess.epoch, pos=pos, until=msg["until"], hidden=tensor)
            self._post(sess.next_stream, sess, out)
            if sess.ledger is not None:
                sess.ledger.output.add(receipts.refill_item(out))
        resent = max(0, (resend or 0) - start)
        log.info("session.repair session=%s epoch=%d prev=%s next=%s resent=%d kv_len=%d%s", sid, sess.epoch, prev,
                 next_addr, resent, sess.cache.kv_len, f" promoted_mirror=[0, {start})" if msg.get("mirror") else "")
        self.repairs += 1
        ok = wire.frame("repair_ok", session=sid, kv_len=sess.cache.kv_len, resent=resent)
        if msg.get("mirror"):
            ok["mirrored"] = start
        await stream.send(ok)

    async def _promote_shadow(self, stream, sess: Session, msg: dict) -> None:
        """A repair at a shadow: it becomes the stage (a heal swapped it in for the one it shadowed).

        Only ``next`` may be named (the successor it now sends to; none at the tail); its source
        stays the predecessor that mirrored to it. The epoch is left as it is: mirrored frames
        still on their way are computed (their rows are rolled back by later frames as any frame's
        are), and the first frame of the heal's epoch raises it. Its output digest is empty (a
        shadow sends nothing), so nothing is closed. Answers ``repair_ok`` with the positions its
        cache will hold once its queued frames are computed."""
        sid, next_addr = sess.session_id, msg.get("next")
        if msg.get("prev") is not None or msg.get("resend") is not None:
            raise ProtocolError("a repair that promotes a shadow names only 'next'")
        tail = sess.is_tail(self.block.num_layers)
        if tail == (next_addr is not None) or peer_id_from_addr(next_addr or "") == self.host.peer_id:
            raise ProtocolError(f"shadow {sess.span}: the repair that promotes it must name a successor exactly when "
                                "it is not the tail, and not itself")
        if next_addr is not None:
            new_stream = await self._successor_or_answer(stream, sid, next_addr)
            if new_stream is None:
                return
            sess.next_stream, sess.next_addr = new_stream, next_addr
        sess.shadow = False
        kv_len = sess.queued_end if sess.queue else sess.cache.kv_len
        log.info("session.promoted session=%s layers=%s next=%s kv_len=%d", sid, sess.span, next_addr, kv_len)
        await stream.send(wire.frame("repair_ok", session=sid, kv_len=kv_len, resent=0))

    async def _run_mirror(self, sess: Session, mirror: Mirror) -> None:
        """The task of ``sess``'s mirror (:class:`swarm.mirror.Mirror`): its own stream to the
        shadow (never the successor stream other sessions share: the shadow's errors must not reach
        the coordinator as this session's), ended with the session."""

        async def dial(addr):
            return await self.host.open_stream(addr, PROTOCOL_ID, timeout_s=self.config.hop_timeout_s)

        async def relay(err):  # once promoted, the shadow is the successor: its errors go to the coordinator
            await self._try_send(sess.reply, err)

        async def end(s):
            box = self._close_outbox(s)
            if box is not None:
                with trio.move_on_after(1.0):
                    await box.done.wait()

        await mirror.run(dial, lambda: self.sessions.get(sess.session_id) is sess, relay, end)

    async def _receipt(self, stream, msg: dict) -> None:
        """Check a receipt request and queue it behind the session's chunks (see :meth:`_sign_receipt`)."""
        sid = msg["session"]
        sess = self.sessions.get(sid)
        if sess is None:
            await stream.send(self._error(f"no session {sid!r} at stage {self.block.layer_range}", "no_session", sid))
            return
        if stream.remote_peer_id != sess.source:
            await self._refuse(stream, sess, "receipt")
            return
        if sess.ledger is None:
            raise ProtocolError(f"session {sid!r} was opened without a job: there is no receipt to sign")
        self._enqueue(sess, Job(msg))

    def _fail_later(self, sess: Session, reason: str, code: str = "internal") -> None:
        """Fail a session without waiting on its coordinator: the error goes through the outbox."""
        self._forget(sess)
        log.warning("session.failed session=%s code=%s reason=%s", sess.session_id, code, reason)
        self._post(sess.reply, sess, self._error(f"stage {self.block.layer_range}: {reason}"[:300], code,
                                                      sess.session_id))

    def _forget(self, sess: Session) -> None:
        """Drop a session (its KV cache goes with it) and whatever it has queued."""
        if self.sessions.get(sess.session_id) is sess:
            del self.sessions[sess.session_id]
        sess.queue.clear()

    async def expire_idle(self) -> None:
        """Drop sessions idle for longer than ``--session-ttl-s`` (forever; run in the server's nursery)."""
        ttl = self.config.session_ttl_s
        while True:
            await trio.sleep(max(0.05, min(5.0, ttl / 4)))
            now = trio.current_time()
            for sess in [s for s in self.sessions.values() if not s.busy and now - s.last_active > ttl]:
                del self.sessions[sess.session_id]
                log.warning("session.expired session=%s idle_s=%.1f", sess.session_id, now - sess.last_active)
                await self._try_send(sess.reply, self._error(
                    f"stage {self.block.layer_range}: session {sess.session_id!r} expired after {ttl:g} s idle "
                    "(--session-ttl-s)", "no_session", sess.session_id))

    async def drain(self, timeout_s: float) -> dict:
        """Stop admitting sessions, let the open ones finish for up to ``timeout_s``, fail the rest
        with the reason "draining". Returns the DRAINED payload."""
        self.draining = True
        t0 = trio.current_time()
        before = len(self.sessions)
        log.warning("stage.draining sessions=%d timeout_s=%g", before, timeout_s)
        with trio.move_on_after(timeout_s):
            while self.sessions:
                await trio.sleep(0.05)
        failed = list(self.sessions.values())
        for sess in failed:
            self.sessions.pop(sess.session_id, None)
            await self._try_send(sess.reply, self._error(
                f"stage {self.block.layer_range} is draining (shutting down): the session did not finish within "
                f"{timeout_s:g} s", "unavailable", sess.session_id, why="draining"))
        return {"layers": self.block.layer_range.as_list(), "sessions_finished": before - len(failed),
                "sessions_failed": len(failed), "waited_s": round(trio.current_time() - t0, 3)}

    async def _refuse(self, stream, sess: Session, kind: str) -> None:
        """Refuse a frame from a peer the session was not assigned to; the session is untouched."""
        peer = stream.remote_peer_id
        log.warning("frame.refused type=%s session=%s peer=%s expected=%s", kind, sess.session_id, peer,
                    sess.source if kind in ("forward", "receipt") else sess.coordinator)
        await self._try_send(stream, self._error(
            f"stage {self.block.layer_range} refuses {kind!r} for session {sess.session_id!r} from {peer}: "
            "the session was not assigned to that peer", "forbidden", sess.session_id))

    async def _fail_session(self, sess: Session, exc: SwarmError) -> None:
        """Fail one session cleanly: free its KV cache, tell its coordinator why. Others go on."""
        code = "overflow" if isinstance(exc, ContextOverflow) else "bad_request"
        self._forget(sess)
        log.warning("session.failed session=%s code=%s reason=%s", sess.session_id, code, exc)
        await self._try_send(sess.reply, self._error(f"stage {self.block.layer_range}: {exc}", code,
                                                          sess.session_id))

    async def _try_send(self, stream, msg: dict) -> None:
        try:
            await stream.send(msg, timeout_s=5.0)
        except SwarmError as exc:
            log.info("send.failed reason=%s", exc)

    def _drop_sessions_of(self, stream) -> None:
        for sid in [sid for sid, s in self.sessions.items() if s.reply is stream]:
            del self.sessions[sid]
            log.info("session.dropped session=%s reason=coordinator-stream-closed", sid)


REFILL_ROWS = 64  # positions per refill frame a stage resends (about 150 KB at D = 576, float32)
SHADOW_QUEUE_FACTOR = 16  # a shadow may have this many times MAX_QUEUED frames waiting


def wire_itemsize(wire_dtype: str | None, stage_dtype) -> int:
    """Bytes per value of the hidden states a stage sends: the session's wire dtype, else its own."""
    import torch

    dtype = wire.WIRE_DTYPES[wire_dtype] if wire_dtype is not None else stage_dtype
    return torch.empty((), dtype=dtype).element_size()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"

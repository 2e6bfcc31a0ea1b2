"""The stage server: one block of layers served on ``/swarm/ring/1``, frame by frame.

Owns: ``StageServer``: its ``info``, a task per inbound stream (frames read in order, each validated), the
dispatch of every frame type and the sessions' lifecycle (admission, who may steer a session, failing one
alone, expiry, the drain). It wires together the package's objects, one concern each, each given what it uses.
"""

from __future__ import annotations

import logging
import time

import trio

from swarm import receipts, wire
from swarm.config import StageConfig
from swarm.errors import ConfigError, ContextOverflow, ProtocolError, StreamClosed, SwarmError
from swarm.frames import (Audit, AuditOffer, Cancel, Close, CloseOk, Drain, DrainOk, Error, Forward, Frame, Info,
                          InfoOk, Open, OpenOk, Progress, ProgressOk, Receipt, Refill, Repair)
from swarm.mirror import Mirror
from swarm.ranges import LayerRange
from swarm.stage.admission import Reservations, decide, kv_need, open_links, open_place, wire_itemsize
from swarm.stage.outbox import Outboxes, try_send
from swarm.stage.openings import Audits
from swarm.stage.auditor_role import AuditorRole
from swarm.stage.repair import Repairs
from swarm.stage.retention import RetentionStore
from swarm.stage.runtime import StageRuntime
from swarm.stage.scheduler import TIMING_FIELDS, Scheduler, chunk_input
from swarm.stage.session import Evidence, Job, SentLog, Session, session_of
from swarm.stage.signing import ReceiptSigner

log = logging.getLogger(__name__)


class StageServer:
    """Serves a loaded LayerBlock on a SwarmHost. Create, then ``await serve(host)``."""

    def __init__(self, config: StageConfig, block, model_name: str, model_digest: str, key=None):
        self.config = config
        # the host, nursery and node key (signs receipts; serve() sets it to the host key when None)
        self.runtime = StageRuntime(config.network.hop_timeout_s, key=key)
        self.block = block
        self.model_name = model_name
        self.model_digest = model_digest
        self.sessions: dict[str, Session] = {}
        self.refusals: dict[str, int] = {}  # error frames sent, by reason (metrics)
        self.metrics = None  # swarm.stage.metrics.StageMetrics with --metrics-listen (its histograms cost a little per step)
        if config.network.metrics_listen:
            from swarm.stage.metrics import StageMetrics

            self.metrics = StageMetrics(self)
        self.timing = dict.fromkeys(TIMING_FIELDS, 0)  # a few perf_counter calls per frame and step
        self.reservations = Reservations(self.sessions)
        run = self.runtime
        self.outboxes = Outboxes(self.sessions, block.layer_range, block.num_layers, self.timing,
                                 hop_timeout_s=config.network.hop_timeout_s, error=self._error, metrics=self.metrics,
                                 dial=run.dial, spawn=run.spawn)
        self.scheduler = Scheduler(config.scheduling, block, self.sessions, self.timing, fail=self._fail_later,
                                   emit=self.outboxes.emit, metrics=self.metrics,  # proves the kernels
                                   sign_receipt=self._sign_receipt)
        self.kernels, self.stats = self.scheduler.kernels, self.scheduler.stats  # the scheduler's (info, metrics)
        self.audits = Audits(_retention(config), block.layer_range, key=run.node_key, peer_id=run.peer_id,
                             busy=self.scheduler.busy, error=self._error)  # openings
        self.auditing = AuditorRole(config.audits.audit_rate, block.layer_range, model_digest,  # offers
                                    live=self.sessions.__len__, error=self._error,
                                    allowed=config.network.allow_coordinators, queue_len=config.audits.audit_queue,
                                    tally_path=config.audits.audit_tally)
        self.signer = ReceiptSigner(block, model_name, model_digest, self.outboxes.post,
                                    tile_of=self.scheduler.tile_of, retain=self.audits.retain)
        self.repairs = Repairs(self.sessions, block, self_peer=run.peer_id, error=self._error,
                               refuse=self._refuse, successor_or_answer=self.outboxes.successor_or_answer,
                               post=self.outboxes.post)
        self.draining = False  # no new sessions; set by drain()
        self.drain_requested = trio.Event()  # a drain frame from an --admin peer
        self.model_id: str | None = None  # weights id (swarm.weights.manifest), set when the stage joins a swarm
        self.move_to: LayerRange | None = None  # set by a rebalance: restart on this block after the drain
        self.announcer = None  # swarm.discovery.announce.Announcer while the stage announces
        self.reachable: bool | None = None  # what the dial-back found (None: not asked, or no answer)
        self.reuse = _prefix_reuse(self)  # swarm.stage.reuse.PrefixReuse: finished sessions' KV, or None
        self.prefix = None if self.reuse is None else self.reuse.store  # its PrefixStore
        if config.admission.max_ctx is not None:
            if config.admission.max_ctx > block.max_ctx:
                raise ConfigError(f"--max-ctx {config.admission.max_ctx} exceeds the model's maximum context of "
                                  f"{block.max_ctx}")
            block.max_ctx = config.admission.max_ctx

    @property
    def host(self):
        """The stage's libp2p host (``serve`` sets it)."""
        return self.runtime.host

    @host.setter
    def host(self, host) -> None:
        self.runtime.host = host

    @property
    def nursery(self):
        """The nursery of the stage's background tasks (``serve`` sets it)."""
        return self.runtime.nursery

    @nursery.setter
    def nursery(self, nursery) -> None:
        self.runtime.nursery = nursery

    @property
    def key(self):
        """The node's KeyPair: signs receipts."""
        return self.runtime.key

    @key.setter
    def key(self, key) -> None:
        self.runtime.key = key

    def _sign_receipt(self, sess: Session) -> None:
        """Sign and post ``sess``'s stage receipt (the scheduler reaches its receipt request)."""
        self.signer.sign(sess, self.runtime.key, self.runtime.peer_id())

    def reserved_bytes(self, besides: str | None = None) -> int:
        """KV bytes reserved against ``--kv-budget-mb``: every live session's, and every open still
        in progress, leaving out session ``besides`` (see :class:`swarm.stage.admission.Reservations`)."""
        return self.reservations.held(besides)

    def prefix_stats(self) -> dict | None:
        """The prefix cache's counters (``info`` and ``/health``), None when it is off."""
        return None if self.reuse is None else self.reuse.stats()

    async def idle(self) -> None:
        """Return once nothing is queued, being computed or waiting to be sent."""
        while self.scheduler.busy() or self.outboxes.in_flight:
            await trio.sleep(0.001)

    def _error(self, reason: str, code: str = "bad_request", session: str | None = None,
               why: str | None = None, epoch: int | None = None) -> Error:
        """``wire.error_frame``, counted for the metrics by ``why`` (default: the code), e.g. busy,
        forbidden, overflow, draining (``swarm_stage_refusals_total``)."""
        key = why or code
        self.refusals[key] = self.refusals.get(key, 0) + 1
        return wire.error_frame(reason, code, session, epoch)

    def info(self) -> InfoOk:
        b = self.block
        return InfoOk(
            peer_id=self.host.peer_id, model=self.model_name, model_digest=self.model_digest,
            model_id=self.model_id, addrs=list(self.host.addrs()),
            layers=b.layer_range.as_list(), num_layers=b.num_layers, hidden_size=b.hidden_size,
            vocab_size=b.vocab_size, dtype=str(b.dtype).removeprefix("torch."), max_ctx=b.max_ctx,
            sessions=len(self.sessions), kv_bytes=sum(x.cache.nbytes() for x in self.sessions.values()),
            kv_reserved_bytes=self.reserved_bytes(), draining=self.draining,
            batching={"max_batch_rows": self.scheduler.settings.max_batch_rows, "batch_tile": self.scheduler.tile or 0,
                      "prefill_slice": self.config.scheduling.prefill_slice,
                      "prefill_slice_shared": self.config.scheduling.prefill_slice_shared,
                      "prefill_piggyback": self.config.scheduling.prefill_piggyback, **self.stats},
            kernels=self.kernels, repro=self.signer.repro_class().as_dict(),
            prefix_cache=self.prefix_stats(),
            auditor=self.auditing.stats() if self.auditing.on else None,
            retention={"jobs": len(self.audits.store), "bytes": self.audits.store.nbytes,
                       "spilled_bytes": self.audits.store.disk_bytes, "evictions": self.audits.store.evictions},
            hops=[s.hop_state() for s in list(self.outboxes.successors.values()) if not s.closed],
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
                    await try_send(stream, self._error(str(exc)))
                    break
                await self.handle_frame(stream, msg)
        except StreamClosed as exc:  # we answered a peer that had already gone
            log.info("stream.gone peer=%s reason=%s", peer, exc)
        except Exception:  # root of a connection task: log, never take the daemon down
            log.exception("stream.crashed peer=%s", peer)
        finally:
            self._drop_sessions_of(stream)
            box = self.outboxes.close(stream)
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
            await try_send(stream, self._error(str(exc), code, session=session_of(msg)))
        except (StreamClosed, trio.Cancelled):
            raise
        except Exception as exc:  # a bug reached by some frame: answer it, keep the stream and its sessions
            log.exception("frame.crashed peer=%s", getattr(stream, "remote_peer_id", "?"))
            await try_send(stream, self._error(f"internal error: {type(exc).__name__}: {exc}"[:300],
                                               "internal", session=session_of(msg)))

    async def dispatch(self, stream, msg: Frame) -> None:
        sess = self.sessions.get(getattr(msg, "session", None) or "")
        if sess is not None and stream.remote_peer_id in (sess.coordinator, sess.source):
            sess.scheduling.last_active = trio.current_time()
        match msg:
            case Info():
                await stream.send(self.info())
            case Drain():
                await self._drain(stream)
            case Open():
                await self._open(stream, msg)
            case Forward() | Refill():
                await self._forward(stream, msg)
            case Repair():
                await self.repairs.repair(stream, msg)
            case Receipt():
                await self._receipt(stream, msg)
            case Audit():  # anyone may ask (rate-limited); answered on its own stream, off the hot path
                await self.audits.answer(stream, msg)
            case AuditOffer():  # the auditor role: a coordinator's job receipt, queued for idle time
                await self.auditing.offer(stream, msg, self.host.peer_id)
            case Cancel() | Progress() | Close() if sess is not None and stream.remote_peer_id != sess.coordinator:
                await self._refuse(stream, sess, msg.TYPE)
            case Cancel():
                if sess is not None and msg.epoch > sess.epoch:
                    sess.epoch = msg.epoch  # queued frames of older epochs are now dropped unseen
                    log.debug("session.cancel session=%s epoch=%d", sess.session_id, sess.epoch)
            case Progress():
                await stream.send(ProgressOk(session=msg.session, known=sess is not None,
                                             received=sess.heal.received if sess else -1,
                                             sent=sess.heal.sent if sess else -1,
                                             busy=bool(sess and sess.scheduling.busy),
                                             lost_successor=bool(sess and sess.heal.successor_lost),
                                             draining=bool(self.draining)))
            case Close():
                self.sessions.pop(msg.session, None)
                log.info("session.close session=%s", msg.session)
                if sess is not None and msg.keep and self.reuse is not None and sess.prefix_ns:
                    self.nursery.start_soon(self.reuse.keep, sess, msg.keep)
                await stream.send(CloseOk(session=msg.session))
            case _:
                raise ProtocolError(f"a stage does not accept {msg.TYPE!r} frames")

    async def _drain(self, stream) -> None:
        """An ``--admin`` peer's drain: answer, then let the daemon drain and exit."""
        if stream.remote_peer_id not in self.config.network.admins:
            log.warning("drain.refused peer=%s", stream.remote_peer_id)
            await stream.send(self._error(f"PeerId {stream.remote_peer_id} may not drain this stage "
                                          "(not in --admin)", "forbidden"))
            return
        log.warning("drain.requested peer=%s", stream.remote_peer_id)
        await stream.send(DrainOk(sessions=len(self.sessions)))  # before the host may stop
        self.drain_requested.set()

    async def _open(self, stream, msg: Open) -> None:
        """Admit a session (see the module docstring) and answer ``open_ok``, or say why not."""
        sid, coordinator = msg.session, stream.remote_peer_id
        if not await self._may_open(stream, sid, coordinator):
            return
        if not receipts.assignment_ok(msg, coordinator):
            raise ProtocolError(f"open frame is not signed by the peer that sent it ({coordinator})")
        place = open_place(msg, self.block)
        existing = self.sessions.get(sid)
        if existing is not None and existing.coordinator != coordinator:
            await self._refuse(stream, existing, "open")
            return
        max_len = open_links(msg, place, self.host.peer_id, self.block.max_ctx)
        row_bytes = self.block.hidden_size * wire_itemsize(msg.wire_dtype, self.block.dtype)
        need, log_rows = kv_need(max_len, self.block.kv_bytes_per_position(place.span), row_bytes, place.tail,
                                 self.config.admission.heal_log_mb)
        if not await self._admit(stream, sid, need, max_len):
            return
        with self.reservations.opening_session(sid, need):  # held until recorded, or the open fails
            session = await self._new_session(stream, msg, place.span, max_len, need, log_rows)
            if session is None:
                return
            self.sessions[sid] = session
            mirror = msg.mirror
            if mirror is not None:  # dialed in the background: a slow shadow never delays this open
                session.heal.mirror = Mirror(sid, mirror, msg.mirror_until)
                self.nursery.start_soon(self.outboxes.run_mirror, session, session.heal.mirror)
            log.info("session.open session=%s layers=%s next=%s max_len=%d%s%s", sid, place.span, msg.next,
                     max_len, " shadow" if session.heal.shadow else "", f" mirror={mirror}" if mirror else "")
            await stream.send(OpenOk(session=sid, reused=session.reused if session.prefix_ns else None))

    async def _may_open(self, stream, sid: str, coordinator: str) -> bool:
        """Refuse an open while draining or from a peer not in ``--allow-coordinator``."""
        if self.draining:
            await stream.send(self._error(f"stage {self.block.layer_range} is draining (shutting down) and "
                                          "admits no new sessions", "unavailable", sid, why="draining"))
            return False
        allowed = self.config.network.allow_coordinators
        if allowed and coordinator not in allowed:
            log.warning("session.refused session=%s peer=%s reason=not-an-allowed-coordinator", sid, coordinator)
            await stream.send(self._error(f"PeerId {coordinator} may not open sessions on this stage "
                                          "(not in --allow-coordinator)", "forbidden", sid))
            return False
        return True

    async def _admit(self, stream, sid: str, need: int, max_len: int) -> bool:
        """``--kv-budget-mb``: admit a session needing ``need`` bytes (evicting cold prefixes for room),
        or answer ``busy``.

        Raises:
            ContextOverflow: the session would not fit the whole budget even alone.
        """
        budget = self.config.admission.kv_budget_bytes
        held = self.reservations.held(besides=sid)
        verdict = decide(need, held, budget, None if self.prefix is None else self.prefix.nbytes)
        if verdict.too_big:
            raise ContextOverflow(
                f"the session needs {_mib(need)} of KV cache for {max_len} positions, more than this stage's "
                f"whole KV budget of {self.config.admission.kv_budget_mb:g} MiB (--kv-budget-mb); ask for fewer "
                "positions")
        if verdict.evict_to is not None:
            self.prefix.evict_to(verdict.evict_to)  # cold prefixes make room, live sessions never
        if not verdict.admit:
            log.warning("session.busy session=%s need=%d held=%d budget=%d", sid, need, held, budget)
            await stream.send(self._error(
                f"stage {self.block.layer_range} is busy: its KV budget of {self.config.admission.kv_budget_mb:g} MiB "
                f"(--kv-budget-mb) is taken: {self.reservations.holders(besides=sid)} sessions hold {_mib(held)} "
                f"and this one needs {_mib(need)} for {max_len} positions; retry when a session ends", "busy", sid))
        return verdict.admit

    async def _new_session(self, stream, msg: Open, span, max_len: int, need: int, log_rows: int) -> Session | None:
        """The admitted session, its cache allocated, its successor reached and its prefix reused;
        None after answering ``stream`` that the successor cannot be reached."""
        sid, next_addr, coordinator = msg.session, msg.next, stream.remote_peer_id
        if msg.batch and self.kernels["batch_ok"] is None:
            await self.scheduler.prove_batch_tile()
        if span != self.block.layer_range:  # the receipt signs the digest of the tensors it runs: hash once
            await trio.to_thread.run_sync(self.block.digest_of, span)
        session = Session(sid, self.block.new_cache(max_len, span), stream, next_addr, coordinator=coordinator,
                          source=msg.prev or coordinator, reserved=need, span=span)
        session.scheduling.last_active = trio.current_time()
        session.batch = bool(msg.batch)
        if log_rows:
            session.heal.sent_log = SentLog(self.block.hidden_size, log_rows)
        if msg.wire_dtype is not None:
            session.wire_dtype = wire.WIRE_DTYPES[msg.wire_dtype]
        if msg.job is not None:
            job_id, nonce = receipts.check_job_field(msg.job)  # validate() has checked it
            session.evidence = Evidence(receipts.StageLedger(job_id, nonce), self.audits.new_log())
        if msg.sampling is not None:
            session.sampling = _sampling_of(msg.sampling)
        if next_addr is not None:
            session.next_stream = await self.outboxes.successor_or_answer(stream, sid, next_addr)
            if session.next_stream is None:
                return None
        session.heal.shadow = bool(msg.shadow)
        if msg.prefix is not None and self.reuse is not None and not session.heal.shadow:
            await self.reuse.reuse(session, msg.prefix)
        return session

    async def _forward(self, stream, msg: Forward | Refill) -> None:
        """Check a forward (or refill) frame and queue it for the scheduler; a frame the session cannot
        take (:func:`swarm.stage.scheduler.chunk_input`) fails the session. A ``refill`` is no chunk of
        the coordinator's: progress counters do not move."""
        kind, sid = msg.TYPE, msg.session
        sess = self.sessions.get(sid)
        if sess is None:
            await stream.send(self._error(f"no session {sid!r} at stage {self.block.layer_range}", "no_session", sid))
            return
        if stream.remote_peer_id != sess.source:
            await self._refuse(stream, sess, kind, msg.epoch)
            return
        forward = isinstance(msg, Forward)
        if forward:
            sess.heal.received = max(sess.heal.received, msg.chunk)
        if sess.evidence is not None:  # every frame received, also the stale ones dropped below
            sess.evidence.ledger.input.add(receipts.forward_item(msg) if forward else receipts.refill_item(msg))
        if msg.epoch < sess.epoch:
            return  # stale speculation: drop before computing
        sess.epoch = msg.epoch
        try:
            x = chunk_input(msg, sess, self.block)
        except (ProtocolError, ContextOverflow) as exc:
            await self._fail_session(sess, exc)
            return
        sess.frames_in += 1
        sess.scheduling.queued_end = msg.pos + x.shape[1]
        self.scheduler.enqueue(sess, Job(msg, x))
        self.timing["chunks"] += 1

    async def _receipt(self, stream, msg: Receipt) -> None:
        """Check a receipt request and queue it behind the session's chunks (signed by
        :meth:`swarm.stage.signing.ReceiptSigner.sign` when the scheduler reaches it)."""
        sid = msg.session
        sess = self.sessions.get(sid)
        if sess is None:
            await stream.send(self._error(f"no session {sid!r} at stage {self.block.layer_range}", "no_session", sid))
            return
        if stream.remote_peer_id != sess.source:
            await self._refuse(stream, sess, "receipt")
            return
        if sess.evidence is None:
            raise ProtocolError(f"session {sid!r} was opened without a job: there is no receipt to sign")
        self.scheduler.enqueue(sess, Job(msg))

    def _fail_later(self, sess: Session, reason: str, code: str = "internal") -> None:
        """Fail a session without waiting on its coordinator: the error goes through the outbox."""
        self._forget(sess)
        log.warning("session.failed session=%s code=%s reason=%s", sess.session_id, code, reason)
        self.outboxes.post(sess.reply, sess, self._error(f"stage {self.block.layer_range}: {reason}"[:300], code,
                                                         sess.session_id))

    def _forget(self, sess: Session) -> None:
        """Drop a session (its KV cache goes with it) and whatever it has queued."""
        if self.sessions.get(sess.session_id) is sess:
            del self.sessions[sess.session_id]
        sess.scheduling.queue.clear()

    async def expire_idle(self) -> None:
        """Drop sessions idle for longer than ``--session-ttl-s`` (forever; run in the server's nursery)."""
        ttl = self.config.admission.session_ttl_s
        while True:
            await trio.sleep(max(0.05, min(5.0, ttl / 4)))
            now = trio.current_time()
            for sess in [s for s in self.sessions.values()
                         if not s.scheduling.busy and now - s.scheduling.last_active > ttl]:
                del self.sessions[sess.session_id]
                log.warning("session.expired session=%s idle_s=%.1f", sess.session_id,
                            now - sess.scheduling.last_active)
                await try_send(sess.reply, self._error(
                    f"stage {self.block.layer_range}: session {sess.session_id!r} expired after {ttl:g} s idle "
                    "(--session-ttl-s)", "no_session", sess.session_id))

    async def drain(self, timeout_s: float) -> dict:
        """Stop admitting sessions, let the open ones finish for up to ``timeout_s``, fail the rest
        with the reason "draining", and move the jobs retained in memory to ``--audit-retention-dir``
        (if any; ``RetentionStore.spill_all``). Returns the DRAINED payload."""
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
            await try_send(sess.reply, self._error(
                f"stage {self.block.layer_range} is draining (shutting down): the session did not finish within "
                f"{timeout_s:g} s", "unavailable", sess.session_id, why="draining"))
        # the rows of recent jobs outlive the process where --audit-retention-dir keeps them: the next run
        # under this key takes them over, so audits of jobs before a restart still open (issue 45 item 18)
        spilled = self.audits.store.spill_all()  # in this thread: audits may still read the store
        if spilled:
            log.info("stage.retention_spilled jobs=%d dir=%s", spilled, self.audits.store.spill_dir)
        return {"layers": self.block.layer_range.as_list(), "sessions_finished": before - len(failed),
                "sessions_failed": len(failed), "waited_s": round(trio.current_time() - t0, 3)}

    async def _refuse(self, stream, sess: Session, kind: str, epoch: int | None = None) -> None:
        """Refuse a frame from a peer the session was not assigned to; the session is untouched.
        ``epoch``: the refused frame's, sent back with the error (a stage relays it to its
        coordinator, which ignores it when it has repaired the session since: a frame of a
        predecessor that a heal replaced, still on its way)."""
        peer = stream.remote_peer_id
        log.warning("frame.refused type=%s session=%s peer=%s expected=%s", kind, sess.session_id, peer,
                    sess.source if kind in ("forward", "refill", "receipt") else sess.coordinator)
        await try_send(stream, self._error(f"stage {self.block.layer_range} refuses {kind!r} for session "
                                           f"{sess.session_id!r} from {peer}: the session was not assigned to that "
                                           "peer", "forbidden", sess.session_id, epoch=epoch))

    async def _fail_session(self, sess: Session, exc: SwarmError) -> None:
        """Fail one session cleanly: free its KV cache, tell its coordinator why. Others go on."""
        code = "overflow" if isinstance(exc, ContextOverflow) else "bad_request"
        self._forget(sess)
        log.warning("session.failed session=%s code=%s reason=%s", sess.session_id, code, exc)
        await try_send(sess.reply, self._error(f"stage {self.block.layer_range}: {exc}", code, sess.session_id))

    def _drop_sessions_of(self, stream) -> None:
        for sid in [sid for sid, s in self.sessions.items() if s.reply is stream]:
            del self.sessions[sid]
            log.info("session.dropped session=%s reason=coordinator-stream-closed", sid)


def _retention(config: StageConfig) -> RetentionStore:
    """The retention store of ``--audit-retention-mb``, spilling to ``--audit-retention-dir`` (cleaned now).

    Raises:
        ConfigError: the spill directory cannot be created, cleaned or written.
    """
    try:
        return RetentionStore(int(config.audits.audit_retention_mb * 2**20), config.audits.audit_retention_dir,
                              int(config.audits.audit_retention_disk_mb * 2**20))
    except OSError as exc:
        raise ConfigError(f"--audit-retention-dir {config.audits.audit_retention_dir}: cannot keep spilled rows there: "
                          f"{exc}") from None


def _prefix_reuse(server: StageServer):
    """The server's ``PrefixReuse`` (``--prefix-cache-mb`` > 0), else None."""
    admission = server.config.admission
    if admission.prefix_cache_mb <= 0:
        return None
    from swarm.stage.reuse import PrefixReuse

    return PrefixReuse(admission.prefix_cache_mb, admission.prefix_block,
                       lambda: server.config.admission.kv_budget_bytes,
                       server.reservations, server.block, server.scheduler.limiter, server.scheduler.tile_of)


def _sampling_of(fields: dict):
    """An open frame's ``sampling`` as ``SamplingParams``, or None for greedy."""
    from swarm.config import SamplingParams

    try:
        params = SamplingParams.from_wire(fields)
    except ConfigError as exc:
        raise ProtocolError(f"open frame: {exc}") from exc
    return None if params.greedy else params


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"

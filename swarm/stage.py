"""The stage daemon: serve one block of layers to the ring over libp2p.

Owns: the ``/swarm/ring/1`` handler, per-session state (KV cache, successor, reply stream), the
hop to the successor, and the lifecycle lines on stdout (``SWARM_STAGE_READY`` /
``SWARM_STAGE_FATAL``). Glue: imports the transport, wire and model modules; nothing imports it.

Data path per frame: the head receives token ids from the coordinator, every stage runs its
layers in a worker thread (so trio and the libp2p host stay responsive), forwards hidden states to
its successor over one persistent stream, and the tail returns argmax token ids straight to the
coordinator on the stream that opened the session.

Scheduling (continuous batching, after Orca, Yu et al. OSDI 2022, with Sarathi-Serve's chunked
prefill, Agrawal et al. OSDI 2024): arriving chunks queue per session; one scheduler task takes,
each step, the next chunk of every ready session that is short (decode/verify rows, at most
``BATCH_CHUNK_MAX`` positions, up to ``--max-batch-rows`` in all) into one packed forward, plus one
``--prefill-slice`` of a long (prefill) chunk, only ``--prefill-slice-shared`` while other sessions
have work waiting, so a long prompt never stalls other sessions. Only
sessions opened with ``batch: true`` (``swarm serve``) are packed; their rows run in fixed
``--batch-tile``-row GEMMs. The others (a single ``swarm coordinate`` stream) run alone, one GEMV
per row, as fast as plain decode. Either way every forward is row-invariant
(:mod:`swarm.kernels.invariant`): a position's bits do not depend on the chunk or the step it
shares, which the stage proves at start-up (:func:`swarm.kernels.check.check_block`) before it
serves a mode. Outputs leave through one ordered outbox per stream.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections import deque
from dataclasses import dataclass, field

import torch
import trio

from swarm import receipts, wire
from swarm.config import StageConfig
from swarm.errors import ConfigError, ContextOverflow, ProtocolError, StreamClosed, SwarmError, collapse
from swarm.wire import PROTOCOL_ID

log = logging.getLogger(__name__)

BATCH_CHUNK_MAX = 16  # chunks of at most this many positions are decode/verify rows: batched across sessions
MAX_QUEUED = 64  # chunks one session may have waiting at a stage (a coordinator keeps a few in flight)


@dataclass
class _Outbox:
    """The frames waiting to be sent on one stream, and the task sending them."""

    send: object  # trio MemorySendChannel of (session, frame, chunk id or None)
    recv: object
    dead: bool = False  # the stream is closed or lost: drop what is queued
    done: trio.Event = field(default_factory=trio.Event)  # set when the sending task has ended


ACTIVE_S = 2.0  # a session with a frame this recent is generating: long prompts beside it yield


@dataclass
class Job:
    """A queued chunk (or receipt request) of one session at this stage."""

    msg: dict
    x: torch.Tensor | None = None  # (1, T) token ids at the head, else (1, T, D); None: a receipt request
    done: int = 0  # positions computed so far (a long chunk is computed a slice per step)
    parts: list = field(default_factory=list)  # outputs of the slices computed so far


@dataclass
class Session:
    """One session's state at this stage."""

    session_id: str
    cache: object
    reply: object  # FramedStream back to the coordinator that opened the session
    next_addr: str | None
    coordinator: str = ""  # PeerId that opened (and alone may steer) the session
    source: str = ""  # PeerId whose forward frames the session accepts: the predecessor, or the coordinator
    next_stream: object | None = None
    epoch: int = 0
    sampling: object = None  # SamplingParams at the tail when the session samples; None = greedy
    wire_dtype: object = None  # torch dtype of hidden states sent on; None = the stage's dtype
    positions: int = 0
    received: int = -1  # highest chunk id received (heal progress reports)
    sent: int = -1  # highest chunk id sent on (the tail: as a result)
    busy: bool = False  # computing a received chunk
    frames_in: int = 0
    frames_out: int = 0
    errors: list = field(default_factory=list)
    ledger: receipts.StageLedger | None = None  # rolling digests, when the open frame named a job
    reserved: int = 0  # KV bytes reserved against --kv-budget-mb (max_len positions)
    last_active: float = 0.0  # trio clock of the last frame for this session
    queue: deque = field(default_factory=deque)  # Jobs waiting for the scheduler, in arrival order
    queued_end: int = 0  # pos + T of the last queued chunk: where the next one may start at most
    batch: bool = False  # may share packed forwards (--batch-tile GEMMs); else alone, one GEMV per row


class StageServer:
    """Serves a loaded LayerBlock on a SwarmHost. Create, then ``await serve(host)``."""

    def __init__(self, config: StageConfig, block, model_name: str, model_digest: str, key=None):
        self.config = config
        self.key = key  # the node's ed25519 KeyPair: signs receipts (serve() sets it to the host key)
        self.block = block
        self.model_name = model_name
        self.model_digest = model_digest
        self.sessions: dict[str, Session] = {}
        self.successors: dict[str, object] = {}  # addr -> FramedStream, one persistent stream per hop
        self._dial_locks: dict[str, trio.Lock] = {}  # successor addr -> lock held while dialing it
        self._runq: dict[int, Session] = {}  # id -> session with queued jobs, in scheduling (round-robin) order
        self._work = trio.Event()  # set when a job is queued
        self._outboxes: dict[object, object] = {}  # stream -> send channel of its ordered outbox
        self._in_flight = 0  # chunks being computed or frames waiting in an outbox (see idle())
        self.tile = config.batch_tile or None  # rows per GEMM of packed (batch) sessions
        self.max_batch_rows = config.max_batch_rows
        self.stats = {"steps": 0, "batched_steps": 0, "rows": 0, "max_sessions": 0, "prefill_slices": 0}
        self.kernels = _prove_kernels(block)  # every session's mode, before anything is served
        self.kernels.update(batch_ok=None, batch_tile=self.tile or 0)  # proven at the first batch session
        self._compute = trio.CapacityLimiter(1)  # one thread computes on the block at a time
        self._batch_proof = trio.Lock()
        self.host = None
        self.nursery = None  # background tasks (successor drains), set by serve()
        self.draining = False  # no new sessions; set by drain()
        self.drain_requested = trio.Event()  # a drain frame from an --admin peer
        if config.max_ctx is not None:
            if config.max_ctx > block.max_ctx:
                raise ConfigError(f"--max-ctx {config.max_ctx} exceeds the model's maximum context of {block.max_ctx}")
            block.max_ctx = config.max_ctx

    def info(self) -> dict:
        b = self.block
        return wire.frame(
            "info_ok", peer_id=self.host.peer_id, model=self.model_name, model_digest=self.model_digest,
            layers=b.layer_range.as_list(), num_layers=b.num_layers, hidden_size=b.hidden_size,
            vocab_size=b.vocab_size, dtype=str(b.dtype).removeprefix("torch."), max_ctx=b.max_ctx,
            sessions=len(self.sessions), kv_bytes=sum(x.cache.nbytes() for x in self.sessions.values()),
            kv_reserved_bytes=sum(x.reserved for x in self.sessions.values()), draining=self.draining,
            batching={"max_batch_rows": self.max_batch_rows, "batch_tile": self.tile or 0,
                      "prefill_slice": self.config.prefill_slice,
                      "prefill_slice_shared": self.config.prefill_slice_shared, **self.stats},
            kernels=self.kernels,
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
                    await self._try_send(stream, wire.error_frame(str(exc)))
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
        try:
            await self.dispatch(stream, wire.validate(msg))
        except (ProtocolError, ContextOverflow) as exc:
            log.warning("frame.rejected peer=%s reason=%s", getattr(stream, "remote_peer_id", "?"), exc)
            code = "overflow" if isinstance(exc, ContextOverflow) else "bad_request"
            await self._try_send(stream, wire.error_frame(str(exc), code, session=_session_of(msg)))
        except (StreamClosed, trio.Cancelled):
            raise
        except Exception as exc:  # a bug reached by some frame: answer it, keep the stream and its sessions
            log.exception("frame.crashed peer=%s", getattr(stream, "remote_peer_id", "?"))
            await self._try_send(stream, wire.error_frame(f"internal error: {type(exc).__name__}: {exc}"[:300],
                                                          "internal", session=_session_of(msg)))

    async def dispatch(self, stream, msg: dict) -> None:
        kind = msg["type"]
        sess = self.sessions.get(_session_of(msg) or "")
        if sess is not None and stream.remote_peer_id in (sess.coordinator, sess.source):
            sess.last_active = trio.current_time()
        if kind == "info":
            await stream.send(self.info())
        elif kind == "drain":
            if stream.remote_peer_id not in self.config.admins:
                log.warning("drain.refused peer=%s", stream.remote_peer_id)
                await stream.send(wire.error_frame(f"PeerId {stream.remote_peer_id} may not drain this stage "
                                                   "(not in --admin)", "forbidden"))
                return
            log.warning("drain.requested peer=%s", stream.remote_peer_id)
            await stream.send(wire.frame("drain_ok", sessions=len(self.sessions)))  # before the host may stop
            self.drain_requested.set()
        elif kind == "open":
            await self._open(stream, msg)
        elif kind == "forward":
            await self._forward(stream, msg)
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
                await stream.send(wire.frame("close_ok", session=msg["session"]))
        else:
            raise ProtocolError(f"a stage does not accept {kind!r} frames")

    async def _open(self, stream, msg: dict) -> None:
        sid, next_addr = msg["session"], msg["next"]
        coordinator = stream.remote_peer_id
        if self.draining:
            await stream.send(wire.error_frame(f"stage {self.block.layer_range} is draining (shutting down) and "
                                               "admits no new sessions", "unavailable", sid))
            return
        allowed = self.config.allow_coordinators
        if allowed and coordinator not in allowed:
            log.warning("session.refused session=%s peer=%s reason=not-an-allowed-coordinator", sid, coordinator)
            await stream.send(wire.error_frame(f"PeerId {coordinator} may not open sessions on this stage "
                                               "(not in --allow-coordinator)", "forbidden", sid))
            return
        if not receipts.assignment_ok(msg, coordinator):
            raise ProtocolError(f"open frame is not signed by the peer that sent it ({coordinator})")
        prev = msg.get("prev")
        if self.block.is_head and prev is not None:
            raise ProtocolError(f"stage {self.block.layer_range} is the head: its input comes from the coordinator, "
                                "not from a 'prev' stage")
        if not self.block.is_head and prev is None:
            raise ProtocolError(f"stage {self.block.layer_range} is not the head and needs 'prev' (the PeerId of "
                                "its predecessor)")
        existing = self.sessions.get(sid)
        if existing is not None and existing.coordinator != coordinator:
            await self._refuse(stream, existing, "open")
            return
        if self.block.is_tail and next_addr is not None:
            raise ProtocolError(f"stage {self.block.layer_range} is the tail and takes no successor")
        if next_addr is not None and next_addr.rsplit("/p2p/", 1)[-1] == self.host.peer_id:
            raise ProtocolError("the successor named in 'next' is this stage itself")
        if not self.block.is_tail and next_addr is None:
            raise ProtocolError(f"stage {self.block.layer_range} is not the tail and needs a successor")
        max_len = msg["max_len"] or self.block.max_ctx
        if max_len > self.block.max_ctx:
            raise ContextOverflow(f"the session asks for {max_len} positions; this stage's maximum context is "
                                  f"{self.block.max_ctx}")
        need = max_len * self.block.kv_bytes_per_position()
        if self.config.kv_budget_mb is not None:
            budget = int(self.config.kv_budget_mb * 2**20)
            others = [s for s in self.sessions.values() if s.session_id != sid]
            held = sum(s.reserved for s in others)
            if need > budget:
                raise ContextOverflow(
                    f"the session needs {_mib(need)} of KV cache for {max_len} positions, more than this stage's "
                    f"whole KV budget of {self.config.kv_budget_mb:g} MiB (--kv-budget-mb); ask for fewer positions")
            if held + need > budget:
                log.warning("session.busy session=%s need=%d held=%d budget=%d", sid, need, held, budget)
                await stream.send(wire.error_frame(
                    f"stage {self.block.layer_range} is busy: its KV budget of {self.config.kv_budget_mb:g} MiB "
                    f"(--kv-budget-mb) is taken: {len(others)} sessions hold {_mib(held)} and this one needs "
                    f"{_mib(need)} for {max_len} positions; retry when a session ends", "busy", sid))
                return
        if msg.get("batch") and self.kernels["batch_ok"] is None:
            await self._prove_batch_tile()
        session = Session(sid, self.block.new_cache(max_len), stream, next_addr, coordinator=coordinator,
                          source=prev or coordinator, reserved=need, last_active=trio.current_time())
        session.batch = bool(msg.get("batch"))
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
            try:
                session.next_stream = await self._successor(next_addr)
            except SwarmError as exc:
                await stream.send(wire.error_frame(f"cannot reach successor {next_addr}: {exc}", "unavailable", sid))
                return
        self.sessions[sid] = session
        log.info("session.open session=%s next=%s max_len=%d", sid, next_addr, max_len)
        await stream.send(wire.frame("open_ok", session=sid))

    async def _successor(self, addr: str):
        """The persistent stream to ``addr``, dialed once. One lock per address: a peer that names a
        slow or dead successor delays only the opens that name the same one."""
        s = self.successors.get(addr)
        if s is not None and not s.closed:
            return s
        lock = self._dial_locks.setdefault(addr, trio.Lock())
        async with lock:
            s = self.successors.get(addr)
            if s is None or s.closed:
                s = await self.host.open_stream(addr, PROTOCOL_ID, timeout_s=self.config.hop_timeout_s)
                self.successors[addr] = s
                self.nursery.start_soon(self._drain_successor, addr, s)
            return s

    async def _drain_successor(self, addr: str, s) -> None:
        """Read what a successor says on our outbound stream (only errors) and relay them."""
        while True:
            try:
                msg = await s.recv()
            except (StreamClosed, ProtocolError):
                if self.successors.get(addr) is s:
                    del self.successors[addr]
                self._close_outbox(s)
                return
            sess = self.sessions.get(_session_of(msg) or "")
            if sess is not None and isinstance(msg, dict) and msg.get("type") == "error":
                await self._try_send(sess.reply, msg)

    async def _forward(self, stream, msg: dict) -> None:
        """Check a forward frame and queue it for the scheduler (:meth:`scheduler`)."""
        sid = msg["session"]
        sess = self.sessions.get(sid)
        if sess is None:
            await stream.send(wire.error_frame(f"no session {sid!r} at stage {self.block.layer_range}", "no_session", sid))
            return
        if stream.remote_peer_id != sess.source:
            await self._refuse(stream, sess, "forward")
            return
        sess.received = max(sess.received, msg["chunk"])
        if sess.ledger is not None:  # every frame received, also the stale ones dropped below
            sess.ledger.input.add(receipts.forward_item(msg))
        if msg["epoch"] < sess.epoch:
            return  # stale speculation: drop before computing
        sess.epoch = msg["epoch"]
        block = self.block
        try:
            if len(sess.queue) >= MAX_QUEUED:
                raise ProtocolError(f"more than {MAX_QUEUED} chunks of the session are waiting at this stage")
            # the chunk may start anywhere up to where the chunks queued before it will have left the cache
            inputs = wire.forward_inputs(msg, is_head=block.is_head, vocab_size=block.vocab_size,
                                         hidden_size=block.hidden_size,
                                         kv_len=sess.queued_end if sess.queue else sess.cache.kv_len,
                                         max_len=sess.cache.max_len)
        except (ProtocolError, ContextOverflow) as exc:
            await self._fail_session(sess, exc)
            return
        sess.frames_in += 1
        x = inputs["token_ids"] if block.is_head else inputs["hidden"]
        if msg.get("logits_from", msg["pos"]) > msg["pos"] + x.shape[1]:
            await self._fail_session(sess, ProtocolError(f"forward frame 'logits_from' {msg['logits_from']} lies past "
                                                         f"its last row {msg['pos'] + x.shape[1] - 1}"))
            return
        sess.queued_end = msg["pos"] + x.shape[1]
        self._enqueue(sess, Job(msg, x))

    async def _receipt(self, stream, msg: dict) -> None:
        """Check a receipt request and queue it behind the session's chunks (see :meth:`_sign_receipt`)."""
        sid = msg["session"]
        sess = self.sessions.get(sid)
        if sess is None:
            await stream.send(wire.error_frame(f"no session {sid!r} at stage {self.block.layer_range}", "no_session", sid))
            return
        if stream.remote_peer_id != sess.source:
            await self._refuse(stream, sess, "receipt")
            return
        if sess.ledger is None:
            raise ProtocolError(f"session {sid!r} was opened without a job: there is no receipt to sign")
        self._enqueue(sess, Job(msg))

    def _enqueue(self, sess: Session, job: Job) -> None:
        sess.queue.append(job)
        sess.busy = True  # until its queue is empty: a probe during a long step sees it
        self._runq.setdefault(id(sess), sess)
        self._work.set()

    async def scheduler(self) -> None:
        """Run scheduling steps while work is queued (forever; started by :func:`serve`)."""
        while True:
            await self._work.wait()
            self._work = trio.Event()
            while True:
                try:
                    if not await self._step():
                        break
                except Exception as exc:  # a bug: fail the sessions waiting, never stop scheduling
                    log.exception("scheduler.step_crashed")
                    for sess in list(self._runq.values()):
                        self._runq.pop(id(sess), None)
                        self._fail_later(sess, f"internal error: {type(exc).__name__}: {exc}")

    async def _step(self) -> bool:
        """One scheduling step: pick, compute in the worker thread, post the outputs. Returns False
        when nothing was ready."""
        wait = self.config.batch_wait_ms
        if wait and any(s.batch for s in self._runq.values()):
            batching = sum(s.batch for s in self.sessions.values())
            ready = sum(s.batch for s in self._runq.values() if s.queue)
            if ready < batching:
                await trio.sleep(wait / 1000)
        small, rows, piece, longs = [], 0, None, 0
        for sess in list(self._runq.values()):
            job = await self._next_job(sess)
            if job is None:
                continue
            t = job.x.shape[1]
            pos = job.msg["pos"] + job.done
            if pos > sess.cache.kv_len:  # a chunk queued before it was dropped or failed
                self._fail_later(sess, f"chunk at pos {pos} is not contiguous with the session's kv_len "
                                       f"{sess.cache.kv_len}", "bad_request")
                continue
            if t <= BATCH_CHUNK_MAX:
                if small and rows + t > self.max_batch_rows:
                    continue
                small.append((sess, job))
                rows += t
            else:  # the long chunk with the least left goes first (shortest remaining first, then round robin)
                longs += 1
                if piece is None or t - job.done < piece[1].x.shape[1] - piece[1].done:
                    piece = (sess, job)
        if not small and piece is None:
            return False  # a chunk queued meanwhile has set self._work again
        if piece is not None:
            # a long prompt yields to others: a row costs about a decode step (row-invariant GEMVs),
            # so while other sessions are generating it advances a few rows per step (Sarathi-Serve's
            # budget). "Generating" means a frame within ACTIVE_S, not work queued right now: in a
            # ring a session's next row is usually at another stage when this step starts.
            now = trio.current_time()
            shared = bool(small) or longs > 1 or any(
                s is not piece[0] and now - s.last_active < ACTIVE_S for s in self.sessions.values())
            piece = (*piece, self.config.prefill_slice_shared if shared else self.config.prefill_slice)
        self._in_flight += 1
        try:
            results = await trio.to_thread.run_sync(self._compute_step, small, piece, limiter=self._compute)
        except Exception as exc:  # a torch failure fails the sessions of this step only; the stage keeps serving
            failed = small + ([piece[:2]] if piece else [])
            log.exception("forward.failed sessions=%s", [s.session_id for s, _ in failed])
            for sess, _ in failed:
                self._fail_later(sess, f"forward failed: {type(exc).__name__}: {exc}")
            return True
        finally:
            self._in_flight -= 1
        self.stats["steps"] += 1
        packed = sum(s.batch for s, _ in small)
        self.stats["batched_steps"] += packed > 1
        self.stats["rows"] += rows
        self.stats["max_sessions"] = max(self.stats["max_sessions"], packed)
        self.stats["prefill_slices"] += piece is not None
        for sess, job, n, payload in results:
            job.done += n
            sess.positions += n
            if self._runq.pop(id(sess), None) is not None:  # round robin: to the back of the line
                self._runq[id(sess)] = sess
            if payload is None:
                continue  # more slices of this chunk to come
            if sess.queue and sess.queue[0] is job:
                sess.queue.popleft()
            if not sess.queue:
                self._runq.pop(id(sess), None)
                sess.busy = False
            try:
                self._emit(sess, job.msg, payload)
            except Exception as exc:  # a bug reached by this session's output: fail it alone
                log.exception("emit.failed session=%s", sess.session_id)
                self._runq.pop(id(sess), None)
                self._fail_later(sess, f"internal error: {type(exc).__name__}: {exc}")
        return True

    async def _next_job(self, sess: Session) -> Job | None:
        """The session's next chunk to compute, after serving receipt requests and dropping stale
        chunks at the front of its queue; None (and out of the run queue) when it has none."""
        while sess.queue and self.sessions.get(sess.session_id) is sess:
            job = sess.queue[0]
            if job.x is None:
                sess.queue.popleft()
                try:
                    self._sign_receipt(sess)
                except Exception as exc:  # e.g. a ledger value the signer cannot encode: this session only
                    log.exception("receipt.failed session=%s", sess.session_id)
                    self._fail_later(sess, f"cannot sign the receipt: {exc}")
            elif job.msg["epoch"] < sess.epoch:
                sess.queue.popleft()  # cancelled speculation: never computed (rolled back by the next chunk)
            else:
                return job
        sess.queue.clear()
        sess.busy = False
        self._runq.pop(id(sess), None)
        return None

    def _compute_step(self, small: list, piece) -> list:
        """Worker-thread body: one packed forward of the short chunks, one slice of a long one; the
        output of each chunk that is now complete is encoded (tail: token ids; others: hidden)."""
        out = []
        block = self.block
        packed = [(s, j) for s, j in small if s.batch]
        if packed:
            ys = block.forward_batch([(s.cache, j.msg["pos"], j.x) for s, j in packed], tile=self._tile_of(packed[0][0]),
                                     logits_rows=[_logits_rows(j.msg, j.msg["pos"], j.x.shape[1]) for _, j in packed])
            out += [(s, j, j.msg["pos"], j.x.shape[1], y) for (s, j), y in zip(packed, ys)]
        for s, j in small:  # sessions that did not ask to batch: each alone, one GEMV per row
            if not s.batch:
                n = j.x.shape[1]
                y = block.forward_batch([(s.cache, j.msg["pos"], j.x)], logits_rows=[_logits_rows(j.msg, j.msg["pos"], n)])
                out.append((s, j, j.msg["pos"], n, y[0]))
        if piece is not None:
            s, j, slice_rows = piece
            n = min(slice_rows, j.x.shape[1] - j.done)
            pos = j.msg["pos"] + j.done
            y = block.forward_batch([(s.cache, pos, j.x[:, j.done:j.done + n])], tile=self._tile_of(s),
                                    logits_rows=[_logits_rows(j.msg, pos, n)])[0]
            out.append((s, j, pos, n, y))
        results = []
        for s, j, pos, n, y in out:
            part = self._decide(s, pos + n - y.shape[1], y) if block.is_tail else y
            complete = j.done + n == j.x.shape[1]
            if complete and j.parts:
                part = (sum(j.parts, []) + part) if block.is_tail else torch.cat([*j.parts, part], dim=1)
            elif not complete:
                j.parts.append(part)
            payload = None
            if complete:
                payload = part if self.block.is_tail else wire.encode_tensor(part, dtype=s.wire_dtype)
            results.append((s, j, n, payload))
        return results

    async def _prove_batch_tile(self) -> None:
        """Prove ``--batch-tile`` on this block before the first session that may be packed is opened
        (a few seconds on a real model, once; sessions that do not batch never wait for it). A tile
        that fails its proof is replaced by 1 for every packed session, with a log line saying why."""
        async with self._batch_proof:
            if self.kernels["batch_ok"] is not None:
                return
            tile = self.tile or 1
            report = await trio.to_thread.run_sync(_prove_tile, self.block, tile, limiter=self._compute)
            self.kernels.update(batch_ok=report.ok, check_s=round(self.kernels["check_s"] + report.seconds, 3))
            if not report.ok:
                self.kernels["reason"] = report.reason
                self.tile = 1  # packed sessions then take one GEMV per row: invariant by construction

    def _tile_of(self, sess: Session) -> int:
        """Rows per GEMM for every forward of ``sess``, fixed for its life (its bits depend on it)."""
        return (self.tile or 1) if sess.batch else 1

    def _decide(self, sess: Session, pos: int, logits: torch.Tensor) -> list[int]:
        """Tail: the token after each of the rows at ``[pos, pos + T)``: argmax, or sampled keyed by
        (seed, that position)."""
        if sess.sampling is None:
            return logits[0].argmax(dim=-1).tolist()
        from swarm.model.sampling import sample

        return [sample(logits[0, i], pos + i + 1, sess.sampling) for i in range(logits.shape[1])]

    def _emit(self, sess: Session, msg: dict, payload) -> None:
        """Post a computed chunk's output: the tail's result to the coordinator, else hidden states on."""
        if msg["epoch"] < sess.epoch or self.sessions.get(sess.session_id) is not sess:
            return  # cancelled or failed while computing: the rows it wrote are rolled back by the next chunk
        meta = {k: msg[k] for k in ("session", "epoch", "pos", "chunk", "logits_from") if k in msg}
        if self.block.is_tail:
            sent = wire.frame("result", token_ids=payload, **meta)
            self._post(sess.reply, sess, sent, msg["chunk"])
            item = receipts.result_item(sent)
        else:
            sent = wire.frame("forward", hidden=payload, **meta)
            self._post(sess.next_stream, sess, sent, msg["chunk"])
            item = receipts.forward_item(sent)
        if sess.ledger is not None:  # in posting order = the order the stream carries them
            sess.ledger.output.add(item)

    def _sign_receipt(self, sess: Session) -> None:
        """Sign this stage's receipt for the session, post it to the coordinator, pass the request on.

        The request travels the data path (coordinator -> head -> ... -> tail) behind every frame of
        the session; it is queued behind the session's chunks and each outbox keeps posting order,
        so every receipt covers all frames its predecessor sent: the digests of neighbours match.
        """
        b, sid = self.block, sess.session_id
        body = sess.ledger.body(
            session=sid, coordinator=sess.coordinator, peer_id=self.host.peer_id, model=self.model_name,
            model_digest=self.model_digest, range_digest=getattr(b, "range_digest", ""), layers=b.layer_range.as_list(), num_layers=b.num_layers,
            dtype=str(b.dtype).removeprefix("torch."),
            wire_dtype="token_ids" if b.is_tail else wire.DTYPE_NAMES.get(sess.wire_dtype or b.dtype, "?"),
            positions=sess.positions)
        from swarm.transport.identity import sign

        signed = receipts.sign_receipt(body, lambda data: sign(self.key, data))
        log.info("receipt.signed session=%s job=%s in=%d out=%d", sid, sess.ledger.job_id,
                 sess.ledger.input.frames, sess.ledger.output.frames)
        self._post(sess.reply, sess, wire.frame("receipt_ok", session=sid, receipt=signed))
        if not b.is_tail:
            self._post(sess.next_stream, sess, wire.frame("receipt", session=sid))

    def _post(self, stream, sess: Session, msg: dict, chunk: int | None = None) -> None:
        """Queue ``msg`` on ``stream``'s outbox: one task per stream sends in posting order, so a slow
        peer delays only the sessions that send to it. Nothing is queued on a closed stream."""
        if stream is None or stream.closed:
            return
        box = self._outboxes.get(stream)
        if box is None:
            box = _Outbox(*trio.open_memory_channel(math.inf))
            self._outboxes[stream] = box
            self.nursery.start_soon(self._outbox, stream, box)
        box.send.send_nowait((sess, msg, chunk))
        self._in_flight += 1

    async def _outbox(self, stream, box: _Outbox) -> None:
        """Send one stream's queued frames in order. Data frames of a session that is gone are
        dropped; nothing is written once the stream is closed (py-libp2p 0.8.1 can drop the whole
        connection when a stream the peer reset is written to). A failed send to a successor fails
        every session sending on that stream, and the stream is no longer used (a new session that
        names the successor dials it afresh)."""
        try:
            async with box.recv:
                async for sess, msg, chunk in box.recv:
                    try:
                        gone = msg.get("type") != "error" and self.sessions.get(sess.session_id) is not sess
                        if box.dead or stream.closed or gone:
                            continue
                        await stream.send(msg, timeout_s=self.config.hop_timeout_s)
                    except SwarmError as exc:
                        if stream is not sess.reply:
                            box.dead = True  # a successor that does not take frames takes none of them
                            if self.successors.get(sess.next_addr) is stream:
                                del self.successors[sess.next_addr]
                            self._fail_later(sess, f"lost its successor {sess.next_addr}: {exc}", "unavailable")
                            for other in [s for s in self.sessions.values() if s.next_stream is stream]:
                                self._fail_later(other, f"lost its successor {other.next_addr}: {exc}", "unavailable")
                    else:
                        if chunk is not None:
                            sess.frames_out += 1
                            sess.sent = max(sess.sent, chunk)
                    finally:
                        self._in_flight -= 1
        finally:
            box.done.set()

    async def idle(self) -> None:
        """Return once nothing is queued, being computed or waiting to be sent."""
        while self._in_flight or any(s.queue for s in self._runq.values()):
            await trio.sleep(0.001)

    def _close_outbox(self, stream) -> _Outbox | None:
        """Stop ``stream``'s outbox: frames still queued are dropped, not sent."""
        box = self._outboxes.pop(stream, None)
        if box is not None:
            box.dead = True
            box.send.close()
        return box

    def _fail_later(self, sess: Session, reason: str, code: str = "internal") -> None:
        """Fail a session without waiting on its coordinator: the error goes through the outbox."""
        self._forget(sess)
        log.warning("session.failed session=%s code=%s reason=%s", sess.session_id, code, reason)
        self._post(sess.reply, sess, wire.error_frame(f"stage {self.block.layer_range}: {reason}"[:300], code,
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
                await self._try_send(sess.reply, wire.error_frame(
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
            await self._try_send(sess.reply, wire.error_frame(
                f"stage {self.block.layer_range} is draining (shutting down): the session did not finish within "
                f"{timeout_s:g} s", "unavailable", sess.session_id))
        return {"layers": self.block.layer_range.as_list(), "sessions_finished": before - len(failed),
                "sessions_failed": len(failed), "waited_s": round(trio.current_time() - t0, 3)}

    async def _refuse(self, stream, sess: Session, kind: str) -> None:
        """Refuse a frame from a peer the session was not assigned to; the session is untouched."""
        peer = stream.remote_peer_id
        log.warning("frame.refused type=%s session=%s peer=%s expected=%s", kind, sess.session_id, peer,
                    sess.source if kind in ("forward", "receipt") else sess.coordinator)
        await self._try_send(stream, wire.error_frame(
            f"stage {self.block.layer_range} refuses {kind!r} for session {sess.session_id!r} from {peer}: "
            "the session was not assigned to that peer", "forbidden", sess.session_id))

    async def _fail_session(self, sess: Session, exc: SwarmError) -> None:
        """Fail one session cleanly: free its KV cache, tell its coordinator why. Others go on."""
        code = "overflow" if isinstance(exc, ContextOverflow) else "bad_request"
        self._forget(sess)
        log.warning("session.failed session=%s code=%s reason=%s", sess.session_id, code, exc)
        await self._try_send(sess.reply, wire.error_frame(f"stage {self.block.layer_range}: {exc}", code,
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


async def serve(server: StageServer, key, listen: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``server`` on a new libp2p host until cancelled; ``task_status.started`` gets the READY payload."""
    from swarm.transport import open_host

    async with open_host(key, [listen]) as host, trio.open_nursery() as nursery:
        server.host, server.nursery = host, nursery
        server.key = server.key or key
        b = server.block
        # largest legitimate frame: a whole-context prefill of float64 hidden states, with headroom
        max_frame = min(256 << 20, max(16 << 20, 2 * b.max_ctx * b.hidden_size * 8))
        host.set_handler(PROTOCOL_ID, server.handle_stream, max_frame_bytes=max_frame)
        nursery.start_soon(server.expire_idle)
        nursery.start_soon(server.scheduler)
        task_status.started({"peer_id": host.peer_id, "addrs": host.addrs(), "layers": b.layer_range.as_list(),
                             "model": server.model_name, "model_digest": server.model_digest,
                             "max_ctx": b.max_ctx})
        await trio.sleep_forever()


def _logits_rows(msg: dict, pos: int, n: int) -> int:
    """How many of the last rows of ``[pos, pos + n)`` (a chunk or a slice of it) the tail must run
    the LM head on: those at or after the frame's ``logits_from`` (every row when absent)."""
    start = max(pos, msg.get("logits_from", pos))
    return max(0, pos + n - start)


def _prove_kernels(block) -> dict:
    """Run the start-up invariance check (:func:`swarm.kernels.check.check_block`) for the mode every
    session may use (one GEMV per row) and log what was proven.

    Returns:
        ``{"rows_ok", "reason", "check_s"}`` for ``info_ok`` (``kernels``): rows_ok False means this
        stage cannot promise that a verify chunk or a replay gives decode's bits.
    """
    from swarm.config import cache_root
    from swarm.kernels.check import check_block_once

    rows = check_block_once(block, 1, cache_root() / "proofs")
    if rows.ok:
        log.info("kernels.proven mode=rows layers=%s seconds=%.2f", block.layer_range, rows.seconds)
    else:
        log.error("kernels.not_invariant mode=rows %s: speculative, healed and batched output of this stage may "
                  "differ from greedy; coordinators are told (info kernels.rows_ok=false)", rows.reason)
    return {"rows_ok": rows.ok, "reason": rows.reason, "check_s": round(rows.seconds, 3)}


def _prove_tile(block, tile: int):
    """The proof of ``tile``-row GEMMs for packed sessions (worker thread), logged either way."""
    from swarm.config import cache_root
    from swarm.kernels.check import check_block_once

    report = check_block_once(block, tile, cache_root() / "proofs")
    if report.ok:
        log.info("kernels.proven mode=tile tile=%d layers=%s seconds=%.2f", tile, block.layer_range, report.seconds)
    else:
        log.warning("batch.not_invariant %s: packed sessions run one GEMV per row instead, so results stay "
                    "identical to solo runs", report.reason)
    return report


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _session_of(msg) -> str | None:
    return msg.get("session") if isinstance(msg, dict) and isinstance(msg.get("session"), str) else None


async def _drain_on_sigterm(server: StageServer) -> None:
    """SIGTERM (a supervisor stopping the daemon) asks for a drain, like a drain frame. Later
    SIGTERMs during the drain are logged and ignored (the drain has its own deadline)."""
    import signal

    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            if server.drain_requested.is_set():
                log.warning("drain.sigterm_again: already draining (--drain-timeout-s bounds it)")
            else:
                log.warning("drain.sigterm")
                server.drain_requested.set()


def emit(line_kind: str, payload: dict) -> None:
    """Print one lifecycle line (``SWARM_STAGE_<KIND> {json}``) to stdout and flush."""
    sys.stdout.write(f"SWARM_STAGE_{line_kind} {json.dumps(payload, sort_keys=True)}\n")
    sys.stdout.flush()


def run_check(config: StageConfig) -> int:
    """``swarm stage --check``: preflight without networking. Prints ``SWARM_STAGE_OK {...}`` and
    returns 0, or ``SWARM_STAGE_FATAL {"reason": ...}`` and returns 2."""
    from swarm.preflight import preflight

    try:
        payload = preflight(config)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 2
    except Exception as exc:  # a model file no check above anticipated: still one line
        log.debug("preflight.crashed", exc_info=True)
        emit("FATAL", {"reason": f"unexpected error while checking: {type(exc).__name__}: {exc}"[:500]})
        return 2
    emit("OK", payload)
    return 0


def run_stage(config: StageConfig) -> int:
    """Load the block, listen, print READY, serve until interrupted or drained. Returns the exit code.

    Every start-up failure prints ``SWARM_STAGE_FATAL {"reason": ...}`` and returns 1. SIGTERM or a
    drain frame from an ``--admin`` peer drains (no new sessions; open ones may finish for
    ``--drain-timeout-s``, then fail with "draining"), prints ``SWARM_STAGE_DRAINED {...}`` and
    returns 0. Ctrl-C (SIGINT) stops at once and returns 0.
    """
    from swarm.model.block import load_block
    from swarm.model.resolve import model_manifest_digest, resolve_model
    from swarm.transport import load_or_create_key

    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        key = load_or_create_key(config.key_path)
        resolved = resolve_model(config.model)
        block = load_block(resolved.path, config.layers, dtype=config.dtype, device=config.device,
                           progress=sys.stderr.isatty())
        digest = model_manifest_digest(resolved.path)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 1
    except Exception as exc:  # e.g. torch refusing a config no check anticipated: still one line
        log.debug("start.crashed", exc_info=True)
        emit("FATAL", {"reason": f"cannot load layers {config.layers}: {type(exc).__name__}: {exc}"[:500]})
        return 1
    try:
        server = StageServer(config, block, resolved.name, digest)
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ready = await nursery.start(serve, server, key, config.listen)
            emit("READY", ready)
            nursery.start_soon(_drain_on_sigterm, server)
            await server.drain_requested.wait()
            emit("DRAINED", await server.drain(config.drain_timeout_s))
            # every session is finished or failed with a reason: nothing is left to save, and a
            # graceful libp2p shutdown takes seconds, so leave now (a supervisor sees exit 0 at once)
            sys.stderr.flush()
            os._exit(0)

    try:
        try:
            trio.run(main)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    except KeyboardInterrupt:
        return 0
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)})
        return 1
    return 0

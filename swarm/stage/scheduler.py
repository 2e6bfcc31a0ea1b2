"""The stage's scheduler: which queued rows run in each step, and the step itself.

Owns: :class:`Scheduler`, each step as plan -> run -> apply: the pure :func:`plan_step` -> :class:`StepPlan`,
the compute in a worker thread or inline -> :class:`StepResult` (a slice that paused: :class:`Paused`), and
the outputs posted. The policy and its sources: docs/architecture.md, "Processes and roles".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import trio

from swarm import wire
from swarm.config import SchedulingSection
from swarm.frames import Forward, Receipt, Refill
from swarm.errors import ProtocolError
from swarm.stage.kernel_proofs import prove_kernels, prove_tile
from swarm.stage.session import Job, Session

log = logging.getLogger(__name__)

BATCH_CHUNK_MAX = 16  # chunks of at most this many positions are decode/verify rows: batched across sessions
MAX_QUEUED = 64  # chunks one session may have waiting at a stage (a coordinator keeps a few in flight)
ACTIVE_S = 2.0  # a session with a frame this recent is generating: long prompts beside it yield
DUE_GAPS = 2.0  # a decoder's next row is due within this many of its last gaps between rows ...
DUE_SLACK_S = 0.02  # ... plus this (jitter of a ring round trip), seconds
DUE_MIN_S = 0.25  # ... but at least this long, seconds (a row may wait at another stage)
FIRST_GAP_S = 0.25  # the gap assumed for a decoder that has sent only one short chunk, seconds
TIMING_FIELDS = ("chunks", "parse_s", "picked", "queue_s", "steps", "to_thread_s", "compute_s", "encode_s",
                 "from_thread_s", "frames_out", "outbox_s", "send_s", "inline_steps")
"""The stage's always-on timing counters (``info_ok`` ``timing``, docs/protocol.md): cumulative since
start, seconds of ``time.perf_counter``; a reader takes the difference of two ``info`` replies.
Per forward (or refill) frame queued (``chunks``): ``parse_s``, validation and decoding (the tensor copy) up to the
queue. Per chunk picked by a step (``picked``): ``queue_s``, queued -> picked. Per compute step
(``steps``): ``to_thread_s``, trio -> the worker thread starts the step; ``compute_s``, the forward (the
tail: with its LM head and choice of token); ``encode_s``, hidden states -> wire bytes;
``from_thread_s``, the worker thread is done -> the trio task runs again (both near 0 for the
``inline_steps``, short steps computed in the trio thread, ``--inline-step-ms``). Per data frame sent
(``frames_out``): ``outbox_s``, posted -> its send starts; ``send_s``, ``FramedStream.send`` (msgpack
packing and the libp2p write)."""


@dataclass(frozen=True)
class StepRows:
    """The chunks one step computes, as indices into the candidates given to :func:`pick_rows`.

    Attributes:
        short: the short chunks (at most ``BATCH_CHUNK_MAX`` positions each) packed into one
            forward, in the candidates' (run queue) order.
        long: the long chunk of which one slice is computed, or None.
    """

    short: tuple[int, ...]
    long: int | None


def pick_rows(chunks: Sequence[tuple[int, int]], max_batch_rows: int) -> StepRows:
    """Pick one step's chunks from the next chunk of every ready session, in run-queue order.

    Every short chunk fits while the rows picked so far stay within ``max_batch_rows`` (the first
    one always fits, so a step never starves); of the long chunks, the one with the fewest positions
    left goes (shortest remaining first; on a tie the earliest, which is round robin since a served
    session goes to the back of the run queue).

    Args:
        chunks: ``(positions, done)`` per candidate: the chunk's positions and how many of them
            earlier slices already computed (0 for a short chunk).
        max_batch_rows: ``--max-batch-rows``, positions of short chunks one step may pack.
    Returns:
        The indices of the picked chunks.
    """
    short, rows, long = [], 0, None
    for i, (t, done) in enumerate(chunks):
        if t <= BATCH_CHUNK_MAX:
            if short and rows + t > max_batch_rows:
                continue
            short.append(i)
            rows += t
        elif long is None or t - done < chunks[long][0] - chunks[long][1]:
            long = i
    return StepRows(tuple(short), long)


def long_chunk_shares(short_picked: bool, others: Iterable[tuple[float, int]], now: float) -> bool:
    """Whether this step's slice of a long chunk is the small ``--prefill-slice-shared`` one.

    A long prompt yields to sessions that decode: while one is generating the long chunk advances a
    few rows per step (Sarathi-Serve's budget). "Generating" means a frame within ``ACTIVE_S`` whose
    chunk was short, not work queued right now: in a ring a session's next row is usually at another
    stage when this step starts. Another prompt does not throttle the slice (the one with the least
    left goes first, at full slices, and is soon done).

    Args:
        short_picked: the step also packs short chunks.
        others: ``(last_active, last_rows)`` of every other live session: trio clock seconds of its
            last frame, and the positions of its last queued chunk.
        now: the trio clock, seconds.
    Returns:
        True when the slice must be the shared (small) one.
    """
    return short_picked or any(now - active < ACTIVE_S and rows <= BATCH_CHUNK_MAX for active, rows in others)


def decoder_due(others: Iterable[tuple[float, float]], now: float) -> float | None:
    """Until when a long prompt's slice waits for another session's decode row to ride along.

    Sarathi-Serve's stall-free batching (Agrawal et al., OSDI 2024) computes a prompt's chunks only
    inside the steps that carry the decode rows, so a decode row never queues behind a prompt's
    step. In a ring a decoder's row is at this stage only one step in every ring round trip; a
    slice computed alone in between is a step the row may arrive during (and, where stages share a
    machine, compute the other stages' rows compete with). So while another session's next row is
    due (its last short chunk arrived less than ``DUE_GAPS`` of its own gaps between short chunks
    ago, plus ``DUE_SLACK_S``), the long chunk waits for that row and goes with it; a decoder that
    went quiet (finished, or slower than its gaps said) stops holding it back at once. A row held up
    elsewhere in the ring (behind another stage's step) is still waited for up to ``DUE_MIN_S``.

    Args:
        others: ``(last_short, short_gap)`` of every other live session: trio clock seconds its last
            short chunk arrived (0: none yet) and seconds between its last two short chunks (0:
            only one so far, taken as ``FIRST_GAP_S``).
        now: the trio clock, seconds.
    Returns:
        The trio clock time until which the long chunk waits, or None when no decoder is due.
    """
    due = None
    for last, gap in others:
        if not last:
            continue
        until = last + max(DUE_GAPS * min(gap or FIRST_GAP_S, ACTIVE_S), DUE_MIN_S) + DUE_SLACK_S
        if until > now and (due is None or until > due):
            due = until
    return due


RIDE_FRACTION = 0.5  # a long prompt's rows riding in a decoder's step may add this much to the step's time
STARVE_S = 0.5  # a long prompt that computed nothing for this long rides along with at least one row


def ride_rows(*, row_s: float | None, short_step_s: float | None, shared_rows: int, starving: bool) -> int:
    """Positions of a long chunk that ride along in a step of decode/verify rows while another
    session's decode row is due (:func:`decoder_due`).

    Sarathi-Serve's stall-free batching (Agrawal et al., OSDI 2024): while sessions decode, a
    prompt is computed only inside the steps that carry their rows, in a piece sized so the step
    stays within a budget; between those steps it waits. In a ring a decoder's row is at a stage
    only once a round trip, and the stages in between may share the machine: a slice computed
    there alone would take the CPU the row needs at the next stage (measured with 3 stages on 2
    cores: a short request beside a 4,032-token prompt 4.1x its time alone with slices filling the
    gaps, 1.1-1.4x with riding only, ``bench/long_prompt.py``). Costs are measured:
    ``short_step_s``, a step of decode rows alone, and ``row_s``, the last seconds per row of this
    stage's prompt slices beyond that (a row's attention grows with the context).

    Args:
        row_s, short_step_s: the measured costs, seconds (None: not measured yet).
        shared_rows: ``--prefill-slice-shared``, the most rows that ride along.
        starving: the prompt computed nothing for ``STARVE_S``: at least one row rides along.
    Returns:
        Rows to compute with the decode rows; 0: the decode rows go without it.
    """
    if row_s is None or short_step_s is None or row_s <= 0:
        return shared_rows
    ride = int(RIDE_FRACTION * short_step_s / row_s)
    return min(shared_rows, max(ride, 1 if starving else 0))


@dataclass(frozen=True)
class Slice:
    """A long chunk's next ``rows`` positions (from where its earlier slices ended) in one step."""

    session: Session
    job: Job
    rows: int


@dataclass(frozen=True)
class StepPlan:
    """What one scheduling step computes (:func:`plan_step`).

    Attributes:
        short: the short chunks (decode/verify rows), each computed whole, packed into one forward.
        long: a slice of a long chunk, or None.
        wait_until: nothing runs now: a decoder's row is due by this trio time and the long chunk
            waits to ride along with it (Sarathi-Serve's stall-free batching).
    An empty plan (none of the three): nothing is ready.
    """

    short: tuple[tuple[Session, Job], ...] = ()
    long: Slice | None = None
    wait_until: float | None = None

    @property
    def empty(self) -> bool:
        return not self.short and self.long is None and self.wait_until is None

    @property
    def alone(self) -> bool:
        """A slice in a step of its own: it pauses between layers for a chunk that overtakes it."""
        return self.long is not None and not self.short


@dataclass(frozen=True)
class Costs:
    """What the scheduler measured that planning reads: ``short_step_s``, a step of decode rows alone
    (moving average); ``row_s``, the last seconds per row of a long chunk's slice beyond that (None:
    not measured yet); ``long_at``, the trio time a slice was last computed."""

    short_step_s: float | None = None
    row_s: float | None = None
    long_at: float = 0.0


def plan_step(ready: Sequence[tuple[Session, Job]], sessions: Iterable[Session], settings: SchedulingSection,
              costs: Costs, now: float) -> StepPlan:
    """One step's chunks: the short ones :func:`pick_rows` packs and the long chunk it picks, sized
    by ``--prefill-piggyback`` (:func:`decoder_due`, :func:`ride_rows`) or else by
    :func:`long_chunk_shares`. Reads the sessions, changes nothing.

    Args:
        ready: the next chunk of every ready session, in run-queue order.
        sessions: every live session (whose decode rows may be due).
        settings: the stage's batching flags. costs: what was measured. now: trio time, seconds.
    """
    picked = pick_rows([(job.x.shape[1], job.done) for _, job in ready], settings.max_batch_rows)
    short = tuple(ready[i] for i in picked.short)
    if picked.long is None:
        return StepPlan(short)
    sess, job = ready[picked.long]
    if settings.prefill_piggyback:
        due = decoder_due([(s.scheduling.last_short, s.scheduling.short_gap) for s in sessions if s is not sess], now)
        if due is None:
            return StepPlan(short, Slice(sess, job, settings.prefill_slice))  # nobody's decode row is due
        if not short:  # wait for the decoder's row to ride along with it (or until it is overdue)
            return StepPlan(wait_until=due)
        rows = ride_rows(row_s=costs.row_s, short_step_s=costs.short_step_s, shared_rows=settings.prefill_slice_shared,
                         starving=now - costs.long_at > STARVE_S)
        # 0: the decode rows go alone, the prompt's row would cost them too much
        return StepPlan(short, Slice(sess, job, rows) if rows else None)
    others = [(s.scheduling.last_active, s.scheduling.last_rows) for s in sessions if s is not sess]
    shared = long_chunk_shares(bool(short), others, now)
    return StepPlan(short, Slice(sess, job, settings.prefill_slice_shared if shared else settings.prefill_slice))


@dataclass(frozen=True)
class Paused:
    """A slice computed alone that paused between layers for a chunk that overtakes it: its session,
    chunk, first position and rows, and the ``LayerBlock.forward_steps`` generator that goes on."""

    session: Session
    job: Job
    pos: int
    rows: int
    steps: object


@dataclass(frozen=True)
class ChunkOutput:
    """One chunk's part of a step: ``rows`` positions computed; ``payload`` the tail's token ids or the
    encoded hidden states once the chunk is complete, None while slices of it are still to come."""

    session: Session
    job: Job
    rows: int
    payload: object


@dataclass(frozen=True)
class StepResult:
    """A computed step (:meth:`Scheduler._compute_step`).

    Attributes:
        outputs: each chunk's part, in the step's order (none when it paused).
        t_start, t_end: ``time.perf_counter`` when the compute began and ended; encode_s: the part
            of it spent encoding hidden states.
        packed: sessions in the step's largest forward. long_rows: positions of a long chunk computed.
        paused: the slice that paused instead of finishing, or None.
    """

    outputs: tuple[ChunkOutput, ...]
    t_start: float
    encode_s: float
    t_end: float
    packed: int = 0
    long_rows: int = 0
    paused: Paused | None = None

SHADOW_QUEUE_FACTOR = 16  # a shadow may have this many times MAX_QUEUED frames waiting


def chunk_input(msg: Forward | Refill, sess: Session, block) -> torch.Tensor:
    """Check a ``forward`` (or ``refill``) frame of a live session and decode its rows.

    A ``refill`` is computed like a forward but only fills the KV cache of the stages replacing a
    lost range (:mod:`swarm.stage.repair`): it may only reach stages whose layers end by its
    ``until``. The chunk may start anywhere up to where the chunks queued before it will have left
    the cache.

    Args:
        msg: a validated ``forward`` or ``refill`` frame of ``sess``'s current epoch.
        sess: the session it belongs to.
        block: the stage's ``LayerBlock`` (vocabulary and hidden sizes).
    Returns:
        (1, T) int64 token ids at the head, else (1, T, D) hidden states.
    Raises:
        ProtocolError: a refill past its ``until``, too many chunks queued, a malformed tensor, a
            ``logits_from`` past the chunk's last row.
        ContextOverflow: the chunk ends past the session's ``max_len``.
    """
    if isinstance(msg, Refill) and sess.span.end > msg.until:
        raise ProtocolError(f"a refill for the layers below {msg.until} reached stage {sess.span}, whose layers "
                            "go past them")
    # a shadow is sent every frame at the ring's pace, not the coordinator's few in flight: it
    # may fall behind further before it gives up (a heal then refills it as a plain spare)
    limit = MAX_QUEUED * (SHADOW_QUEUE_FACTOR if sess.heal.shadow else 1)
    if len(sess.scheduling.queue) >= limit:
        raise ProtocolError(f"more than {limit} chunks of the session are waiting at this stage")
    inputs = wire.forward_inputs(msg, is_head=sess.is_head, vocab_size=block.vocab_size,
                                 hidden_size=block.hidden_size,
                                 kv_len=sess.scheduling.queued_end if sess.scheduling.queue else sess.cache.kv_len,
                                 max_len=sess.cache.max_len)
    x = inputs["token_ids"] if sess.is_head else inputs["hidden"]
    if isinstance(msg, Forward) and msg.logits_from is not None and msg.logits_from > msg.pos + x.shape[1]:
        raise ProtocolError(f"forward frame 'logits_from' {msg.logits_from} lies past "
                            f"its last row {msg.pos + x.shape[1] - 1}")
    return x


class Scheduler:
    """The run queue and the steps: planned, run, applied (see the module docstring).

    Args:
        settings: the stage's ``SchedulingSection`` (batching flags, ``--inline-step-ms``).
        block: the loaded ``LayerBlock``; its kernels are proven here before anything is served.
        sessions: the live sessions by id (the server's dict, read only here: a job whose session
            is gone is dropped).
        timing: the stage's ``TIMING_FIELDS`` counters, added to here.
        fail: ``fail(sess, reason, code)`` fails one session without waiting (through its outbox).
        emit: ``emit(sess, msg, payload)`` posts a computed chunk's output.
        sign_receipt: ``sign_receipt(sess)`` signs and posts the session's receipt.
        metrics: the ``StageMetrics`` whose step histograms are observed, or None.
    """

    def __init__(self, settings: SchedulingSection, block, sessions: dict[str, Session], timing: dict, *,
                 fail: Callable[..., None], emit: Callable[[Session, dict, object], None],
                 sign_receipt: Callable[[Session], None], metrics=None) -> None:
        self.settings, self.block, self.sessions, self.timing = settings, block, sessions, timing
        self._fail, self._emit, self._sign_receipt, self.metrics = fail, emit, sign_receipt, metrics
        self._runq: dict[int, Session] = {}  # id -> session with queued jobs, in scheduling (round-robin) order
        self._work = trio.Event()  # set when a job is queued
        self.tile = settings.batch_tile or None  # rows per GEMM of packed (batch) sessions
        self.stats = {"steps": 0, "batched_steps": 0, "rows": 0, "max_sessions": 0, "prefill_slices": 0,
                      "prefill_waits": 0, "prefill_preempted": 0}
        self.kernels = prove_kernels(block)  # every session's mode, before anything is served
        self.kernels.update(batch_ok=None, batch_tile=self.tile or 0)  # proven at the first batch session
        self.limiter = trio.CapacityLimiter(1)  # one thread computes on the block (or its caches) at a time
        self._batch_proof = trio.Lock()
        self.in_flight = 0  # steps being computed (see busy())
        self.costs = Costs()  # what planning reads, replaced as steps are measured
        # a long chunk's slice computed alone yields between layers to rows that must not wait for it
        self._slicing: Session | None = None  # the session of the slice-only step in flight
        self._slice_left = 0  # positions its chunk has left, this slice included
        self._urgent = False  # set (trio thread) when a chunk arrived that overtakes that slice
        self.paused: Paused | None = None  # the slice that paused, until it goes on

    def enqueue(self, sess: Session, job: Job) -> None:
        """Queue a checked chunk (or receipt request) behind the session's others and wake the loop."""
        job.queued_at = time.perf_counter()
        if job.x is not None:
            rows = job.x.shape[1]
            if rows <= BATCH_CHUNK_MAX and not sess.heal.shadow:  # a decode/verify row: note when the next one is due
                now = trio.current_time()
                pace = sess.scheduling
                pace.short_gap = now - pace.last_short if pace.last_short and pace.last_rows <= BATCH_CHUNK_MAX else 0.0
                sess.scheduling.last_short = now
            sess.scheduling.last_rows = rows
        sess.scheduling.queue.append(job)
        sess.scheduling.busy = True  # until its queue is empty: a probe during a long step sees it
        if self._slicing is not None and sess is not self._slicing and not sess.heal.shadow and job.x is not None \
                and overtakes(job.x.shape[1], self._slice_left):
            self._urgent = True  # the slice in flight pauses at its next layer
        self._runq.setdefault(id(sess), sess)
        self._work.set()

    def busy(self) -> bool:
        """Whether a step is being computed or paused, or a session has a job queued."""
        return bool(self.in_flight) or self.paused is not None or any(s.scheduling.queue for s in self._runq.values())

    async def run(self) -> None:
        """Run scheduling steps while work is queued (forever; started by :func:`swarm.stage.daemon.serve`)."""
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
                        self._fail(sess, f"internal error: {type(exc).__name__}: {exc}")

    async def _step(self) -> bool:
        """One scheduling step: plan it (:func:`plan_step`), run it (:meth:`_compute`), apply the
        result (:meth:`_apply`). Returns False when nothing was ready."""
        await self._wait_for_batch()
        plan = plan_step(self._ready_jobs(), self.sessions.values(), self.settings, self.costs, trio.current_time())
        if plan.wait_until is not None:
            self.stats["prefill_waits"] += 1
            self._work = trio.Event()
            with trio.move_on_at(plan.wait_until):
                await self._work.wait()
            return True
        if plan.empty:
            if self.paused is not None:  # nothing overtakes the paused slice any more: it goes on
                return await self._resume()
            return False  # a chunk queued meanwhile has set self._work again
        t_call = time.perf_counter()
        first = [plan.long.job] if plan.long is not None and plan.long.job.done == 0 else []
        for job in [job for _, job in plan.short] + first:
            self.timing["picked"] += 1
            self.timing["queue_s"] += t_call - job.queued_at
        return await self._run_step(plan, t_call)

    async def _resume(self) -> bool:
        """Go on with the paused slice (it may pause again), unless its session or chunk is gone."""
        paused, self.paused = self.paused, None
        sess, job = paused.session, paused.job
        queue = sess.scheduling.queue
        if self.sessions.get(sess.session_id) is not sess or not queue or queue[0] is not job \
                or job.msg.epoch < sess.epoch and not stale_needed(queue, sess.epoch, sess.cache.kv_len):
            paused.steps.close()  # its cache rolls back to before the slice
            return True
        return await self._run_step(StepPlan(), time.perf_counter(), resuming=paused)

    async def _run_step(self, plan: StepPlan, t_call: float, resuming: Paused | None = None) -> bool:
        """Compute a step (:meth:`_compute`), then apply it. A slice computed alone (``plan.alone``, or
        ``resuming``, a paused slice going on) pauses for a chunk that overtakes it (:meth:`enqueue`).
        Returns True (a step was taken)."""
        slicing = (plan.long.session, plan.long.job) if plan.alone else \
            (resuming.session, resuming.job) if resuming is not None else None
        self._slicing = slicing[0] if slicing else None
        self._slice_left = slicing[1].x.shape[1] - slicing[1].done if slicing else 0
        self._urgent = False
        try:
            result = await self._compute(plan, resuming)
        finally:
            self._slicing = None
        if result is not None:  # None: failed, its sessions were failed
            self._apply(result, plan.long is not None or resuming is not None, resuming is not None, t_call)
        return True

    def _apply(self, result: StepResult, sliced: bool, resumed: bool, t_call: float) -> None:
        """Advance the queues by a computed step: a slice that paused is kept (and counted as a
        preemption); otherwise the step is counted and every chunk's part delivered."""
        if result.paused is not None:
            self.stats["prefill_preempted"] += 1
            self.paused = result.paused
            return
        self._count(result, sliced, resumed, t_call)
        self._deliver(result.outputs)

    async def _wait_for_batch(self) -> None:
        """``--batch-wait-ms``: while a batching session's decode rows are queued and another batching
        session that is decoding has its next row due (:func:`decoder_due`) but not here yet, wait once
        so their rows share the step. A session that is prefilling, or idle, is never waited for (a
        long prompt beside a chat would add the wait to every one of the chat's steps)."""
        wait = self.settings.batch_wait_ms
        if not wait:
            return

        def short(sess) -> bool:
            job = sess.scheduling.queue[0] if sess.scheduling.queue else None
            return job is not None and job.x is not None and job.x.shape[1] <= BATCH_CHUNK_MAX

        if not any(s.batch and short(s) for s in self._runq.values()):
            return
        now = trio.current_time()
        if any(s.batch and not s.scheduling.queue and not s.heal.shadow and s.scheduling.last_rows <= BATCH_CHUNK_MAX
               and decoder_due([(s.scheduling.last_short, s.scheduling.short_gap)], now) is not None
               for s in self.sessions.values()):
            await trio.sleep(wait / 1000)

    def _ready_jobs(self) -> list[tuple[Session, Job]]:
        """The next chunk of every session in the run queue, in its order; a chunk that is not
        contiguous with its session's cache (queued before the session was dropped or failed)
        fails the session instead."""
        ready = []
        paused = self.paused.session if self.paused is not None else None
        for sess in list(self._runq.values()):
            if sess is paused:
                continue  # its chunk is half through a slice: it goes on once nothing overtakes it
            job = self._next_job(sess)
            if job is None:
                continue
            pos = job.msg.pos + job.done
            if pos > sess.cache.kv_len:
                self._fail(sess, f"chunk at pos {pos} is not contiguous with the session's kv_len "
                                 f"{sess.cache.kv_len}", "bad_request")
                continue
            ready.append((sess, job))
        return ready

    async def _compute(self, plan: StepPlan, resuming: Paused | None = None) -> StepResult | None:
        """The step's compute, in the worker thread or inline (see :meth:`_inline_ok`); None when it
        failed (its sessions are failed, the stage keeps serving: ``resuming``, a paused slice going
        on, is one of them then)."""
        self.in_flight += 1
        try:
            if plan.short and plan.long is None and self._inline_ok():
                # short rows whose compute is known to be brief: the worker-thread round trip (two
                # thread switches and a wakeup of the event loop) would cost more than it shields
                async with self.limiter:
                    result = self._compute_step(plan, resuming)
                self.timing["inline_steps"] += 1
            else:
                result = await trio.to_thread.run_sync(self._compute_step, plan, resuming, limiter=self.limiter)
        except Exception as exc:  # a torch failure fails the sessions of this step only; the stage keeps serving
            failed = list(plan.short) + ([(plan.long.session, plan.long.job)] if plan.long else []) + \
                ([(resuming.session, resuming.job)] if resuming else [])
            log.exception("forward.failed sessions=%s", [s.session_id for s, _ in failed])
            for sess, _ in failed:
                self._fail(sess, f"forward failed: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.in_flight -= 1
        return result

    def _count(self, result: StepResult, sliced: bool, resumed: bool, t_call: float) -> None:
        """Add a computed step to the costs planning reads, the timing counters, the batching stats and
        the metrics. ``resumed``: it finished a paused slice (its time is not a whole slice's)."""
        timing = self.timing
        t_start, encode_s, t_end = result.t_start, result.encode_s, result.t_end
        costs = self.costs
        if not sliced:  # what the next short step may expect to cost
            step_s = t_end - t_start
            self.costs = replace(costs, short_step_s=step_s if costs.short_step_s is None else
                                 0.8 * costs.short_step_s + 0.2 * step_s)
        elif result.long_rows and not resumed:  # what a row of the prompt costs now (its attention grows)
            # a step reads the weights once whatever its rows: that part is what a step of decode rows costs
            row_s = max(t_end - t_start - encode_s - (costs.short_step_s or 0.0), 0.0) / result.long_rows
            self.costs = replace(costs, row_s=row_s, long_at=trio.current_time())
        timing["steps"] += 1
        timing["to_thread_s"] += t_start - t_call
        timing["from_thread_s"] += time.perf_counter() - t_end
        timing["compute_s"] += t_end - t_start - encode_s
        timing["encode_s"] += encode_s
        self.stats["steps"] += 1
        packed = result.packed
        computed = sum(o.rows for o in result.outputs)  # the short chunks' rows and the long slice's
        self.stats["batched_steps"] += packed > 1
        self.stats["rows"] += computed
        self.stats["max_sessions"] = max(self.stats["max_sessions"], packed)
        self.stats["prefill_slices"] += sliced
        if self.metrics is not None:
            self.metrics.step_seconds.observe(t_end - t_start)
            self.metrics.step_rows.observe(computed)

    def _deliver(self, outputs: Sequence[ChunkOutput]) -> None:
        """Advance each computed chunk; post the output of each one now complete."""
        for sess, job, n, payload in ((o.session, o.job, o.rows, o.payload) for o in outputs):
            job.done += n
            sess.positions += n
            if self._runq.pop(id(sess), None) is not None:  # round robin: to the back of the line
                self._runq[id(sess)] = sess
            if payload is None:
                continue  # more slices of this chunk to come
            if sess.scheduling.queue and sess.scheduling.queue[0] is job:
                sess.scheduling.queue.popleft()
            if prompt_ends(job.msg, job.x.shape[1]) and not sess.heal.shadow:
                # its first decode row comes after the ring's other stages and the coordinator: due from now
                sess.scheduling.last_short, sess.scheduling.short_gap = trio.current_time(), 0.0
            if not sess.scheduling.queue:
                self._runq.pop(id(sess), None)
                sess.scheduling.busy = False
            try:
                self._emit(sess, job.msg, payload)
            except Exception as exc:  # a bug reached by this session's output: fail it alone
                log.exception("emit.failed session=%s", sess.session_id)
                self._runq.pop(id(sess), None)
                self._fail(sess, f"internal error: {type(exc).__name__}: {exc}")

    def _inline_ok(self) -> bool:
        """Whether a step of short chunks may run in the trio thread: its recent compute (a moving
        average over short steps) is below ``--inline-step-ms``. The first short steps always go to
        the worker thread (nothing is known yet), and so does every step while one runs there."""
        limit = self.settings.inline_step_ms / 1000
        return bool(limit) and self.costs.short_step_s is not None and self.costs.short_step_s < limit \
            and self.limiter.borrowed_tokens == 0

    def _next_job(self, sess: Session) -> Job | None:
        """The session's next chunk to compute, after serving receipt requests and dropping stale
        chunks at the front of its queue; None (and out of the run queue) when it has none."""
        while sess.scheduling.queue and self.sessions.get(sess.session_id) is sess:
            job = sess.scheduling.queue[0]
            if job.x is None:
                sess.scheduling.queue.popleft()
                try:
                    self._sign_receipt(sess)
                except Exception as exc:  # e.g. a ledger value the signer cannot encode: this session only
                    log.exception("receipt.failed session=%s", sess.session_id)
                    self._fail(sess, f"cannot sign the receipt: {exc}")
            elif job.msg.epoch < sess.epoch and not stale_needed(sess.scheduling.queue, sess.epoch, sess.cache.kv_len):
                sess.scheduling.queue.popleft()  # cancelled speculation: never computed (rolled back by the next chunk)
            else:
                return job
        sess.scheduling.queue.clear()
        sess.scheduling.busy = False
        self._runq.pop(id(sess), None)
        return None

    def _compute_step(self, plan: StepPlan, resuming: Paused | None = None) -> StepResult:
        """One step's compute (in the worker thread, or inline, see :meth:`_inline_ok`): one packed
        forward of the short chunks, one slice of a long one; the output of each chunk that is now
        complete is encoded (tail: token ids; others: hidden). A slice alone (or a paused one going
        on, ``resuming``) pauses between layers when a chunk that overtakes it arrives
        (:meth:`_slice_alone`): the result's ``paused`` says so then."""
        t_start = time.perf_counter()
        block = self.block
        if plan.alone or resuming is not None:
            return self._slice_alone(plan.long, resuming, t_start)
        out = []
        # the fma and triton kernels give a row the same bits in any forward (proven at start-up with
        # packing), so there every session's rows over the same layers share one pass over the weights;
        # in the rows mode only sessions that asked to batch do (--batch-tile GEMMs), the others run alone
        packs = block.kernel_mode in ("fma", "triton")
        groups: dict = {}  # packed rows share a forward only with rows over the same layers
        entries = [(s, j, j.msg.pos, j.x) for s, j in plan.short]
        long_rows = 0
        if plan.long is not None:
            s, j = plan.long.session, plan.long.job
            long_rows = min(plan.long.rows, j.x.shape[1] - j.done)
            entries.append((s, j, j.msg.pos + j.done, j.x[:, j.done:j.done + long_rows]))
        for s, j, pos, x in entries:
            s.cache.frame_end = j.msg.pos + j.x.shape[1]  # a slice's rotary is its whole frame's (LongRoPE)
            if packs or s.batch:
                groups.setdefault(s.span, []).append((s, j, pos, x))
            else:  # alone, one GEMV per row
                y = block.forward_batch([(s.cache, pos, x)], tile=self.tile_of(s),
                                        logits_rows=[_logits_rows(j.msg, pos, x.shape[1])], span=s.span)
                out.append((s, j, pos, x.shape[1], y[0]))
        for span, packed in groups.items():
            ys = block.forward_batch([(s.cache, pos, x) for s, _, pos, x in packed], tile=self.tile_of(packed[0][0]),
                                     logits_rows=[_logits_rows(j.msg, pos, x.shape[1]) for _, j, pos, x in packed],
                                     span=span)
            out += [(s, j, pos, x.shape[1], y) for (s, j, pos, x), y in zip(packed, ys)]
        packed_most = max(map(len, groups.values()), default=0)  # sessions in this step's largest forward
        return self._outputs(out, t_start, packed=packed_most, long_rows=long_rows)

    def _slice_alone(self, piece: Slice | None, resuming: Paused | None, t_start: float) -> StepResult:
        """A long chunk's slice in a step of its own, or the paused one going on: its forward
        (:meth:`LayerBlock.forward_steps`) checks after every layer whether a chunk that overtakes it
        arrived (:func:`overtakes`, set by :meth:`enqueue`) and then pauses, so a decode row waits for
        one layer of a slice, not all of it (the bits are the same)."""
        if resuming is not None:
            sess, job, pos, n, steps = resuming.session, resuming.job, resuming.pos, resuming.rows, resuming.steps
        else:
            sess, job = piece.session, piece.job
            n = min(piece.rows, job.x.shape[1] - job.done)
            pos = job.msg.pos + job.done
            sess.cache.frame_end = job.msg.pos + job.x.shape[1]  # a slice's rotary is its whole frame's (LongRoPE)
            steps = self.block.forward_steps([(sess.cache, pos, job.x[:, job.done:job.done + n])],
                                             tile=self.tile_of(sess), logits_rows=[_logits_rows(job.msg, pos, n)],
                                             span=sess.span)
        try:
            while True:
                next(steps)
                if self._urgent and self.paused is None:  # one paused slice at a time
                    return StepResult((), t_start, 0.0, time.perf_counter(), long_rows=n,
                                      paused=Paused(sess, job, pos, n, steps))
        except StopIteration as done:
            return self._outputs([(sess, job, pos, n, done.value[0])], t_start, packed=1, long_rows=n)

    def _outputs(self, out: list, t_start: float, *, packed: int, long_rows: int) -> StepResult:
        """The step's result: each computed entry ``(session, job, pos, rows, output)`` as its
        :class:`ChunkOutput` (the tail's tokens or the encoded hidden states of a chunk now complete,
        None for a slice of one that is not)."""
        encode_s = 0.0
        block = self.block
        results = []
        for s, j, pos, n, y in out:
            tail = s.is_tail(block.num_layers)
            part = self._decide(s, pos + n - y.shape[1], y) if tail else y
            complete = j.done + n == j.x.shape[1]
            if complete and j.parts:
                part = (sum(j.parts, []) + part) if tail else torch.cat([*j.parts, part], dim=1)
            elif not complete:
                j.parts.append(part)
            payload = None
            if complete and tail:
                payload = part
            elif complete:
                t_encode = time.perf_counter()
                payload = wire.encode_tensor(part, dtype=s.wire_dtype)
                encode_s += time.perf_counter() - t_encode
            results.append(ChunkOutput(s, j, n, payload))
        return StepResult(tuple(results), t_start, encode_s, time.perf_counter(), packed=packed, long_rows=long_rows)

    async def prove_batch_tile(self) -> None:
        """Prove ``--batch-tile`` on this block before the first session that may be packed is opened
        (a few seconds on a real model, once; sessions that do not batch never wait for it). A tile
        that fails its proof is replaced by 1 for every packed session, with a log line saying why."""
        async with self._batch_proof:
            if self.kernels["batch_ok"] is not None:
                return
            tile = self.tile or 1
            report = await trio.to_thread.run_sync(prove_tile, self.block, tile, limiter=self.limiter)
            self.kernels.update(batch_ok=report.ok, check_s=round(self.kernels["check_s"] + report.seconds, 3))
            if not report.ok:
                self.kernels["reason"] = report.reason
                self.tile = 1  # packed sessions then take one GEMV per row: invariant by construction

    def tile_of(self, sess: Session) -> int:
        """Rows per GEMM for every forward of ``sess``, fixed for its life (its bits depend on it)."""
        return (self.tile or 1) if sess.batch else 1

    def _decide(self, sess: Session, pos: int, logits: torch.Tensor) -> list[int]:
        """Tail: the token after each of the rows at ``[pos, pos + T)``: argmax, or sampled keyed by
        (seed, that position)."""
        if sess.sampling is None:
            return greedy_ids(logits)
        from swarm.model.sampling import sample

        return [sample(logits[0, i], pos + i + 1, sess.sampling) for i in range(logits.shape[1])]


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """The argmax id of each row of (1, T, V) logits: the first of the largest values, a NaN
    counting as the largest, as ``torch.argmax``. On the CPU numpy's: the same index, faster on the
    tail's path of every token (SmolLM2's 49,152-wide row right after its step: 0.10 vs 0.14 ms;
    a warm verify chunk of 4 rows: 0.02 vs 0.25 ms)."""
    rows = logits[0]
    if rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.float64) and not rows.requires_grad:
        return rows.numpy().argmax(axis=-1).tolist()
    return rows.argmax(dim=-1).tolist()


def overtakes(rows: int, slice_left: int) -> bool:
    """Whether a chunk of ``rows`` positions that arrives while a long chunk's slice is computed
    alone (with ``slice_left`` positions left in that chunk, this slice included) pauses the slice:
    a decode/verify chunk always, a long one with fewer positions (the one :func:`pick_rows` would
    take first)."""
    return rows <= BATCH_CHUNK_MAX or rows < slice_left


def stale_needed(queue: Iterable[Job], epoch: int, kv_len: int) -> bool:
    """Whether the chunks of epochs before ``epoch`` at the front of a session's ``queue`` must still
    be computed: its first chunk of ``epoch`` starts past ``kv_len`` (the cache's end), so it builds
    on their positions. A ring stage's stale chunks are never needed (the coordinator rolls back only
    to positions every stage computed); a stage fed copies of what another stage computed is: a
    shadow lagging behind the stage it shadows, whose chunks speculation rolled back after that
    stage had computed them, or a promoted shadow whose heal's first frame follows mirrored frames
    still queued. False while no chunk of ``epoch`` is queued (a ``cancel`` ran ahead of it)."""
    for job in queue:
        if job.x is not None and job.msg.epoch >= epoch:
            return job.msg.pos > kv_len
    return False


def prompt_ends(msg: Forward | Refill | Receipt, rows: int) -> bool:
    """Whether a chunk of ``rows`` positions is the last of a prompt (or a heal's replay): a long
    ``forward`` whose ``logits_from`` lies inside it, so its session decodes next."""
    return (rows > BATCH_CHUNK_MAX and isinstance(msg, Forward)
            and (msg.pos if msg.logits_from is None else msg.logits_from) < msg.pos + rows)


def _logits_rows(msg: Forward | Refill, pos: int, n: int) -> int:
    """How many of the last rows of ``[pos, pos + n)`` (a chunk or a slice of it) the tail must run
    the LM head on: those at or after the frame's ``logits_from`` (every row when absent; none of a
    ``refill``, which only fills the KV cache)."""
    if isinstance(msg, Refill):
        return 0
    start = pos if msg.logits_from is None else max(pos, msg.logits_from)
    return max(0, pos + n - start)

"""The coordinator's connections to a ring: dial and check stages, sessions, chunks, probes, swaps.

Owns: ``RingClient``: two streams per stage (data: forward frames, session replies and the tail's
results; control: cancel and progress probes), one reader task per stream funnelling
``(stage, generation, frame)`` into one channel, the ring check at connect (each stage reports the
range, model and PeerId the ring file claims; the ranges tile ``[0, L)``), heartbeat probes while
waiting for a result (a frozen stage is detected in about two heartbeats, not at the hop timeout),
and swapping a warm spare into a ring position (``swap``; frames of the replaced connection are
ignored from then on). Glue over ``swarm.transport`` and ``swarm.wire``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import trio

from swarm import receipts, wire
from swarm.config import RingSpec, StageSpec
from swarm.errors import ConfigError, HopTimeout, ProtocolError, RemoteError, StageLost, StreamClosed, SwarmError
from swarm.heal import StageReport
from swarm.ranges import check_tiling
from swarm.wire import PROTOCOL_ID

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageInfo:
    """What a stage reported about itself, next to what the ring file claimed."""

    index: int
    addr: str
    peer_id: str
    layers: tuple[int, int]
    model: str
    model_digest: str
    max_ctx: int
    dtype: str = "float32"
    rows_proven: bool = True  # the stage's start-up check proved row-invariant kernels (info kernels.rows_ok)

    def entry(self) -> dict:
        """``{index, peer_id, addr, layers}``: this stage as results and job receipts list it."""
        return {"index": self.index, "peer_id": self.peer_id, "addr": self.addr, "layers": list(self.layers)}


@dataclass
class _Link:
    """The coordinator's two streams to one stage."""

    spec: StageSpec
    data: object
    control: object
    info: StageInfo
    generation: int


class RingClient:
    """Streams from the coordinator to every stage of a ring, and the frames they send back.

    Args:
        host: a running SwarmHost. ring: the ring file (stages in order, spares).
        hop_timeout_s: longest wait for one result while every stage still answers heartbeats.
        connect_timeout_s: deadline for dialing a stage.
        heartbeat_s: silence after which stages are probed; a probe unanswered this long marks
            the stage unreachable.
    """

    def __init__(self, host, ring: RingSpec, hop_timeout_s: float, connect_timeout_s: float,
                 heartbeat_s: float = 1.0, batch: bool = False):
        self.host = host
        self.batch = batch  # open sessions that stages may pack with other sessions (swarm serve)
        self.ring = ring
        self.hop_timeout_s = hop_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.heartbeat_s = heartbeat_s
        self.links: list[_Link] = []
        self.spares: list[StageSpec] = list(ring.spares)
        self._num_layers = 0
        self._model_digest = ""
        self._nursery = None
        self._generation = 0
        self._deferred: deque = deque()
        self._send_ch, self._recv_ch = trio.open_memory_channel(1024)
        self.returned: dict[str, int] = {}  # session -> highest chunk id with a result
        # session -> (digest of forward frames sent to the head, of result frames from the tail),
        # for sessions opened with a job (receipts)
        self.ledgers: dict[str, tuple[receipts.RollingDigest, receipts.RollingDigest]] = {}

    # ---- views -------------------------------------------------------------------------------

    @property
    def infos(self) -> list[StageInfo]:
        return [link.info for link in self.links]

    @property
    def streams(self) -> list:
        return [link.data for link in self.links]

    @property
    def control(self) -> list:
        return [link.control for link in self.links]

    @property
    def stage_specs(self) -> list[StageSpec]:
        return [link.spec for link in self.links]

    # ---- connecting --------------------------------------------------------------------------

    async def connect(self, num_layers: int, model_digest: str, nursery, use_spares: bool = False) -> list[StageInfo]:
        """Dial every stage, ask for its info, and check the ring. With ``use_spares``, a stage that
        cannot be reached is replaced by a spare of the ring file holding its layers, if any.

        Raises:
            StageLost / HopTimeout: a stage is unreachable (names its addr).
            ConfigError: a stage serves other layers or another model, or the ranges do not tile.
        """
        check_tiling([s.layers for s in self.ring.stages], num_layers)
        self._num_layers, self._model_digest, self._nursery = num_layers, model_digest, nursery
        for i, spec in enumerate(self.ring.stages):
            try:
                self.links.append(await self._link(i, spec))
            except StageLost:
                if not use_spares:
                    raise
                spare = await self.prepare_spare(i, (spec.layers.start, spec.layers.end))
                if spare is None:
                    raise
                log.warning("ring.connect_spare index=%d layers=%s unreachable=%s spare=%s", i, spec.layers,
                            spec.addr, spare.info.peer_id)
                self.links.append(spare)
        return self.infos

    async def aclose(self) -> None:
        """Close every stream to the ring (a stage drops the sessions they opened). Never raises."""
        with trio.CancelScope(shield=True):
            for link in self.links:
                for stream in (link.data, link.control):
                    with trio.move_on_after(1.0):
                        await stream.aclose()

    def healed_ring(self) -> RingSpec:
        """The ring as it stands now (after any heal) and the spares not used yet."""
        return RingSpec(model=self.ring.model, stages=tuple(self.stage_specs), spares=tuple(self.spares))

    async def _link(self, index: int, spec: StageSpec) -> _Link:
        """Dial ``spec`` (data + control streams), check its info, start its readers."""
        streams = []
        for _ in range(2):
            try:
                streams.append(await self.host.open_stream(spec.addr, PROTOCOL_ID, timeout_s=self.connect_timeout_s))
            except ProtocolError as exc:
                raise StageLost(f"stage {index} {spec.layers} at {spec.addr} is not a swarm stage: {exc}") from exc
            except SwarmError as exc:
                raise StageLost(f"stage {index} {spec.layers} is unreachable: {exc}") from exc
        self._generation += 1
        gen = self._generation
        for stream in streams:
            self._nursery.start_soon(self._pump, index, gen, stream)
        # one request in flight at a time: _expect keeps frames that answer something else
        await streams[0].send(wire.frame("info"), timeout_s=self.hop_timeout_s)
        msg = await self._expect(index, "info_ok", gen=gen)
        got = tuple(msg["layers"])
        if got != (spec.layers.start, spec.layers.end):
            raise ConfigError(f"stage {index} at {spec.addr} serves layers [{got[0]}, {got[1]}) but the ring file "
                              f"says {spec.layers}")
        if msg["num_layers"] != self._num_layers or msg["model_digest"] != self._model_digest:
            raise ConfigError(f"stage {index} at {spec.addr} serves model {msg['model']!r} "
                              f"({msg['num_layers']} layers, digest {msg['model_digest'][:12]}) but the ring file "
                              f"names {self.ring.model!r} ({self._num_layers} layers, digest {self._model_digest[:12]})")
        if msg["peer_id"] != spec.peer_id:
            raise ConfigError(f"stage {index} at {spec.addr} answered as PeerId {msg['peer_id']}")
        kernels = msg.get("kernels")
        info = StageInfo(index, spec.addr, msg["peer_id"], got, msg["model"], msg["model_digest"], msg["max_ctx"],
                         msg["dtype"], rows_proven=not isinstance(kernels, dict) or kernels.get("rows_ok") is not False)
        return _Link(spec, streams[0], streams[1], info, gen)

    async def _pump(self, index: int, gen: int, stream) -> None:
        while True:
            try:
                msg = await stream.recv()
            except (StreamClosed, ProtocolError) as exc:
                await self._send_ch.send((index, gen, {"type": "_lost", "reason": str(exc)}))
                return
            if msg.get("type") == "result" and index == len(self.links) - 1 and self._current(index, gen):
                ledger = self.ledgers.get(msg.get("session"))
                if ledger is not None:  # every result the tail sent, in order, also stale ones
                    try:
                        ledger[1].add(receipts.result_item(msg))
                    except KeyError:
                        pass  # malformed: next_result's validation reports it
            await self._send_ch.send((index, gen, msg))

    # ---- receiving ---------------------------------------------------------------------------

    def _current(self, index: int, gen: int) -> bool:
        return index < len(self.links) and self.links[index].generation == gen

    async def _next(self, timeout_s: float, gen: int | None = None) -> tuple[int, dict]:
        """The next frame of a current connection; with ``gen``, only of that connection (one being
        set up), keeping the others' frames for later. Frames of replaced connections are dropped."""
        kept: list = []
        try:
            with trio.move_on_after(timeout_s):
                while True:
                    if self._deferred:
                        item = self._deferred.popleft()
                    else:
                        item = await self._recv_ch.receive()
                    index, g, msg = item
                    if gen is not None:
                        if g == gen:
                            return index, msg
                        if self._current(index, g):
                            kept.append(item)
                    elif self._current(index, g):
                        return index, msg
        finally:
            self._deferred.extendleft(reversed(kept))
        raise HopTimeout(f"no answer from the ring within {timeout_s:.1f} s")

    def _raise_for(self, index: int, msg: dict, session: str | None = None) -> None:
        spec = self.ring.stages[index] if index >= len(self.links) else self.links[index].spec
        if msg.get("type") == "_lost":
            raise StageLost(f"stage {index} {spec.layers} at {spec.addr} closed the connection: {msg['reason']}")
        if msg.get("type") == "error" and msg.get("session") not in (None, session):
            log.debug("error.ignored stage=%d session=%s (an earlier session)", index, msg.get("session"))
            return
        if msg.get("type") == "error":
            exc = StageLost if msg.get("code") == "unavailable" else RemoteError
            raise exc(f"stage {index} {spec.layers} refused: {msg.get('reason')}")

    async def _expect(self, index: int, kind: str, session: str | None = None, gen: int | None = None) -> dict:
        while True:
            i, msg = await self._next(self.hop_timeout_s, gen)
            self._raise_for(i, msg, session)
            if i == index and msg.get("type") == kind and (session is None or msg.get("session") == session):
                return wire.validate(msg)
            log.debug("frame.ignored stage=%d type=%s", i, msg.get("type"))

    # ---- sessions and chunks -----------------------------------------------------------------

    async def open_session(self, session: str, max_len: int, sampling: dict | None = None,
                           wire_dtype: str | None = None, job: dict | None = None) -> None:
        """Open ``session`` at every stage, telling each its successor (the tail gets none and,
        when sampling, the sampling settings). With ``job`` (``{"id", "nonce"}``) every stage keeps
        receipt digests for the session, and so does this client (``ledgers``)."""
        n = len(self.links)
        if job is not None:
            self.ledgers[session] = (receipts.RollingDigest(), receipts.RollingDigest())
        for i in reversed(range(n)):  # tail first, so each successor exists before it is dialed
            nxt = self.links[i + 1].spec.addr if i + 1 < n else None
            extra = {"sampling": sampling} if sampling and nxt is None else {}
            if job is not None:
                extra["job"] = job
            if wire_dtype and nxt is not None:
                extra["wire_dtype"] = wire_dtype
            if self.batch:
                extra["batch"] = True
            prev = self.links[i - 1].info.peer_id if i > 0 else None
            msg = wire.open_frame(self.host.key_pair, session, nxt, max_len, prev=prev, **extra)
            await self.links[i].data.send(msg, timeout_s=self.hop_timeout_s)
            await self._expect(i, "open_ok", session)
        self.returned[session] = -1

    async def close_session(self, session: str, timeout_s: float = 5.0) -> None:
        """Ask every stage to drop ``session`` (best effort)."""
        for link in self.links:
            try:
                await link.data.send(wire.frame("close", session=session), timeout_s=timeout_s)
            except SwarmError:
                pass
        self.returned.pop(session, None)
        self.ledgers.pop(session, None)

    async def send_chunk(self, session: str, chunk) -> None:
        """Send one chunk (``swarm.spec.Chunk``) to the head stage; do not wait for its result."""
        msg = wire.frame("forward", session=session, epoch=chunk.epoch, pos=chunk.pos, chunk=chunk.chunk_id,
                         tokens=list(chunk.tokens))
        if getattr(chunk, "logits_from", None) is not None:
            msg["logits_from"] = chunk.logits_from
        await self.links[0].data.send(msg, timeout_s=self.hop_timeout_s)
        ledger = self.ledgers.get(session)
        if ledger is not None:
            ledger[0].add(receipts.forward_item(msg))

    async def collect_receipts(self, session: str, timeout_s: float | None = None) -> tuple[list, list[str]]:
        """Ask every stage for its signed receipt of ``session`` (opened with a job).

        The request goes to the head on the data stream, behind every chunk, and each stage passes
        it on behind its own frames; results still in flight arrive (and are digested) first.

        Returns:
            (receipts in ring order, None where a stage sent none in time; reasons for the gaps).
            Never raises for a stage that fails here: a missing receipt fails verification instead.
        """
        timeout_s = timeout_s or self.hop_timeout_s
        got: dict[int, dict] = {}
        problems: list[str] = []
        try:
            await self.links[0].data.send(wire.frame("receipt", session=session), timeout_s=timeout_s)
        except SwarmError as exc:
            return [None] * len(self.links), [f"stage 0: cannot request receipts: {exc}"]
        deadline = time.monotonic() + timeout_s
        while len(got) + len(problems) < len(self.links):
            try:
                i, msg = await self._next(max(0.0, deadline - time.monotonic()))
            except HopTimeout:
                break
            kind = msg.get("type")
            if kind == "receipt_ok" and msg.get("session") == session and isinstance(msg.get("receipt"), dict):
                got[i] = msg["receipt"]
            elif kind == "_lost" or (kind == "error" and msg.get("session") == session):
                problems.append(f"stage {i}: {msg.get('reason')}")
        out = [got.get(i) for i in range(len(self.links))]
        problems += [f"stage {i}: no receipt within {timeout_s:.1f} s" for i, r in enumerate(out)
                     if r is None and not any(p.startswith(f"stage {i}:") for p in problems)]
        return out, problems

    async def next_result(self, session: str) -> dict:
        """The next ``result`` frame of ``session`` from the tail (any epoch), validated.

        While waiting, every ``heartbeat_s`` of silence probes all stages; one that does not answer
        is reported lost at once, so a frozen stage is found in seconds.

        Raises:
            StageLost: a stage closed its stream, stopped answering probes, or lost its successor.
            HopTimeout: no result within ``hop_timeout_s`` although every stage answers.
            RemoteError: a stage answered with an error frame.
        """
        tail = len(self.links) - 1
        deadline = time.monotonic() + self.hop_timeout_s
        while True:
            try:
                i, msg = await self._next(min(self.heartbeat_s, max(0.0, deadline - time.monotonic())))
            except HopTimeout:
                if time.monotonic() >= deadline:
                    raise HopTimeout(f"no result from the ring within {self.hop_timeout_s:.1f} s, "
                                     "though every stage answers heartbeats") from None
                # a probe gets twice the heartbeat: a loaded machine must not look like a dead stage
                reports = await self.probe(session, 2 * self.heartbeat_s)
                lost = [r.index for r in reports if not r.reachable]
                if lost:
                    link = self.links[lost[0]]
                    raise StageLost(f"stage {lost[0]} {link.spec.layers} at {link.spec.addr} stopped answering "
                                    f"heartbeats ({2 * self.heartbeat_s:.1f} s)") from None
                continue
            self._raise_for(i, msg, session)
            if i == tail and msg.get("type") == "result" and msg.get("session") == session:
                msg = wire.validate(msg)
                self.returned[session] = max(self.returned.get(session, -1), msg["chunk"])
                return msg

    async def cancel(self, session: str, epoch: int) -> None:
        """Tell every stage that frames of ``session`` older than ``epoch`` are stale (early
        cancellation: stages drop them before computing). Sent on the control streams so it
        overtakes the data frames queued behind the head's data stream."""
        for link in self.links:
            try:
                await link.control.send(wire.frame("cancel", session=session, epoch=epoch),
                                        timeout_s=self.hop_timeout_s)
            except SwarmError as exc:  # the data path will report a lost stage itself
                log.debug("cancel.failed reason=%s", exc)

    # ---- heal support --------------------------------------------------------------------------

    async def probe(self, session: str, timeout_s: float | None = None) -> list[StageReport]:
        """Ask every stage for its progress on ``session`` (control streams, in parallel).

        A stage whose stream is gone, or that does not answer within ``timeout_s`` (default
        ``heartbeat_s``), is unreachable. Frames that arrive meanwhile are kept for later.
        """
        timeout_s = timeout_s or self.heartbeat_s
        lost: set[int] = set()
        replies: dict[int, dict] = {}
        for i, link in enumerate(self.links):
            try:
                await link.control.send(wire.frame("progress", session=session), timeout_s=timeout_s)
            except SwarmError:
                lost.add(i)
        kept = []
        with trio.move_on_after(timeout_s):
            while len(lost) + len(replies) < len(self.links):
                if self._deferred:
                    index, g, msg = self._deferred.popleft()
                else:
                    index, g, msg = await self._recv_ch.receive()
                if not self._current(index, g):
                    continue
                if msg.get("type") == "progress_ok" and msg.get("session") == session:
                    replies[index] = msg
                else:
                    if msg.get("type") == "_lost":
                        lost.add(index)
                    kept.append((index, g, msg))
        self._deferred.extend(kept)
        reports = []
        for i in range(len(self.links)):
            m = replies.get(i)
            if i in lost or m is None:  # gone: its stream failed; else silent (maybe paused)
                reports.append(StageReport(i, False, gone=i in lost))
            else:
                reports.append(StageReport(i, True, m["received"], m["sent"], bool(m.get("busy"))))
        return reports

    async def prepare_spare(self, index: int, layers: tuple[int, int]) -> _Link | None:
        """Dial the first unused spare holding ``layers`` and check it; None if there is none.
        Spares that fail the dial or the check are dropped from the list."""
        while True:
            spec = next((s for s in self.spares if (s.layers.start, s.layers.end) == tuple(layers)), None)
            if spec is None:
                return None
            self.spares.remove(spec)
            try:
                return await self._link(index, spec)
            except SwarmError as exc:
                log.warning("spare.unusable addr=%s reason=%s", spec.addr, exc)

    def swap(self, index: int, link: _Link) -> None:
        """Put a prepared spare at ring position ``index``; the old connection's frames are ignored."""
        old = self.links[index]
        self.links[index] = link
        log.info("ring.swap index=%d layers=%s old=%s new=%s", index, link.spec.layers, old.info.peer_id,
                 link.info.peer_id)

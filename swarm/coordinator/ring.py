"""The coordinator's client of a ring: sessions, chunks, results, cancels and receipts.

Owns: ``RingClient``, the one object the coordinator and ``swarm serve`` drive: a session opened at every stage
(tail first, signed), chunks to the head, the tail's results (with heartbeat probes), cancels, closes and the
stages' receipts; composed of ``net`` (``RingLinks``) and ``repair`` (``RingRepair``), one ``SessionBook`` each.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from swarm import receipts, wire
from swarm.config import RingSpec
from swarm.errors import HopTimeout, StageLost, StreamClosed, SwarmError
from swarm.frames import Cancel, Close, Error, Forward, InfoOk, LinkLost, OpenOk, Receipt, ReceiptOk, Result
from swarm.heal import Probe, locate_failure
from swarm.ranges import check_tiling
from swarm.coordinator.books import SessionBook
from swarm.coordinator.links import F, Link, RingLinks, StageInfo
from swarm.coordinator.repair import RingRepair

log = logging.getLogger(__name__)

GAP_S = 5.0  # a gap in the chain of progress this long, every stage still answering, is a broken hop


class RingClient:
    """Streams from the coordinator to every stage of a ring, and the frames they send back.

    Args:
        host: a running SwarmHost. ring: the ring file (stages in order, spares).
        hop_timeout_s: longest wait for one result while every stage still answers heartbeats.
        connect_timeout_s: deadline for dialing a stage.
        heartbeat_s: silence after which stages are probed; a probe unanswered this long marks
            the stage unreachable.
        batch: open sessions that stages may pack with other sessions (swarm serve).
        model_id: when set (routes from the DHT), every stage must report this weights id.
    """

    def __init__(self, host, ring: RingSpec, hop_timeout_s: float, connect_timeout_s: float,
                 heartbeat_s: float = 1.0, batch: bool = False, model_id: str | None = None):
        self.host = host
        self.model_id = model_id
        self.discovery = None  # the swarm.coordinator.routing.RouteContext of a routed ring: heals look there
        self.shut_out = None  # swarm.auditor.exclusions.Exclusions: stages with a verified fraud proof, never used
        self.batch = batch
        self.ring = ring
        self.hop_timeout_s = hop_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.heartbeat_s = heartbeat_s
        self.books: dict[str, SessionBook] = {}  # session -> what this client keeps of it
        self.net = RingLinks(host, ring, hop_timeout_s=hop_timeout_s, connect_timeout_s=connect_timeout_s,
                             model_id=model_id, on_tail_result=self._tail_result, repaired_epoch=self.repaired_epoch)
        self.repair = RingRepair(self.net, host, ring.spares, open_at=self.open_at, books=self.books, batch=batch)

    @property
    def links(self) -> list[Link]:
        """The links to the stages, in ring order (after any heal)."""
        return self.net.links

    @property
    def infos(self) -> list[StageInfo]:
        """What each stage of the ring reported about itself, in ring order (after any heal)."""
        return self.net.infos

    def _tail_result(self, msg: Result) -> None:
        """Count a result frame the tail sent as returned the moment it arrives, read or not (a probe
        taken while the frame waits in the queue, during a heal, must not blame the tail that sent
        it), and add it to its session's received ledger (sessions with a job)."""
        book = self.books.get(msg.session)
        if book is None:
            return
        book.returned = max(book.returned, msg.chunk)
        if book.ledger is not None:
            book.ledger[1].add(receipts.result_item(msg))

    def repaired_epoch(self, session: str) -> int:
        """The epoch of ``session``'s last repair (-1: none, or no such session)."""
        book = self.books.get(session)
        return -1 if book is None else book.repaired_epoch

    # ---- connecting -----------------------------------------------------------------------------

    async def connect(self, num_layers: int, model_digest: str, nursery, use_spares: bool = False) -> list[StageInfo]:
        """Dial every stage, ask for its info, and check the ring. With ``use_spares``, a stage that
        cannot be reached is replaced by a spare of the ring file holding its layers, if any.

        Raises:
            StageLost / HopTimeout: a stage is unreachable (names its addr).
            ConfigError: a stage serves other layers or another model, or the ranges do not tile.
        """
        check_tiling([s.layers for s in self.ring.stages], num_layers)
        self.net.start(num_layers, model_digest, nursery)
        for i, spec in enumerate(self.ring.stages):
            try:
                self.links.append(await self.net.dial(i, spec))
            except StageLost:
                if not use_spares:
                    raise
                spare = await self.repair.prepare_spare(i, (spec.layers.start, spec.layers.end))
                if spare is None:
                    raise
                log.warning("ring.connect_spare index=%d layers=%s unreachable=%s spare=%s", i, spec.layers,
                            spec.addr, spare.info.peer_id)
                self.links.append(spare)
        return self.infos

    async def aclose(self) -> None:
        """Close every stream to the ring and its shadows (a stage drops the sessions they opened). Never raises."""
        await self.net.drop(self.links + list(self.repair.shadows.values()))

    def healed_ring(self) -> RingSpec:
        """The ring as it stands now (after any heal) and the spares not used yet."""
        return RingSpec(model=self.ring.model, stages=tuple(self.net.stage_specs),
                        spares=tuple(self.repair.spares) + tuple(link.spec for link in self.repair.shadows.values()))

    async def probe(self, session: str) -> list:
        """Every stage's progress on ``session`` (``RingLinks.probe``, within twice the heartbeat: a
        loaded machine must not look like a dead stage)."""
        return await self.net.probe(session, 2 * self.heartbeat_s)

    async def stage_info(self, index: int) -> InfoOk:
        """Stage ``index``'s ``info_ok`` frame now (``RingLinks.stage_info``; only between sessions).

        Raises:
            StageLost / HopTimeout: the stage does not answer.
        """
        return await self.net.stage_info(index)

    # ---- sessions and chunks --------------------------------------------------------------------

    async def open_session(self, session: str, max_len: int, sampling: dict | None = None,
                           wire_dtype: str | None = None, job: dict | None = None, shadow: bool = False,
                           prefix_ids: list[int] | None = None, prefix_salt: str = "") -> int:
        """Open ``session`` at every stage, telling each its successor (the tail gets none and,
        when sampling, the sampling settings). With ``job`` (``{"id", "nonce"}``) every stage keeps
        receipt digests for the session, and so does this client (its book's ``ledger``). With ``shadow``, the
        session is first opened as a shadow at the warm spares in ``shadows`` (each position's
        predecessor then mirrors what it sends on to it; this client mirrors the head's token ids).
        With ``prefix_ids`` (the prompt), each stage may fill the session's KV cache from its prefix
        cache (docs/protocol.md, "Prefix reuse"), within the scope ``prefix_salt`` (see
        ``prefix_namespace``): blocks kept under another salt are never reused.

        Returns:
            positions ``[0, n)`` every stage already holds (0 without ``prefix_ids``, or with a shadow:
            a shadow holds no prefix): the prefill starts at ``n``.
        """
        self.books[session] = book = SessionBook(prefix_salt=prefix_salt)
        if job is not None:
            book.ledger = (receipts.RollingDigest(), receipts.RollingDigest())
        opened = await self.repair.open_shadows(session, max_len, sampling, wire_dtype, job) if shadow else {}
        mirrors = {i - 1: (link.spec.addr, link.info.layers[1]) for i, link in opened.items() if i > 0}
        reused = await self.open_at(range(len(self.links)), session, max_len, sampling, wire_dtype, job,
                                    mirrors=mirrors, prefix_ids=[] if opened and prefix_ids is not None else prefix_ids)
        if 0 in opened:
            self.repair.start_head_mirror(session, opened[0])
        return reused

    def prefix_namespace(self, index: int, wire_dtype: str | None, salt: str = "") -> str:
        """What scopes the prefix cache of the stage at ring ``index``: a digest of the model, the wire
        dtype and the stages before it (PeerId, layers, dtype): the hidden states it receives depend
        on all of them, so KV cached behind another path is never reused (the stage adds its own
        layers, dtype, GEMM tile and this coordinator's PeerId); and of ``salt`` (the request's cache
        salt, issue 45 item 16): every block key of the stage chains from this digest, so sessions of
        different salts share no block, and the stage never sees the salt itself. "" (no salt) gives
        the namespace of before salts existed."""
        upstream = [[x.peer_id, list(x.layers), x.dtype] for x in self.infos[:index]]
        scope = [self.net.model_digest, wire_dtype or "stage", upstream] + ([["salt", salt]] if salt else [])
        return hashlib.sha256(repr(scope).encode()).hexdigest()

    async def open_at(self, positions, session: str, max_len: int, sampling: dict | None = None,
                      wire_dtype: str | None = None, job: dict | None = None, mirrors: dict | None = None,
                      prefix_ids: list[int] | None = None) -> int:
        """Open ``session`` at the stages at ring ``positions`` (consecutive), last first so each
        successor exists before it is dialed; each is told its successor and predecessor as the
        ring stands now (a heal opens only its replacement this way). ``mirrors``: ring position ->
        (multiaddr, end layer) of the shadow of its successor, which it mirrors to. ``prefix_ids``:
        the prompt, for the stages' prefix caches.

        Returns:
            the fewest leading positions any of those stages took from its prefix cache (0 without
            ``prefix_ids``).
        Raises:
            StageLost: a stage's connection is gone or it refused as ``unavailable`` (the stages after
                it in ring order hold the session now). HopTimeout, RemoteError.
        """
        n = len(self.links)
        reused = []
        book = self.books.setdefault(session, SessionBook())
        if prefix_ids is not None:
            book.prefixed = True
        elif book.prefixed:  # a heal's replacement: it holds no prefix, but keeps the session's KV
            prefix_ids = []
        for i in sorted(positions, reverse=True):
            nxt = self.links[i + 1].spec.addr if i + 1 < n else None
            extra = {"sampling": sampling} if sampling and nxt is None else {}
            if job is not None:
                extra["job"] = job
            if wire_dtype and nxt is not None:
                extra["wire_dtype"] = wire_dtype
            if self.batch:
                extra["batch"] = True
            extra["layers"] = list(self.links[i].info.layers)
            if mirrors and i in mirrors:
                extra["mirror"], extra["mirror_until"] = mirrors[i]
            if prefix_ids is not None:
                extra["prefix"] = {"ids": list(prefix_ids),
                                   "ns": self.prefix_namespace(i, wire_dtype, book.prefix_salt)}
            prev = self.links[i - 1].info.peer_id if i > 0 else None
            msg = wire.open_frame(self.host.key_pair, session, nxt, max_len, prev=prev, **extra)
            link = self.links[i]
            try:
                await link.data.send(msg, timeout_s=self.hop_timeout_s)
            except StreamClosed as exc:  # it died since the last session of this client: a heal can replace it
                raise StageLost(f"stage {i} {link.spec.layers} at {link.spec.addr} closed the connection: "
                                f"{exc}") from exc
            ok = await self._expect_alive(i, OpenOk, session)
            reused.append((ok.reused or 0) if prefix_ids else 0)  # [] (a replacement) reuses nothing
        return min(reused, default=0)

    async def _expect_alive(self, index: int, kind: type[F], session: str) -> F:
        """``RingLinks.expect``, probing the stages after every ``heartbeat_s`` of silence as ``next_result``
        does: a stage that stops answering (frozen) is StageLost in seconds, not a HopTimeout after
        ``hop_timeout_s``.

        Raises:
            StageLost: a stage stopped answering probes, or its stream closed.
            HopTimeout: no ``kind`` frame within ``hop_timeout_s`` though it answers. RemoteError.
        """
        deadline = time.monotonic() + self.hop_timeout_s
        while True:
            i, msg = await self._next_probing(session, deadline, f"stage {index} sent no {kind.TYPE}",
                                              " while opening the session")
            if i is None:
                continue  # every stage answered the probe
            self.net.raise_for(i, msg, session)
            if i == index and isinstance(msg, kind) and msg.session == session:
                return msg
            log.debug("frame.ignored stage=%d type=%s", i, msg.TYPE)

    async def close_session(self, session: str, timeout_s: float = 5.0, keep: list[int] | None = None) -> None:
        """Ask every stage to drop ``session`` (best effort). ``keep``: the session's committed ids
        (prompt + output); each stage then caches the KV of their leading blocks for a later prompt
        that starts with them (its prefix cache; a stage without one ignores it)."""
        close = Close(session=session, keep=list(keep) if keep else None)
        for link in self.links:
            try:
                await link.data.send(close, timeout_s=timeout_s)
            except SwarmError:
                pass
        self.books.pop(session, None)
        await self.repair.forget(session, timeout_s)

    @property
    def rotary_switch(self) -> int | None:
        """LongRoPE's switch (:func:`swarm.coordinator.spec.rotary_switch`) of the ring's model, read from
        its ``config.json`` where the model is a local directory; None for any other rotary or no such
        directory (the stages then refuse a chunk that crosses the switch rather than mix factors)."""
        from swarm.coordinator.spec import rotary_switch

        path = Path(str(self.ring.model)) / "config.json"
        return rotary_switch(json.loads(path.read_text())) if path.is_file() else None

    async def send_chunk(self, session: str, chunk) -> None:
        """Send one chunk (``swarm.coordinator.spec.Chunk``) to the head stage; do not wait for its result.

        Raises:
            StageLost: the head's stream is closed. HopTimeout: the send did not finish in time.
        """
        msg = Forward(session=session, epoch=chunk.epoch, pos=chunk.pos, chunk=chunk.chunk_id,
                      tokens=list(chunk.tokens), logits_from=getattr(chunk, "logits_from", None))
        head = self.links[0]
        try:
            await head.data.send(msg, timeout_s=self.hop_timeout_s)
        except StreamClosed as exc:  # the head died: as in open_at, a heal can replace it
            raise StageLost(f"stage 0 {head.spec.layers} at {head.spec.addr} closed the connection: {exc}") from exc
        # the head's shadow gets the same token ids (its own bounded queue)
        self.repair.post_to_head_shadow(session, chunk.epoch, chunk.pos, list(chunk.tokens))
        book = self.books.get(session)
        if book is not None:
            book.sent = max(book.sent, chunk.chunk_id)
            if book.ledger is not None:
                book.ledger[0].add(receipts.forward_item(msg))

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
            await self.links[0].data.send(Receipt(session=session), timeout_s=timeout_s)
        except SwarmError as exc:
            return [None] * len(self.links), [f"stage 0: cannot request receipts: {exc}"]
        deadline = time.monotonic() + timeout_s
        while len(got) + len(problems) < len(self.links):
            try:
                i, msg = await self.net.next(max(0.0, deadline - time.monotonic()))
            except HopTimeout:
                break
            if isinstance(msg, ReceiptOk) and msg.session == session:
                got[i] = msg.receipt
            elif isinstance(msg, LinkLost) or (isinstance(msg, Error) and msg.session == session):
                problems.append(f"stage {i}: {msg.reason}")
        out = [got.get(i) for i in range(len(self.links))]
        problems += [f"stage {i}: no receipt within {timeout_s:.1f} s" for i, r in enumerate(out)
                     if r is None and not any(p.startswith(f"stage {i}:") for p in problems)]
        return out, problems

    async def next_result(self, session: str) -> Result:
        """The next ``result`` frame of ``session`` from the tail (any epoch), validated.

        While waiting, every ``heartbeat_s`` of silence probes all stages; one that does not answer
        is reported lost at once, so a frozen stage is found in seconds.

        Raises:
            StageLost: a stage closed its stream, stopped answering probes, lost its successor, or a gap
                in the chain of progress (a hop swallowing frames) persisted for ``GAP_S``.
            HopTimeout: no result within ``hop_timeout_s`` although every stage answers.
            RemoteError: a stage answered with an error frame.
        """
        tail = len(self.links) - 1
        deadline = time.monotonic() + self.hop_timeout_s
        earlier: Probe | None = None
        gap_since: float | None = None
        while True:
            i, msg = await self._next_probing(session, deadline, "no result from the ring")
            if i is None:
                reports = msg
                # every stage answers, but a hop may be broken in silence (a relayed hop whose relay
                # died swallows frames): a gap in the chain of progress that persists is a loss
                book = self.books.get(session) or SessionBook()
                now_probe = Probe(tuple(reports), book.sent, book.returned)
                failure = locate_failure(reports, now_probe.sent, now_probe.returned, earlier) if earlier else None
                earlier = now_probe
                if failure is None or not failure.reason.startswith("silent"):
                    gap_since = None
                    continue
                gap_since = gap_since or time.monotonic()
                if time.monotonic() - gap_since >= max(GAP_S, 5 * self.heartbeat_s):
                    link = self.links[failure.index]
                    raise StageLost(f"stage {failure.index} {link.spec.layers} at {link.spec.addr}: {failure.reason} "
                                    f"for {time.monotonic() - gap_since:.1f} s (a broken hop)") from None
                continue
            self.net.raise_for(i, msg, session)
            if i == tail and isinstance(msg, Result) and msg.session == session:
                book = self.books.get(session)
                if book is not None:
                    book.returned = max(book.returned, msg.chunk)
                return msg

    async def _next_probing(self, session: str, deadline: float, waiting: str, during: str = "") -> tuple:
        """The next frame before ``deadline`` (monotonic s), as ``(ring index, frame)``; after each
        ``heartbeat_s`` of silence, every stage is probed instead and ``(None, the reports)`` returned
        when all answered, so a frozen stage is found in seconds.

        Raises:
            StageLost: a stage did not answer the probe (``during`` says what was waited for).
            HopTimeout: the deadline passed though every stage answers (``waiting`` names what).
        """
        try:
            return await self.net.next(min(self.heartbeat_s, max(0.0, deadline - time.monotonic())))
        except HopTimeout:
            if time.monotonic() >= deadline:
                raise HopTimeout(f"{waiting} within {self.hop_timeout_s:.1f} s, though every stage answers "
                                 "heartbeats") from None
        # a probe gets twice the heartbeat: a loaded machine must not look like a dead stage
        reports = await self.net.probe(session, 2 * self.heartbeat_s)
        lost = [r.index for r in reports if not r.reachable]
        if lost:
            link = self.links[lost[0]]
            raise StageLost(f"stage {lost[0]} {link.spec.layers} at {link.spec.addr} stopped answering "
                            f"heartbeats ({2 * self.heartbeat_s:.1f} s){during}")
        return None, reports

    async def cancel(self, session: str, epoch: int) -> None:
        """Tell every stage that frames of ``session`` older than ``epoch`` are stale (early
        cancellation: stages drop them before computing). Sent on the control streams so it
        overtakes the data frames queued behind the head's data stream."""
        for link in self.links:
            try:
                await link.control.send(Cancel(session=session, epoch=epoch),
                                        timeout_s=self.hop_timeout_s)
            except SwarmError as exc:  # the data path will report a lost stage itself
                log.debug("cancel.failed reason=%s", exc)

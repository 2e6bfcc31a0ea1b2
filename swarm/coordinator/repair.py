"""The ring client's repair: warm spares, swapping a link, keeping a session at the survivors, shadows.

Owns: ``RingRepair``, composed into ``RingClient`` as ``repair``: ``prepare_spare``, ``swap`` (a spare or a chain
at a ring position), ``repair_session`` (the session kept at the survivors around the replacement, or a shadow
promoted) and shadows (``open_shadows``, ``start_head_mirror``, ``shadow_state``). docs/architecture.md, "Healing".
"""

from __future__ import annotations

import logging
from dataclasses import replace

import trio

from swarm import receipts, wire
from swarm.config import StageSpec
from swarm.errors import ConfigError, RemoteError, StageLost, SwarmError
from swarm.frames import Close, OpenOk, Progress, ProgressOk, Refill, RepairOk
from swarm.ranges import LayerRange
from swarm.transport.circuit import is_circuit
from swarm.coordinator.books import SessionBook
from swarm.coordinator.links import Link, RingLinks

log = logging.getLogger(__name__)

REFILL_TOKENS = 64  # positions per refill frame the coordinator sends a new head
SHADOW_TIMEOUT_S = 5.0  # longest wait for a shadow to answer an open or a probe, in seconds
RELAYED_SPARE_WAIT_S = 5.0  # how long a relayed spare that cannot be reached is tried again, in seconds


class RingRepair:
    """Spares, swaps, repairs that keep the survivors' session, and shadows (see the module docstring).

    Args:
        net: the client's links to the ring (dials, frames, ``lost_gens``).
        host: the client's SwarmHost; its ``key_pair`` signs open and repair frames.
        spares: the ring file's spares not used yet (taken from as spares are prepared).
        open_at: the client's ``RingClient.open_at`` (open a session at some ring positions).
        books: the client's ``SessionBook`` of each session (``RingClient.books``): a repair that
            replaces the head or the tail closes its ledger into ``segments``, and records the session's
            new epoch in ``repaired_epoch``.
        batch: sessions are opened for packing with others (``swarm serve``).
    """

    def __init__(self, net: RingLinks, host, spares, *, open_at, books: dict[str, SessionBook], batch: bool = False):
        self.net = net
        self.host = host
        self.spares: list[StageSpec] = list(spares)
        self.open_at = open_at
        self.books = books
        self.batch = batch
        # warm spares shadowing ring positions (layer range -> link, kept across sessions), the shadows
        # each session opened (session -> layer range -> link), and the coordinator's mirror of the token
        # ids it sends to the head, to the head's shadow (session -> swarm.mirror.Mirror)
        self.shadows: dict[tuple[int, int], Link] = {}
        self.shadowed: dict[str, dict[tuple[int, int], Link]] = {}
        self.head_mirrors: dict = {}
        self.last_repair: dict = {}  # how the last repair_session rebuilt the replacement (see there)

    @property
    def links(self) -> list[Link]:
        return self.net.links

    # ---- the shadows' books (RingOps reads them through these)

    def take_shadow(self, session: str, layers: tuple[int, int]) -> Link | None:
        """The shadow ``session`` opened for ring position ``layers``, out of the books (a heal takes it
        as the spare, or drops it); None when it had none."""
        link = self.shadowed.get(session, {}).pop(tuple(layers), None)
        if link is not None:
            self.shadows.pop(tuple(layers), None)
        return link

    def has_shadow(self, layers: tuple[int, int]) -> bool:
        """Whether a shadow for ``layers`` is ready and its connection not lost."""
        link = self.shadows.get(tuple(layers))
        return link is not None and link.generation not in self.net.lost_gens

    def keep_shadow(self, layers: tuple[int, int], link: Link) -> None:
        """Keep ``link`` as the shadow of ``layers`` for the sessions to come."""
        self.shadows[tuple(layers)] = link

    def shadow_peers(self) -> set[str]:
        """The PeerIds of the shadows kept (none may take another ring position)."""
        return {link.info.peer_id for link in self.shadows.values()}

    async def try_spare(self, index: int, layers: tuple[int, int]) -> Link | None:
        """:meth:`prepare_spare` from the ring file's spares, leaving them as they were when none answers
        (it is tried again at a heal)."""
        before = list(self.spares)
        link = await self.prepare_spare(index, layers)
        if link is None:
            self.spares = before
        return link

    async def drop(self, links) -> None:
        """Close the connections of ``links`` (spares not taken, stages that left the ring)."""
        await self.net.drop(links)

    @property
    def hop_timeout_s(self) -> float:
        return self.net.hop_timeout_s

    async def prepare_spare(self, index: int, layers: tuple[int, int], spec=None) -> Link | None:
        """Dial an unused spare of the ring file holding ``layers`` and check it; None if there is
        none. A spare whose block is exactly ``layers`` comes first, then the narrowest block that
        contains them (a stage serves any sub-range of its block). Spares that fail the dial or the
        check are dropped from the list. With ``spec`` (a StageSpec found elsewhere, e.g. on the
        DHT) dial exactly that stage instead.

        A spare behind a relay (a circuit address) that cannot be reached is tried again for up
        to ``RELAYED_SPARE_WAIT_S``: after a relay restarts, its stages need a moment to reserve
        again (``swarm.transport.circuit.CircuitClient.keep_reservation``)."""
        if spec is not None:
            return await self._dial_spare(index, spec)
        while True:
            lo, hi = layers
            holding = [s for s in self.spares if s.layers.start <= lo and hi <= s.layers.end]
            if not holding:
                return None
            spec = min(holding, key=lambda s: len(s.layers))  # stable: the ring file's order among equals
            self.spares.remove(spec)
            link = await self._dial_spare(index, replace(spec, layers=LayerRange(lo, hi)))
            if link is not None:
                return link

    async def _dial_spare(self, index: int, spec) -> Link | None:
        deadline = trio.current_time() + (RELAYED_SPARE_WAIT_S if is_circuit(spec.addr) else 0.0)
        while True:
            try:
                return await self.net.dial(index, spec)
            except StageLost as exc:  # unreachable: a relayed one may be reserving again
                if trio.current_time() >= deadline:
                    log.warning("spare.unusable addr=%s reason=%s", spec.addr, exc)
                    return None
                log.info("spare.retry addr=%s reason=%s", spec.addr, exc)
                await trio.sleep(0.25)
            except SwarmError as exc:
                log.warning("spare.unusable addr=%s reason=%s", spec.addr, exc)
                return None

    async def repair_session(self, session: str, index: int, count: int, *, epoch: int, keep: int,
                             tokens: list[int], replaced: str, max_len: int, sampling: dict | None = None,
                             wire_dtype: str | None = None, job: dict | None = None,
                             shadow: bool = False) -> str | None:
        """Keep ``session`` at the survivors after the stages at ring positions ``[index, index +
        count)`` replaced a lost one (``swap``): the survivors keep their KV caches, and only the
        replacement computes positions ``[0, keep)``.

        Steps: open the session at the replacement (last first; a shadow is promoted instead, right
        after its successor takes its frames); ``repair`` the successor (its new predecessor), every
        other survivor (the new ``epoch``, and each reports its ``kv_len``,
        which must reach ``keep``), then the predecessor (its new successor, and ``resend`` of the
        hidden states it sent for ``[0, keep)``, up to the replaced range's end layer), or, when
        the head was lost, send ``tokens[:keep]`` to the new head as ``refill`` frames. The
        coordinator's ledger of what it sent to the head (a new head) or got from the tail (a new
        tail) is closed first (``segments``), naming ``replaced``.

        With ``shadow`` the replacement is the shadow of this session (``open_shadows``): it is
        promoted (``repair``, its successor named) instead of opened, and the predecessor's repair
        says ``mirror`` (promote the mirror: resend only what it did not deliver; for a lost head
        this client promotes its own mirror of the token ids). A mirror that was dropped falls back
        to the refill path: the session is opened afresh at the spare and everything is resent.
        ``last_repair`` says which: ``{"mode": "shadow" | "survivors_kept", "refill_tokens",
        "shadow_fallback"}``.

        Returns:
            None when the survivors were repaired (the replacement's refill is queued behind it),
            else why not (a survivor lost the session, holds too few positions, or no longer holds
            what it sent): the caller falls back to a full replay on a fresh session.
        Raises:
            StageLost / HopTimeout: a stage failed meanwhile (a second failure).
        """
        n = len(self.links)
        last = index + count - 1
        until = self.links[last].info.layers[1]
        self.books.setdefault(session, SessionBook()).repaired_epoch = epoch
        ledger = self._close_ledgers(session, index, last, replaced)
        self.last_repair = {"mode": "shadow" if shadow else "survivors_kept", "refill_tokens": keep,
                            "shadow_fallback": ""}
        shadow = shadow and count == 1
        opening = (max_len, sampling, wire_dtype, job)
        async def promote() -> None:  # the shadow holds the session already: promote it (its successor named)
            kw = {"next_addr": self.links[index + 1].spec.addr} if index + 1 < n else {}
            await self.links[index].data.send(wire.repair_frame(self.host.key_pair, session, epoch, **kw),
                                              timeout_s=self.hop_timeout_s)
            await self.net.expect(index, RepairOk, session)

        try:
            if not shadow:
                await self.open_at(range(index, last + 1), session, *opening)
            short, start, shadow = await self._repair_survivors(session, index, last, epoch, keep, until, shadow,
                                                                opening, promote if shadow else None)
            if short is not None:
                return short
            if shadow and index == 0:  # this client mirrored the head's token ids
                start, ledger = await self._promote_head_mirror(session, epoch, keep, until, ledger, opening)
        except RemoteError as exc:
            return str(exc)
        self.last_repair["refill_tokens"] = keep - start  # positions [start, keep) are refilled
        if index == 0:
            await self._refill_head(session, epoch, tokens, start, keep, until, ledger)
        return None

    def _close_ledgers(self, session: str, index: int, last: int, replaced: str):
        """Close the session's receipt ledger on each side whose stage is replaced (a new head: what
        was sent; a new tail: what was received) into ``segments``, naming ``replaced``, and start a
        fresh one there.

        Returns:
            the session's (sent, received) ledgers now; None without a job.
        """
        book = self.books.get(session)
        ledger = None if book is None else book.ledger
        if ledger is not None:
            if index == 0:  # frames from now on go to the new head
                book.segments.append({"side": "sent", "peer": replaced, **ledger[0].as_dict()})
                ledger = book.ledger = (receipts.RollingDigest(), ledger[1])
            if last == len(self.links) - 1:  # results from now on come from the new tail
                book.segments.append({"side": "received", "peer": replaced, **ledger[1].as_dict()})
                ledger = book.ledger = (ledger[0], receipts.RollingDigest())
        return ledger

    async def _repair_survivors(self, session: str, index: int, last: int, epoch: int, keep: int, until: int,
                                shadow: bool, opening: tuple, promote=None) -> tuple[str | None, int, bool]:
        """Send ``repair`` to every survivor around the replacement at ``[index, last]``: the successor
        first (its new predecessor), then the others (the new ``epoch``), the predecessor last (its new
        successor and ``resend`` of ``[0, keep)``, or with ``shadow`` the promotion of its mirror; a
        mirror it dropped falls back to ``_shadow_fallback``). ``opening``: (max_len, sampling,
        wire_dtype, job) of the session. ``promote``: awaited once the successor takes frames from the
        replacement (at once for a new tail): a promoted shadow sends on the frames it computes, and a
        successor still expecting the lost stage would refuse them.

        Returns:
            (why the survivors cannot keep the session or None, the first position the predecessor
            does not resend from its mirror, whether the shadow is still promoted).
        Raises:
            RemoteError: a survivor refused; StageLost / HopTimeout.
        """
        n = len(self.links)
        start = 0
        if promote is not None and last + 1 >= n:
            await promote()
        order = ([last + 1] if last + 1 < n else []) + [i for i in range(n) if i < index - 1 or i > last + 1]
        order += [index - 1] if index > 0 else []
        for i in order:
            kw = {}
            if i == last + 1:
                kw["prev"] = self.links[last].info.peer_id
            if i == index - 1:
                kw.update(next_addr=self.links[index].spec.addr, resend=keep, until=until, mirror=shadow)
            await self.links[i].data.send(wire.repair_frame(self.host.key_pair, session, epoch, **kw),
                                          timeout_s=self.hop_timeout_s)
            try:
                ok = await self.net.expect(i, RepairOk, session)
            except RemoteError as exc:
                if not (shadow and i == index - 1):
                    raise
                shadow = False
                await self._shadow_fallback(session, index, str(exc), epoch, keep, until, *opening)
                ok = await self.net.expect(i, RepairOk, session)
            if i == index - 1:
                start = (ok.mirrored or 0) if shadow else 0
            if ok.kv_len < keep:
                return (f"stage {i} {self.links[i].info.layers} holds {ok.kv_len} positions of the session, "
                        f"fewer than the {keep} to keep"), start, shadow
            if i == last + 1 and promote is not None:
                await promote()
        return None, start, shadow

    async def _promote_head_mirror(self, session: str, epoch: int, keep: int, until: int, ledger,
                                   opening: tuple) -> tuple[int, tuple | None]:
        """Promote this client's mirror of the head's token ids to the new head (its shadow); a mirror
        that is missing or was dropped falls back to ``_shadow_fallback`` (refill from position 0).

        Returns:
            (the first position still to refill, the session's ledgers now: after a promotion the new
            head's input digest begins with the mirrored frames).
        """
        mirror = self.head_mirrors.pop(session, None)
        if mirror is not None and await mirror.promote():
            if ledger is not None:  # the new head's input digest began with the mirrored frames
                ledger = self.books[session].ledger = (mirror.digest, ledger[1])
            return min(mirror.end, keep), ledger
        why = "no mirror" if mirror is None else f"the mirror was dropped ({mirror.broken})"
        await self._shadow_fallback(session, 0, why, epoch, keep, until, *opening)
        return 0, ledger

    async def _refill_head(self, session: str, epoch: int, tokens: list[int], start: int, keep: int, until: int,
                           ledger) -> None:
        """Send the new head ``tokens[start:keep]`` as ``refill`` frames of ``REFILL_TOKENS`` positions
        (each computed up to layer ``until``), adding each to the sent ledger."""
        for pos in range(start, keep, REFILL_TOKENS):
            msg = Refill(session=session, epoch=epoch, pos=pos, until=until,
                         tokens=list(tokens[pos:min(keep, pos + REFILL_TOKENS)]))
            await self.links[0].data.send(msg, timeout_s=self.hop_timeout_s)
            if ledger is not None:
                ledger[0].add(receipts.refill_item(msg))

    # ---- shadows: warm spares that follow a session live ------------------------------------------

    async def open_shadows(self, session: str, max_len: int, sampling: dict | None = None,
                           wire_dtype: str | None = None, job: dict | None = None) -> dict[int, Link]:
        """Open ``session`` as a shadow at the warm spare in ``shadows`` for each ring position that
        has one (``shadow: true``: no successor, it only fills its KV cache from the refill frames
        its predecessor mirrors). A shadow that cannot be reached or refuses is left out (logged);
        the session never fails for it.

        Returns:
            ring position -> the shadow's link, for the positions shadowed in this session.
        """
        opened: dict[int, Link] = {}
        n = len(self.links)
        for i, ring_link in enumerate(self.links):
            layers = tuple(ring_link.info.layers)
            link = self.shadows.get(layers)
            if link is None:
                continue
            if link.generation in self.net.lost_gens:
                log.warning("shadow.lost layers=[%d, %d) peer=%s: its connection ended", *layers, link.info.peer_id)
                del self.shadows[layers]
                continue
            extra = {"layers": list(layers), "shadow": True}
            if sampling and i == n - 1:
                extra["sampling"] = sampling
            if job is not None:
                extra["job"] = job
            if wire_dtype and i < n - 1:
                extra["wire_dtype"] = wire_dtype
            if self.batch:
                extra["batch"] = True
            prev = self.links[i - 1].info.peer_id if i > 0 else None
            msg = wire.open_frame(self.host.key_pair, session, None, max_len, prev=prev, **extra)
            try:
                await link.data.send(msg, timeout_s=SHADOW_TIMEOUT_S)
                await self.net.expect_from(link, OpenOk, session, SHADOW_TIMEOUT_S)
            except SwarmError as exc:
                log.warning("shadow.refused layers=[%d, %d) peer=%s reason=%s: the session runs without it",
                            *layers, link.info.peer_id, exc)
                continue
            opened[i] = link
        if opened:
            self.shadowed[session] = {tuple(self.links[i].info.layers): link for i, link in opened.items()}
            log.info("shadow.opened session=%s positions=%s", session, sorted(opened))
        return opened

    def start_head_mirror(self, session: str, link: Link) -> None:
        """Mirror the token ids sent to the head to its shadow ``link`` (``swarm.mirror.Mirror``, in
        this client's nursery, writing on the shadow's data stream)."""
        from swarm.mirror import Mirror

        mirror = Mirror(session, link.spec.addr, link.info.layers[1])
        self.head_mirrors[session] = mirror

        async def dial(_addr):
            return link.data

        self.net.nursery.start_soon(mirror.run, dial, lambda: self.head_mirrors.get(session) is mirror, None, None,
                                 False)

    def post_to_head_shadow(self, session: str, epoch: int, pos: int, tokens: list[int]) -> None:
        """Mirror the token ids just sent to the head to its shadow, if ``session`` has one (the
        mirror's own bounded queue: a slow shadow never slows the session)."""
        mirror = self.head_mirrors.get(session)
        if mirror is not None:
            mirror.post(epoch, pos, tokens=tokens)

    async def forget(self, session: str, timeout_s: float) -> None:
        """``session`` ended: drop its head mirror and close it at its shadows (best effort, each
        within ``timeout_s``). Never raises."""
        mirror = self.head_mirrors.pop(session, None)
        if mirror is not None:
            mirror.drop("the session ended", quiet=True)
        for link in self.shadowed.pop(session, {}).values():
            if link.generation not in self.net.lost_gens:
                with trio.move_on_after(timeout_s):
                    try:
                        await link.data.send(Close(session=session), timeout_s=timeout_s)
                    except SwarmError:
                        pass

    async def shadow_state(self, session: str, link: Link, timeout_s: float) -> str:
        """Whether the shadow ``link`` can take over: ``"shadow"`` (it answers a progress probe within
        ``timeout_s`` and holds ``session``), ``"spare"`` (it answers but dropped the session, e.g.
        it fell too far behind: a plain spare for the refill path) or ``"lost"`` (frozen or gone)."""
        if link.generation in self.net.lost_gens:
            return "lost"
        try:
            await link.control.send(Progress(session=session), timeout_s=timeout_s)
            msg = await self.net.expect_from(link, ProgressOk, session, timeout_s)
        except SwarmError as exc:
            log.warning("shadow.unusable peer=%s reason=%s", link.info.peer_id, exc)
            return "lost"
        if not msg.known:
            log.warning("shadow.session_lost peer=%s session=%s: it answers, so it is refilled as a plain spare",
                        link.info.peer_id, session)
            return "spare"
        return "shadow"

    async def _shadow_fallback(self, session: str, index: int, why: str, epoch: int, keep: int, until: int,
                               max_len: int, sampling, wire_dtype, job) -> None:
        """The shadow at ``index`` cannot be promoted (its mirror was dropped): open the session afresh
        there, and for a middle or tail position ask the predecessor again, without ``mirror``, to
        resend all ``keep`` positions (its answer is read by the caller)."""
        log.warning("heal.shadow_fallback stage=%d reason=%s: refilling the spare from scratch", index, why)
        self.last_repair.update(mode="survivors_kept", shadow_fallback=why)
        await self.open_at([index], session, max_len, sampling, wire_dtype, job)
        if index > 0:
            await self.links[index - 1].data.send(wire.repair_frame(
                self.host.key_pair, session, epoch, next_addr=self.links[index].spec.addr, resend=keep, until=until),
                timeout_s=self.hop_timeout_s)

    def swap(self, index: int, links, count: int = 1) -> list[str]:
        """Put a prepared spare (a ``Link``), or a chain of them tiling the same layers, at ring
        positions ``[index, index + count)`` (``count`` > 1: a re-routed window, ``RingOps.pick_wider``);
        the old connections' frames are ignored from then on, and the stages after it move along
        the ring by ``len(chain) - count``.

        Returns:
            The PeerIds now at the replaced positions, in ring order.
        Raises:
            ConfigError: the chain does not tile exactly the layers of the positions it replaces.
        """
        chain = [links] if isinstance(links, Link) else list(links)
        old = self.links[index:index + count]
        want = (old[0].info.layers[0], old[-1].info.layers[1])
        spans = [link.info.layers for link in chain]
        if not chain or len(old) != count or spans[0][0] != want[0] or spans[-1][1] != want[1] or any(
                a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise ConfigError(f"internal: replacement layers {spans} do not tile the replaced stages' {list(want)}")
        self.links[index:index + count] = chain
        for i, link in enumerate(self.links):  # positions after a chain moved
            if link.info.index != i:
                link.info = replace(link.info, index=i)
        log.info("ring.swap index=%d count=%d layers=%s old=%s new=%s", index, count, list(want),
                 ",".join(link.info.peer_id for link in old), ",".join(link.info.peer_id for link in chain))
        return [link.info.peer_id for link in chain]

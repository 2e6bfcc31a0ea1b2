"""``RingOps``: the ring-side operations a heal runs (``swarm.heal.SwarmOps`` over a ``RingClient``).

Owns: probing the stages, picking a replacement (a warm spare, a shadow, a chain of stages, a
holder found on the DHT, or a wider window of positions), swapping it in, keeping the survivors'
session or resetting and replaying it, and the record of who was replaced.
"""

from __future__ import annotations

import logging
import time
import uuid

import trio

from swarm.errors import ConfigError
from swarm.heal import NO_WARM_SPARE, Kept, StageReport
from swarm.coordinator.books import Generation
from swarm.coordinator.ring import RingClient
from swarm.coordinator.spec import SpecLoop
from swarm.ranges import LayerRange
from swarm.routing import NoRoute

log = logging.getLogger(__name__)


class RingOps:
    """``swarm.heal.SwarmOps`` over a RingClient and the generation's SpecLoop."""

    def __init__(self, ring: RingClient, loop: SpecLoop, gen: Generation):
        self.ring, self.loop, self.gen = ring, loop, gen
        self._spares: dict = {}
        self._replaced = ""  # PeerId the last swap replaced
        self._shadow = ""  # name of the picked spare when it is this session's shadow of the lost stage
        self._shadow_note = ""  # why a shadow of the lost stage was not healed onto
        self._refusing: set[str] = set()  # PeerIds a probe found draining without the session: never a spare
        self._windows: dict[str, tuple[int, int]] = {}  # picked re-routed window -> (lost position, positions)
        self._window = 1  # ring positions the last swap replaced

    def now(self) -> float:
        return time.monotonic()

    def range_of(self, index: int) -> tuple[int, int]:
        return self.ring.links[index].info.layers

    @property
    def no_spare(self) -> str:
        """The end of the "is lost" message when ``pick_spare`` found nothing (``heal.run_heal``)."""
        if self.ring.discovery is not None:
            return "no warm spare or stage announcing on the swarm can take over that range now"
        return NO_WARM_SPARE

    async def probe(self) -> tuple[list[StageReport], int, int]:
        session = self.gen.session
        reports = await self.ring.probe(session)
        self._refusing |= {self.peer_of(r.index) for r in reports if r.refusing}
        book = self.ring.books.get(session)
        return reports, self.loop.sent_chunk, -1 if book is None else book.returned

    async def settle(self) -> None:
        await trio.sleep(self.ring.heartbeat_s)

    async def pick_spare(self, layers: tuple[int, int]):
        index = next(i for i, info in enumerate(self.ring.infos) if info.layers == tuple(layers))
        ring, session = self.ring, self.gen.session
        shadow = ring.repair.take_shadow(session, layers)
        if shadow is not None:  # the spare that shadowed this stage, if it still answers
            state = await ring.repair.shadow_state(session, shadow, 2 * ring.heartbeat_s)
            if state != "lost":
                name = shadow.info.peer_id
                self._shadow = name if state == "shadow" else ""
                if state == "spare":
                    self._shadow_note = f"the shadow {name} no longer held the session"
                self._spares[name] = [shadow]
                return name
            log.warning("heal.shadow_unusable layers=[%d, %d) peer=%s: looking for another spare", *layers,
                        shadow.info.peer_id)
            self._shadow_note = f"the shadow {shadow.info.peer_id} did not answer"
            await ring.repair.drop([shadow])
        link = await self.ring.repair.prepare_spare(index, layers)
        chain = [link] if link is not None else None
        if chain is None and self.ring.discovery is not None:
            chain = await self._spare_from_swarm(index, tuple(layers))
        if not chain:
            return None
        name = "+".join(link.info.peer_id for link in chain)
        self._spares[name] = chain
        return name

    async def pick_wider(self, index: int):
        """``heal.SwarmOps.pick_wider``: the smallest window of ring positions around the lost stage at
        ``index`` whose layers stages from the DHT can take over, the window's surviving stages allowed
        (the lost layers' only other holder may sit in the ring next to it, holding more than its
        position uses: it takes both positions over). Windows are tried from two positions up to the
        whole ring, those starting earlier first. Only for a ring routed over the DHT.

        Returns:
            ``(first, count, name)``: ``name`` (``swap``'s spare) takes over positions ``[first, first +
            count)``; None when no window can be re-routed.
        """
        if self.ring.discovery is None:
            return None
        infos = self.ring.infos
        n = len(infos)
        for count in range(2, n + 1):
            for first in range(max(0, index - count + 1), min(index, n - count) + 1):
                last = first + count - 1
                layers = (infos[first].layers[0], infos[last].layers[1])
                chain = await self._spare_from_swarm(first, layers, last=last, lost=index)
                if chain:
                    name = "+".join(link.info.peer_id for link in chain)
                    self._spares[name] = chain
                    self._windows[name] = (index, count)
                    log.warning("heal.rerouted lost=%d window=[%d, %d) layers=[%d, %d) hops=%s: no stage outside the "
                                "ring holds the lost layers", index, first, first + count, *layers,
                                [(link.info.peer_id[-8:], link.info.layers) for link in chain])
                    return first, count, name
        return None

    async def _spare_from_swarm(self, index: int, layers: tuple[int, int], *, last: int | None = None,
                                lost: int | None = None):
        """Links to the stages from the DHT that take over ``layers`` (of ring positions ``[index, last]``,
        ``last`` = ``index`` by default): usually one holder whose block contains them, else a chain of
        holders tiling them (``swarm.routing.plan_replacement``). Every stage of the ring outside those
        positions and every shadow is excluded, so none runs two positions of one session; a chain
        with a stage that cannot be dialed is dropped whole. None when nothing covers ``layers``. The lost
        stage's own PeerId (the one at ``lost``, = ``index`` by default) is allowed only while nothing is
        committed (a heal at the open or during the prefill, which replays on a fresh session): a volunteer
        who restarted a crashed stage under the same key, on a new address, then serves again; its fresh
        record names that address. The other stages of a window (``pick_wider``) are allowed. A stage a
        probe found draining (it refused the session) is never taken: its record read at routing time may
        still say online."""
        from swarm.config import StageSpec
        from swarm.coordinator.measured import load_measured
        from swarm.discovery.client import find_replacement

        route = self.ring.discovery  # the records and client RTTs read when routing
        dht, model_id = route.dht, route.model_id
        infos = self.ring.infos
        last = index if last is None else last
        lost = index if lost is None else lost
        fresh_session = self.loop.committed_len - 1 < self.loop.prompt_len  # the replay opens a new session
        try:
            hops = await find_replacement(
                dht, model_id, layers, prev_peer=infos[index - 1].peer_id if index > 0 else None,
                next_peer=infos[last + 1].peer_id if last + 1 < len(infos) else None,
                exclude=frozenset(i.peer_id for j, i in enumerate(infos)
                                  if not index <= j <= last or (j == lost and not fresh_session))
                | self.ring.repair.shadow_peers() | self._refusing,
                context_tokens=self.gen.max_len,
                known=route.records, known_rtt_ms=route.client_rtt_ms,
                shut_out=self.ring.shut_out, measured_layer_ms=load_measured(model_id))
        except NoRoute as exc:
            log.warning("heal.no_replacement layers=[%d, %d) reason=%s", *layers, exc)
            return None
        chain = []
        for hop in hops:
            link = await self.ring.repair.prepare_spare(index + len(chain), hop.layers,
                                                 spec=StageSpec(addr=hop.addr, layers=LayerRange(*hop.layers)))
            if link is None:
                await self.ring.repair.drop(chain)
                return None
            chain.append(link)
        if len(chain) > 1:
            log.info("heal.chain layers=[%d, %d) hops=%s", *layers,
                     [(link.info.peer_id[-8:], link.info.layers) for link in chain])
        return chain

    async def swap(self, index: int, spare) -> list[str]:
        lost, self._window = self._windows.pop(spare, (index, 1))
        self._replaced = self.peer_of(lost)
        self._shadow = spare if spare == self._shadow else ""
        old = self.ring.links[index:index + self._window]
        ids = self.ring.repair.swap(index, self._spares.pop(spare), self._window)
        # a re-routed window's surviving stages leave the ring: closing their streams ends this
        # session there (a stage drops the sessions of a stream that closes)
        await self.ring.repair.drop([link for link in old if link.info.peer_id != self._replaced])
        return ids

    async def prepare_shadows(self) -> int:
        """Find a warm spare for every ring position that has none shadowing it yet (the ring file's
        spares, then the DHT's holders when the ring was routed there: one stage holding the whole
        range), dial and check it; ``RingRepair`` keeps them for the sessions to come. Returns how many
        positions have a shadow."""
        repair = self.ring.repair
        for index, info in enumerate(self.ring.infos):
            layers = tuple(info.layers)
            if repair.has_shadow(layers):
                continue
            link = await repair.try_spare(index, layers)  # one that cannot be reached now is tried at a heal
            if link is None and self.ring.discovery is not None:
                chain = await self._spare_from_swarm(index, layers)
                if chain and len(chain) > 1:  # a chain cannot shadow one stage: it stays unused
                    await repair.drop(chain)
                link = chain[0] if chain and len(chain) == 1 else None
            if link is not None:
                repair.keep_shadow(layers, link)
                log.info("shadow.ready layers=[%d, %d) peer=%s", *layers, link.info.peer_id)
        return sum(repair.has_shadow(tuple(i.layers)) for i in self.ring.infos)

    def peer_of(self, index: int) -> str:
        return self.ring.links[index].info.peer_id

    async def repair(self, index: int, count: int, replay) -> str | None:
        """Keep the session at the survivors (``RingRepair.repair_session``): the replacement at
        ``[index, index + count)`` rebuilds positions ``[0, len(prefix) - 1)`` alone, the last one
        goes round the ring in :meth:`resume`. Returns None, or why not (logged; a full replay follows)."""
        loop, session = self.loop, self.gen.session
        if list(replay.prefix) != loop.seq[: len(replay.prefix)] or len(replay.prefix) != loop.committed_len - 1:
            raise ConfigError("internal: the replay plan and the generation state disagree")
        if self._window > 1:
            why = (f"the replacement took over {self._window} ring positions (no stage outside the ring held the lost "
                   "layers): the survivors' caches do not match the new ring")
            log.warning("heal.fallback stage=%d reason=%s: replaying in full on a fresh session", index, why)
            return why
        keep = loop.resume()
        why = await self.ring.repair.repair_session(
            session, index, count, epoch=loop.epoch, keep=keep, tokens=loop.seq[:keep],
            replaced=self._replaced, max_len=self.gen.max_len,
            sampling=self.gen.sampling, wire_dtype=self.gen.wire_dtype, job=self.gen.job,
            shadow=bool(self._shadow))
        if why is not None:
            log.warning("heal.fallback stage=%d reason=%s: replaying in full on a fresh session", index, why)
            return why
        done = self.ring.repair.last_repair
        log.info("heal.kept stage=%d kept_positions=%d mode=%s refilled=%d: survivors keep their KV caches", index,
                 keep, done["mode"], done["refill_tokens"])
        return Kept(done["mode"], done["refill_tokens"], done["shadow_fallback"] or self._shadow_note)

    async def resume(self) -> int | None:
        loop, session = self.loop, self.gen.session
        while loop.replay_token is None:
            for chunk in loop.next_chunks():
                await self.ring.send_chunk(session, chunk)
            msg = await self.ring.next_result(session)
            loop.on_result(msg.chunk, msg.epoch, msg.token_ids)
        return loop.replay_token

    async def reset(self) -> None:
        with trio.move_on_after(2.0):  # survivors drop the broken session; the lost stage cannot
            await self.ring.close_session(self.gen.session, timeout_s=1.0)
        self.gen.session = uuid.uuid4().hex
        await self.ring.open_session(self.gen.session, self.gen.max_len, self.gen.sampling,
                                     self.gen.wire_dtype, job=self.gen.job,
                                     prefix_ids=[] if self.gen.prefix_cache else None,
                                     prefix_salt=self.gen.prefix_salt or "")

    async def replay(self, prefix) -> int | None:
        loop = self.loop
        loop.restart()
        if len(prefix) != loop.prefill_end or list(prefix) != loop.seq[: len(prefix)]:
            raise ConfigError("internal: the replay plan and the generation state disagree")
        if loop.committed_len - 1 < loop.prompt_len:
            return None  # nothing committed yet: the prefill simply runs again
        return await self.resume()

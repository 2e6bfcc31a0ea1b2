"""Heal support on the coordinator's side: progress probes, warm spares, swapping a link.

Owns: ``probe`` (every stage asked for its progress on a session over the control streams, in
parallel; a stage whose stream is gone or that stays silent is reported unreachable, as the
``swarm.heal.StageReport`` the pure heal logic reads), ``prepare_spare`` (dial and check an unused
spare of the ring file holding a range) and ``swap`` (put it, or a chain of stages tiling the same
layers, at a ring position; frames of the replaced connection are ignored from then on). The
heartbeats that call ``probe`` while waiting for a result live in
:meth:`swarm.ring.client.RingClient.next_result`.

``ProbeMixin`` is mixed into :class:`swarm.ring.client.RingClient`; it uses ``links``, ``spares``,
``heartbeat_s``, the channel and ``_link`` / ``_where`` (:mod:`swarm.ring.links`). May import:
trio, ``swarm.wire``, ``swarm.heal``, ``swarm.ranges``, ``swarm.errors``,
``swarm.transport.circuit`` (address helpers).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import trio

from swarm import wire
from swarm.errors import ConfigError, StageLost, SwarmError
from swarm.heal import StageReport
from swarm.ranges import LayerRange
from swarm.transport.circuit import is_circuit
from swarm.ring.links import _Link

log = logging.getLogger(__name__)

RELAYED_SPARE_WAIT_S = 5.0  # how long a relayed spare that cannot be reached is tried again, in seconds


class ProbeMixin:
    """Probes, spares and swaps (see the module docstring)."""

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
                index = self._where(g)
                if index is None:
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

    async def prepare_spare(self, index: int, layers: tuple[int, int], spec=None) -> _Link | None:
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

    async def _dial_spare(self, index: int, spec) -> _Link | None:
        deadline = trio.current_time() + (RELAYED_SPARE_WAIT_S if is_circuit(spec.addr) else 0.0)
        while True:
            try:
                return await self._link(index, spec)
            except StageLost as exc:  # unreachable: a relayed one may be reserving again
                if trio.current_time() >= deadline:
                    log.warning("spare.unusable addr=%s reason=%s", spec.addr, exc)
                    return None
                log.info("spare.retry addr=%s reason=%s", spec.addr, exc)
                await trio.sleep(0.25)
            except SwarmError as exc:
                log.warning("spare.unusable addr=%s reason=%s", spec.addr, exc)
                return None

    async def drop_links(self, links) -> None:
        """Close the streams of ``links`` (e.g. a prepared chain that fell apart). Never raises."""
        with trio.CancelScope(shield=True):
            for link in links:
                for stream in (link.data, link.control):
                    with trio.move_on_after(1.0):
                        await stream.aclose()

    def swap(self, index: int, links) -> list[str]:
        """Put a prepared spare (a ``_Link``), or a chain of them tiling the same layers, at ring
        position ``index``; the old connection's frames are ignored from then on, and the stages
        after it move down the ring by ``len(chain) - 1``.

        Returns:
            The PeerIds now at the replaced position, in ring order.
        Raises:
            ConfigError: the chain does not tile exactly the layers of the stage it replaces.
        """
        chain = [links] if isinstance(links, _Link) else list(links)
        old = self.links[index]
        spans = [link.info.layers for link in chain]
        if not chain or spans[0][0] != old.info.layers[0] or spans[-1][1] != old.info.layers[1] or any(
                a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise ConfigError(f"internal: replacement layers {spans} do not tile the lost stage's {old.info.layers}")
        self.links[index:index + 1] = chain
        for i, link in enumerate(self.links):  # positions after a chain moved
            if link.info.index != i:
                link.info = replace(link.info, index=i)
        log.info("ring.swap index=%d layers=%s old=%s new=%s", index, old.info.layers, old.info.peer_id,
                 ",".join(link.info.peer_id for link in chain))
        return [link.info.peer_id for link in chain]

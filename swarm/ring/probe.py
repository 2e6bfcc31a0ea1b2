"""Heal support on the coordinator's side: progress probes, warm spares, swapping a link.

Owns: ``probe`` (every stage asked for its progress on a session over the control streams, in
parallel; a stage whose stream is gone or that stays silent is reported unreachable, as the
``swarm.heal.StageReport`` the pure heal logic reads), ``prepare_spare`` (dial and check the first
unused spare of the ring file holding a range) and ``swap`` (put it at a ring position; frames of
the replaced connection are ignored from then on). The heartbeats that call ``probe`` while waiting
for a result live in :meth:`swarm.ring.client.RingClient.next_result`.

``ProbeMixin`` is mixed into :class:`swarm.ring.client.RingClient`; it uses ``links``, ``spares``,
``heartbeat_s``, the channel and ``_link`` / ``_current`` (:mod:`swarm.ring.links`). May import:
trio, ``swarm.wire``, ``swarm.heal``, ``swarm.errors``.
"""

from __future__ import annotations

import logging

import trio

from swarm import wire
from swarm.errors import SwarmError
from swarm.heal import StageReport
from swarm.ring.links import _Link

log = logging.getLogger(__name__)


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

    async def prepare_spare(self, index: int, layers: tuple[int, int], spec=None) -> _Link | None:
        """Dial the first unused spare holding ``layers`` and check it; None if there is none.
        Spares that fail the dial or the check are dropped from the list. With ``spec`` (a
        StageSpec found elsewhere, e.g. on the DHT) dial exactly that stage instead."""
        if spec is not None:
            try:
                return await self._link(index, spec)
            except SwarmError as exc:
                log.warning("spare.unusable addr=%s reason=%s", spec.addr, exc)
                return None
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

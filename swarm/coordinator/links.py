"""The coordinator's links to the stages of a ring: dialing, the info check, the frames they send.

Owns: ``StageInfo`` (what a stage reported about itself), ``_Link`` (the two streams to one stage:
data for forward frames, session replies and the tail's results; control for cancel and progress
probes, so they overtake queued data), dialing a stage and checking its ``info`` against the ring
file (range, model, PeerId; the ranges tile ``[0, L)``), one reader task per stream funnelling
``(stage, generation, frame)`` into one channel, and receiving from it (a frame's stage is where
its connection sits in the ring now): frames of replaced connections are dropped, a closed stream
or an error frame is raised as ``StageLost`` or ``RemoteError`` naming the stage.

``LinksMixin`` is mixed into :class:`swarm.coordinator.ring.RingClient`, which sets up the state it uses
(``host``, ``ring``, timeouts, ``links``, the channel, generations, ``ledgers``); ``connect``
replaces an unreachable stage through ``prepare_spare`` (:mod:`swarm.coordinator.probe`). May import:
trio, ``swarm.transport`` (through the host), ``swarm.wire``, ``swarm.receipts``, ``swarm.config``,
``swarm.ranges``, ``swarm.errors``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from swarm import receipts, wire
from swarm.config import RingSpec, StageSpec
from swarm.errors import ConfigError, HopTimeout, ProtocolError, RemoteError, StageLost, StreamClosed, SwarmError
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
    block: tuple[int, int] | None = None  # the stage's whole block; ``layers`` is the part this ring runs

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


class LinksMixin:
    """Dialing, checking and reading the links to every stage (see the module docstring)."""

    # ---- views ----------------------------------------------------------------------------------

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

    # ---- connecting -----------------------------------------------------------------------------

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
        """Close every stream to the ring and its shadows (a stage drops the sessions they opened). Never raises."""
        await self.drop_links(self.links + list(self.shadows.values()))

    def healed_ring(self) -> RingSpec:
        """The ring as it stands now (after any heal) and the spares not used yet."""
        return RingSpec(model=self.ring.model, stages=tuple(self.stage_specs),
                        spares=tuple(self.spares) + tuple(link.spec for link in self.shadows.values()))

    async def stage_info(self, index: int) -> dict:
        """Stage ``index``'s ``info_ok`` frame now (its load, kernels and ``hops``, docs/protocol.md).

        Only between sessions: frames of a running session that arrive meanwhile are dropped.

        Raises:
            StageLost / HopTimeout: the stage does not answer.
        """
        link = self.links[index]
        await link.control.send(wire.frame("info"), timeout_s=self.hop_timeout_s)
        return await self._expect(index, "info_ok", gen=link.generation)

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
        if not got[0] <= spec.layers.start < spec.layers.end <= got[1]:  # a stage serves any sub-range of its block
            raise ConfigError(f"stage {index} at {spec.addr} serves layers [{got[0]}, {got[1]}) but the ring file "
                              f"says {spec.layers}")
        if msg["num_layers"] != self._num_layers or msg["model_digest"] != self._model_digest:
            raise ConfigError(f"stage {index} at {spec.addr} serves model {msg['model']!r} "
                              f"({msg['num_layers']} layers, digest {msg['model_digest'][:12]}) but the ring file "
                              f"names {self.ring.model!r} ({self._num_layers} layers, digest {self._model_digest[:12]})")
        if msg["peer_id"] != spec.peer_id:
            raise ConfigError(f"stage {index} at {spec.addr} answered as PeerId {msg['peer_id']}")
        if self.model_id is not None and msg.get("model_id") != self.model_id:
            raise ConfigError(f"stage {index} at {spec.addr} runs other weights (model id "
                              f"{str(msg.get('model_id'))[:16]}, expected {self.model_id[:16]})")
        kernels = msg.get("kernels")
        info = StageInfo(index, spec.addr, msg["peer_id"], (spec.layers.start, spec.layers.end), msg["model"],
                         msg["model_digest"], msg["max_ctx"], msg["dtype"],
                         rows_proven=not isinstance(kernels, dict) or kernels.get("rows_ok") is not False, block=got)
        return _Link(spec, streams[0], streams[1], info, gen)

    async def _pump(self, index: int, gen: int, stream) -> None:
        while True:
            try:
                msg = await stream.recv()
            except (StreamClosed, ProtocolError) as exc:
                self._lost_gens.add(gen)
                await self._send_ch.send((index, gen, {"type": "_lost", "reason": str(exc)}))
                return
            if msg.get("type") == "result" and self._where(gen) == len(self.links) - 1:
                ledger = self.ledgers.get(msg.get("session"))
                if ledger is not None:  # every result the tail sent, in order, also stale ones
                    try:
                        ledger[1].add(receipts.result_item(msg))
                    except KeyError:
                        pass  # malformed: next_result's validation reports it
            await self._send_ch.send((index, gen, msg))

    # ---- receiving ------------------------------------------------------------------------------

    def _where(self, gen: int) -> int | None:
        """The ring position of the connection ``gen`` now (positions move when a chain of stages
        replaces one), or None when it is not part of the ring (replaced, or still being set up)."""
        return next((i for i, link in enumerate(self.links) if link.generation == gen), None)

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
                    where = self._where(g)
                    if gen is not None:
                        if g == gen:
                            return index if where is None else where, msg
                        if where is not None:
                            kept.append(item)
                    elif where is not None:
                        return where, msg
        finally:
            self._deferred.extendleft(reversed(kept))
        raise HopTimeout(f"no answer from the ring within {timeout_s:.1f} s")

    def _stage_spec(self, index: int):
        """The StageSpec at ring position ``index``: its link's, else the ring file's; None when a
        heal's chain put more stages at work than the ring listed (``index`` past both)."""
        if index < len(self.links):
            return self.links[index].spec
        return self.ring.stages[index] if index < len(self.ring.stages) else None

    def _raise_for(self, index: int, msg: dict, session: str | None = None) -> None:
        if msg.get("type") not in ("_lost", "error"):
            return
        spec = self._stage_spec(index)
        name = f"stage {index} {spec.layers}" if spec is not None else f"stage {index} (of a replacement chain)"
        if msg.get("type") == "_lost":
            raise StageLost(f"{name} at {spec.addr if spec else '?'} closed the connection: {msg['reason']}")
        if msg.get("type") == "error" and msg.get("session") not in (None, session):
            log.debug("error.ignored stage=%d session=%s (an earlier session)", index, msg.get("session"))
            return
        if msg.get("type") == "error" and isinstance(msg.get("epoch"), int) and \
                msg["epoch"] < self.repaired_epoch.get(session or "", -1):
            log.debug("error.ignored stage=%d session=%s epoch=%d (before the heal that repaired it): %s", index,
                      session, msg["epoch"], msg.get("reason"))
            return
        if msg.get("type") == "error":
            exc = StageLost if msg.get("code") == "unavailable" else RemoteError
            raise exc(f"{name} refused: {msg.get('reason')}")

    async def _expect(self, index: int, kind: str, session: str | None = None, gen: int | None = None) -> dict:
        while True:
            i, msg = await self._next(self.hop_timeout_s, gen)
            self._raise_for(i, msg, session)
            if i == index and msg.get("type") == kind and (session is None or msg.get("session") == session):
                return wire.validate(msg)
            log.debug("frame.ignored stage=%d type=%s", i, msg.get("type"))

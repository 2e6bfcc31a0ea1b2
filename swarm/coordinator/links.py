"""The coordinator's links to the stages of a ring: dialing, the info check, the frames they send.

Owns: ``StageInfo`` (what a stage reported), ``Link`` (its data and control streams) and ``RingLinks`` (the links
in ring order: dialing and the ``info`` check, one reader task per stream into one channel, receiving, faults
raised as ``StageLost`` or ``RemoteError``, and ``probe``); composed into ``RingClient`` as ``net``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import TypeVar

import trio

from swarm import wire
from swarm.addrs import current_addr
from swarm.config import RingSpec, StageSpec
from swarm.errors import ConfigError, HopTimeout, ProtocolError, RemoteError, StageLost, StreamClosed, SwarmError
from swarm.frames import Error, Frame, Incoming, Info, InfoOk, LinkLost, Progress, ProgressOk, Result
from swarm.heal import StageReport
from swarm.wire import PROTOCOL_ID

F = TypeVar("F", bound=Frame)

log = logging.getLogger(__name__)


def _connected_at(stream, addr: str) -> bool:
    """Whether ``stream``'s connection goes to ``addr``'s own host and TCP port: then the dialed address
    is where the stage is reached (a link emulation relay, a forwarded port) and is handed on as it is;
    a connection to another port is one this node already had (the stage restarted elsewhere)."""
    try:
        remote = stream.raw.get_remote_address()
    except Exception:  # a transport that does not say (circuits, test doubles)
        return False
    parts = addr.split("/")
    try:
        dialed = (parts[parts.index("ip4") + 1], int(parts[parts.index("tcp") + 1]))
    except (ValueError, IndexError):
        return False
    return remote is not None and (str(remote[0]), int(remote[1])) == dialed


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
class Link:
    """The coordinator's two streams to one stage: ``data`` (forward frames, session replies, the
    tail's results) and ``control`` (cancel, progress probes), its ``info``, and the ``generation``
    that tags the frames its reader tasks deliver."""

    spec: StageSpec
    data: object
    control: object
    info: StageInfo
    generation: int


class RingLinks:
    """The links to every stage of one ring, in ring order, and the one channel their frames arrive on.

    Args:
        host: a running SwarmHost (dials the stages). ring: the ring file.
        hop_timeout_s: longest wait for one answer of a stage. connect_timeout_s: deadline for a dial.
        model_id: when set (routes from the DHT), every stage must report this weights id.
        on_tail_result: called with every ``result`` frame the current tail sends (also stale ones),
            before it is queued (the client's receipt ledger).
        repaired_epoch: a session's epoch at its last repair (-1: none): error frames of older
            epochs are stale and ignored.
    """

    def __init__(self, host, ring: RingSpec, *, hop_timeout_s: float, connect_timeout_s: float,
                 model_id: str | None = None, on_tail_result=None, repaired_epoch=None):
        self.host = host
        self.ring = ring
        self.hop_timeout_s = hop_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.model_id = model_id
        self.on_tail_result = on_tail_result or (lambda msg: None)
        self.repaired_epoch = repaired_epoch or (lambda session: -1)
        self.links: list[Link] = []
        self.lost_gens: set[int] = set()  # connections whose stream ended (a shadow's is not in the ring)
        self.num_layers = 0
        self.model_digest = ""
        self.nursery = None  # runs the reader tasks (and the client's head mirrors); set by ``start``
        self._generation = 0
        self._deferred: deque = deque()
        self._send_ch, self._recv_ch = trio.open_memory_channel(1024)

    # ---- views ----------------------------------------------------------------------------------

    @property
    def infos(self) -> list[StageInfo]:
        return [link.info for link in self.links]

    @property
    def stage_specs(self) -> list[StageSpec]:
        return [link.spec for link in self.links]

    # ---- connecting -----------------------------------------------------------------------------

    def start(self, num_layers: int, model_digest: str, nursery) -> None:
        """Set what every stage must report (``num_layers``, the model's manifest digest) and the
        nursery the reader tasks run in; before the first ``dial``."""
        self.num_layers, self.model_digest, self.nursery = num_layers, model_digest, nursery

    async def drop(self, links) -> None:
        """Close the streams of ``links`` (e.g. a prepared chain that fell apart). Never raises."""
        with trio.CancelScope(shield=True):
            for link in links:
                for stream in (link.data, link.control):
                    with trio.move_on_after(1.0):
                        await stream.aclose()

    async def stage_info(self, index: int) -> InfoOk:
        """Stage ``index``'s ``info_ok`` frame now (its load, kernels and ``hops``, docs/protocol.md).

        Only between sessions: frames of a running session that arrive meanwhile are dropped.

        Raises:
            StageLost / HopTimeout: the stage does not answer.
        """
        link = self.links[index]
        await link.control.send(Info(), timeout_s=self.hop_timeout_s)
        return await self.expect(index, InfoOk, gen=link.generation)

    async def dial(self, index: int, spec: StageSpec) -> Link:
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
            self.nursery.start_soon(self._pump, index, gen, stream)
        # one request in flight at a time: expect keeps frames that answer something else
        await streams[0].send(Info(), timeout_s=self.hop_timeout_s)
        msg = await self.expect(index, InfoOk, gen=gen)
        got = tuple(msg.layers)
        if not got[0] <= spec.layers.start < spec.layers.end <= got[1]:  # a stage serves any sub-range of its block
            raise ConfigError(f"stage {index} at {spec.addr} serves layers [{got[0]}, {got[1]}) but the ring file "
                              f"says {spec.layers}")
        if msg.num_layers != self.num_layers or msg.model_digest != self.model_digest:
            raise ConfigError(f"stage {index} at {spec.addr} serves model {msg.model!r} "
                              f"({msg.num_layers} layers, digest {msg.model_digest[:12]}) but the ring file "
                              f"names {self.ring.model!r} ({self.num_layers} layers, digest {self.model_digest[:12]})")
        if msg.peer_id != spec.peer_id:
            raise ConfigError(f"stage {index} at {spec.addr} answered as PeerId {msg.peer_id}")
        if self.model_id is not None and msg.model_id != self.model_id:
            raise ConfigError(f"stage {index} at {spec.addr} runs other weights (model id "
                              f"{str(msg.model_id)[:16]}, expected {self.model_id[:16]})")
        addrs = msg.addrs
        if isinstance(addrs, list) and all(isinstance(a, str) for a in addrs) and \
                not _connected_at(streams[0], spec.addr):
            moved = current_addr(spec.addr, addrs)
            if moved != spec.addr:  # restarted on a new port; the dial reused a connection to its new one
                log.warning("stage.moved index=%d peer=%s dialed=%s listens=%s: handing on its current address",
                            index, msg.peer_id, spec.addr, moved)
                spec = replace(spec, addr=moved)
        kernels = msg.kernels
        info = StageInfo(index, spec.addr, msg.peer_id, (spec.layers.start, spec.layers.end), msg.model,
                         msg.model_digest, msg.max_ctx, msg.dtype,
                         rows_proven=not isinstance(kernels, dict) or kernels.get("rows_ok") is not False, block=got)
        return Link(spec, streams[0], streams[1], info, gen)

    async def _pump(self, index: int, gen: int, stream) -> None:
        while True:
            try:
                msg = wire.validate(await stream.recv())
            except (StreamClosed, ProtocolError) as exc:  # a stage that sends a malformed frame is lost too
                self.lost_gens.add(gen)
                await self._send_ch.send((index, gen, LinkLost(str(exc))))
                return
            if isinstance(msg, Result) and self.where(gen) == len(self.links) - 1:
                self.on_tail_result(msg)  # every result the tail sent, in order, also stale ones
            await self._send_ch.send((index, gen, msg))

    # ---- receiving ------------------------------------------------------------------------------

    def where(self, gen: int) -> int | None:
        """The ring position of the connection ``gen`` now (positions move when a chain of stages
        replaces one), or None when it is not part of the ring (replaced, or still being set up)."""
        return next((i for i, link in enumerate(self.links) if link.generation == gen), None)

    async def next(self, timeout_s: float, gen: int | None = None) -> tuple[int, Incoming]:
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
                    where = self.where(g)
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

    def stage_spec(self, index: int):
        """The StageSpec at ring position ``index``: its link's, else the ring file's; None when a
        heal's chain put more stages at work than the ring listed (``index`` past both)."""
        if index < len(self.links):
            return self.links[index].spec
        return self.ring.stages[index] if index < len(self.ring.stages) else None

    def raise_for(self, index: int, msg: Incoming, session: str | None = None) -> None:
        """Raise what ``msg`` from stage ``index`` says went wrong: its stream closed (StageLost) or
        it answered an error for ``session`` (StageLost when ``unavailable``, else RemoteError);
        errors of other sessions or of epochs before the session's last repair are ignored."""
        if not isinstance(msg, (LinkLost, Error)):
            return
        spec = self.stage_spec(index)
        name = f"stage {index} {spec.layers}" if spec is not None else f"stage {index} (of a replacement chain)"
        if isinstance(msg, LinkLost):
            raise StageLost(f"{name} at {spec.addr if spec else '?'} closed the connection: {msg.reason}")
        if msg.session not in (None, session):
            log.debug("error.ignored stage=%d session=%s (an earlier session)", index, msg.session)
            return
        if msg.epoch is not None and msg.epoch < self.repaired_epoch(session or ""):
            log.debug("error.ignored stage=%d session=%s epoch=%d (before the heal that repaired it): %s", index,
                      session, msg.epoch, msg.reason)
            return
        exc = StageLost if msg.code == "unavailable" else RemoteError
        raise exc(f"{name} refused: {msg.reason}")

    async def expect(self, index: int, kind: type[F], session: str | None = None, gen: int | None = None) -> F:
        """The next frame of type ``kind`` (of ``session``, if given) from stage ``index``; with
        ``gen``, only that connection's frames are read (one being set up).

        Raises:
            StageLost / RemoteError (see ``raise_for``); HopTimeout: nothing within ``hop_timeout_s``.
        """
        while True:
            i, msg = await self.next(self.hop_timeout_s, gen)
            self.raise_for(i, msg, session)
            if i == index and isinstance(msg, kind) and (session is None or msg.session == session):
                return msg
            log.debug("frame.ignored stage=%d type=%s", i, msg.TYPE)

    async def expect_from(self, link: Link, kind: type[F], session: str, timeout_s: float) -> F:
        """The next ``kind`` frame of ``session`` from ``link`` (not necessarily in the ring), within
        ``timeout_s``; other frames of that connection are dropped, of others kept.

        Raises:
            HopTimeout; StageLost (its stream ended); RemoteError (it answered an error)."""
        deadline = trio.current_time() + timeout_s
        while True:
            _, msg = await self.next(max(0.0, deadline - trio.current_time()), link.generation)
            if isinstance(msg, LinkLost):
                raise StageLost(f"shadow {link.info.peer_id} closed the connection: {msg.reason}")
            if isinstance(msg, Error) and msg.session in (None, session):
                raise RemoteError(f"shadow {link.info.peer_id} refused: {msg.reason}")
            if isinstance(msg, kind) and msg.session == session:
                return msg
            if trio.current_time() >= deadline:
                raise HopTimeout(f"no {kind} from shadow {link.info.peer_id} within {timeout_s:.1f} s")

    async def probe(self, session: str, timeout_s: float) -> list[StageReport]:
        """Ask every stage for its progress on ``session`` (control streams, in parallel).

        A stage whose stream is gone, or that does not answer within ``timeout_s``, is unreachable.
        Frames that arrive meanwhile are kept for later.
        """
        lost: set[int] = set()
        replies: dict[int, ProgressOk] = {}
        for i, link in enumerate(self.links):
            try:
                await link.control.send(Progress(session=session), timeout_s=timeout_s)
            except SwarmError:
                lost.add(i)
        kept = []
        with trio.move_on_after(timeout_s):
            while len(lost) + len(replies) < len(self.links):
                if self._deferred:
                    index, g, msg = self._deferred.popleft()
                else:
                    index, g, msg = await self._recv_ch.receive()
                index = self.where(g)
                if index is None:
                    continue
                if isinstance(msg, ProgressOk) and msg.session == session:
                    replies[index] = msg
                else:
                    if isinstance(msg, LinkLost):
                        lost.add(index)
                    kept.append((index, g, msg))
        self._deferred.extend(kept)
        reports = []
        for i in range(len(self.links)):
            m = replies.get(i)
            if i in lost or m is None:  # gone: its stream failed; else silent (maybe paused)
                reports.append(StageReport(i, False, gone=i in lost))
            else:
                reports.append(StageReport(i, True, m.received, m.sent, bool(m.busy),
                                           refusing=bool(m.draining) and m.known is False,
                                           lost_successor=bool(m.lost_successor)))
        return reports

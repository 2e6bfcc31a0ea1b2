"""Heal decisions when a stage dies or freezes mid-generation. Pure: standard library only.

Owns: where the ring broke (``locate_failure``), what to replay (``plan_replay``) and the ordered heal steps
(``run_heal``) over an injected ``SwarmOps``; no clock (``ops.now()``), so tests run the steps under asyncio.
The steps and their source: docs/architecture.md, "Healing".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from swarm.errors import SwarmError

NO_WARM_SPARE = "no warm spare holds that range"  # how a NoSpare message ends unless ``ops.no_spare`` says more


class HealError(SwarmError):
    """The heal failed: no spare for the lost range, the replay disagreed, or too many failures."""


class NoSpare(HealError):
    """No warm spare holds the layer range of the failed stage."""


class ReplayMismatch(HealError):
    """Replaying the committed prefix did not reproduce the driver token: the output would diverge."""


@dataclass(frozen=True)
class StageReport:
    """What the coordinator learned about one stage of a session.

    Args:
        index: ring position. reachable: answered a probe before its deadline.
        received: highest chunk id the stage received for the session (-1: none).
        sent: highest chunk id it sent on (to its successor; the tail: as a result) (-1: none).
            Chunks it dropped as stale are received but never sent.
        busy: it holds a received chunk it has not finished (computing, or stuck).
        gone: unreachable because its connection closed (it cannot answer on it again), not
            merely silent; a silent stage may be paused and is re-checked before it is blamed.
        refusing: it answers but will never take the session: it is draining and does not hold it
            (it refused the open because it began to drain after the route was chosen).
        lost_successor: its stream to its successor failed (a send failed, or the peer or the
            connection under it went away, e.g. a relayed hop whose relay died), and no repair has
            named a new successor since: whatever it computes goes nowhere.
    """

    index: int
    reachable: bool
    received: int = -1
    sent: int = -1
    busy: bool = False
    gone: bool = False
    refusing: bool = False
    lost_successor: bool = False


@dataclass(frozen=True)
class Probe:
    """One probe of the ring: every stage's report, and the coordinator's highest chunk id sent
    and highest chunk id it got a result for."""

    reports: tuple[StageReport, ...]
    sent: int
    returned: int


@dataclass(frozen=True)
class Failure:
    """The stage to replace and why ("unreachable" or "stalled")."""

    index: int
    reason: str


def locate_failure(reports: Sequence[StageReport], sent: int, returned: int,
                   earlier: Probe | None = None) -> Failure | None:
    """The first unreachable stage, else the first stage that refuses the session (draining),
    else the first break in the chain of chunk progress.

    The chain is coordinator (``sent``) -> stage 0 -> ... -> tail -> coordinator (``returned``):
    a hop is broken where the upstream side sent a chunk the downstream side never received (the
    downstream stage is blamed: it stopped reading), where the upstream side says it lost its
    stream to the downstream one (the downstream stage is blamed: the coordinator still reaches
    the upstream one, which cannot reach it; a chunk that stage received then went nowhere, so no
    gap in the counters shows it), or where the tail sent a result the coordinator never got.
    Failing that, the first stage still busy with a chunk is stalled. Call it after a timeout, so
    "busy" means stuck rather than computing.

    With ``earlier`` (a probe taken a settling interval before this one), only what persisted is
    a fault, since one snapshot cannot tell a frame in flight from a lost one: a hop is broken only
    if the downstream side has still not received a chunk the upstream side had already sent at
    the earlier probe (a stage that just resumed from a pause and forwarded its backlog does not
    get its healthy successor blamed); a stage is stalled only if it was busy on the same chunk,
    with the same progress, in both probes. A stage that was silent earlier and answers now is not
    blamed for the silence.

    Args:
        reports: one per stage, in ring order.
        sent: highest chunk id the coordinator sent. returned: highest chunk id it got a result for.
        earlier: the previous probe of the same session, if the caller re-checked.
    Returns:
        The Failure, or None when every stage is reachable and nothing is stuck.
    """
    for r in reports:
        if not r.reachable:
            return Failure(r.index, "unreachable")
    for r in reports:
        if r.refusing:
            return Failure(r.index, "draining: it refuses the session")
    if earlier is None:
        before_sent = [sent] + [r.sent for r in reports]
    else:  # what each hop's upstream side had already sent at the earlier probe (-1: unknown)
        before_sent = [earlier.sent] + [r.sent if r.reachable else -1 for r in earlier.reports]
    upstream = sent
    for i, (r, was_sent) in enumerate(zip(reports, before_sent)):
        if r.received < min(upstream, was_sent):
            return Failure(r.index, f"silent: it never got chunk {min(upstream, was_sent)} sent to it "
                                    f"({'none arrived' if r.received < 0 else f'the last was {r.received}'})")
        if r.lost_successor and i + 1 < len(reports):
            return Failure(reports[i + 1].index, f"cut off: stage {r.index} lost its stream to it (the last chunk "
                                                 f"sent on was {r.sent}; it got chunk {r.received})")
        upstream = r.sent
    if reports and returned < min(upstream, before_sent[-1]):
        return Failure(reports[-1].index, f"silent: it sent result {min(upstream, before_sent[-1])}, the "
                                          f"coordinator got only {returned}")
    for i, r in enumerate(reports):
        if r.busy:
            if earlier is not None:
                e = earlier.reports[i]
                if not (e.reachable and e.busy and (e.received, e.sent) == (r.received, r.sent)):
                    continue  # it moved (or was not busy) since the earlier probe: computing, not stuck
            return Failure(r.index, f"stalled on chunk {r.received}")
    return None


@dataclass(frozen=True)
class Replay:
    """What to re-feed after a swap: ``prefix`` (prompt + committed output minus the driver token),
    and ``driver``, the last committed token, which re-feeding ``prefix`` must reproduce
    (None when nothing was committed yet: the prefill simply starts again)."""

    prefix: tuple[int, ...]
    driver: int | None


def plan_replay(prompt_ids: Sequence[int], committed_ids: Sequence[int]) -> Replay:
    """Replay plan for a session that committed ``committed_ids`` after ``prompt_ids``."""
    if not committed_ids:
        return Replay(tuple(prompt_ids), None)
    return Replay(tuple(prompt_ids) + tuple(committed_ids[:-1]), committed_ids[-1])


@dataclass(frozen=True)
class Kept:
    """What ``SwarmOps.repair`` may return when the survivors kept the session: ``mode`` is
    ``"survivors_kept"`` (the replacement was refilled) or ``"shadow"`` (it had shadowed the lost
    stage live, so it was refilled only for the positions it lacked); ``refill_tokens``: positions
    it rebuilt during the heal; ``note``: why a shadow was not used as one (then ``mode`` says
    ``"survivors_kept"``)."""

    mode: str = "survivors_kept"
    refill_tokens: int | None = None  # None: all of replay.prefix but the last position
    note: str = ""


class SwarmOps(Protocol):
    """What a heal needs from the engine (the coordinator implements it)."""

    def now(self) -> float: ...

    def range_of(self, index: int) -> tuple[int, int]: ...

    async def probe(self) -> tuple[list[StageReport], int, int]:
        """Reports of every stage, and the coordinator's (sent, returned) chunk ids."""

    async def settle(self) -> None:
        """Wait long enough for frames in flight to land (about one heartbeat) before a re-check."""

    async def pick_spare(self, layers: tuple[int, int]) -> object | None:
        """A reachable warm replacement serving exactly ``layers`` (one stage, or a chain of stages
        tiling them), or None. Its ``str`` names it."""

    async def swap(self, index: int, spare: object) -> Sequence[str] | None:
        """Put ``spare`` at ring position ``index`` (the predecessor re-dials it at reset); a chain
        moves the later positions down. Returns the PeerIds now at the position, in order (None:
        just ``str(spare)``)."""

    async def reset(self) -> None:
        """Open a fresh session on the repaired ring (every stage, new successors)."""

    async def replay(self, prefix: Sequence[int]) -> int | None:
        """Re-feed ``prefix`` in prefill chunks; return the token the ring gives after it."""

    # Optional (an engine without them always replays in full):
    #
    # def peer_of(self, index: int) -> str:
    #     """The PeerId at ring position ``index`` (recorded as ``replaced`` before a swap)."""
    #
    # async def repair(self, index: int, count: int, replay: Replay) -> str | Kept | None:
    #     """Keep the session at the survivors around the ``count`` stages now at ``index``: they
    #     keep their KV caches, the replacement's is refilled for ``replay.prefix[:-1]`` (hidden
    #     states the predecessor resends, or token ids at the head; a shadow only for what it
    #     lacks). None or a ``Kept`` when done, else why not (then ``reset`` and ``replay`` follow)."""
    #
    # async def resume(self) -> int | None:
    #     """After ``repair``: feed the last position of ``replay.prefix`` through the whole ring;
    #     return the token the ring gives after it."""
    #
    # async def pick_wider(self, index: int) -> tuple[int, int, object] | None:
    #     """When ``pick_spare`` found nothing for the lost stage at ``index`` (its layers' only
    #     other holders already sit in the ring): a replacement of a window of ring positions
    #     around it, ``(first, count, spare)``: ``spare`` takes over the layers of positions
    #     ``[first, first + count)``, stages of the window that survive included. ``swap(first,
    #     spare)`` then replaces all ``count`` positions, and the session is replayed in full
    #     (``repair`` says why it cannot keep it), or None when no window can be re-routed.


@dataclass
class HealEvent:
    """One heal, for logs and ``--json`` (seconds, from ``ops.now()``).

    ``detected_at``: when the fault surfaced; ``detect_s``: from then until the failed stage was
    located; ``spare``: what took the position (``spares``: its PeerIds, in ring order, more than
    one when a chain of stages replaced one); ``positions``: ring positions the replacement took
    over, from ``stage`` on (1, or more when no stage outside the ring could take the lost range
    and a window of positions around it was re-routed: ``stage``, ``layers`` and ``spares`` are
    then the window's, and ``lost_stage`` is the position that failed); ``replaced``: the PeerIds that held the position
    before (one per attempt; empty when the engine does not say); ``swap_s``: spare swapped in and
    session reset or repaired; ``replay``: ``"shadow"`` (the replacement had shadowed the lost stage
    live and the survivors kept their KV caches), ``"survivors_kept"`` (the survivors kept their KV
    caches; ``shadow_fallback`` says why a shadow could not be used as one, when there was one) or
    ``"full"`` (a fresh session replayed through every stage; ``fallback`` says why, when keeping
    was tried or impossible); ``replay_tokens``: positions the replacement holds in its KV cache after
    the heal (prompt + committed output minus the driver); ``refill_tokens``: of those, positions it
    rebuilt alone during the heal, from resent hidden states (or token ids at the head; a shadow
    only those it lacked, usually none); ``survivor_tokens``: positions
    each surviving stage recomputed (1 when kept: the last replayed position, whose result checks
    the driver); ``replay_s``: that rebuilding; ``total_s``: from detection to a checked, resumable
    ring."""

    stage: int
    layers: tuple[int, int]
    reason: str
    spare: str = ""
    spares: list[str] = field(default_factory=list)
    detected_at: float = 0.0
    detect_s: float = 0.0
    swap_s: float = 0.0
    replay_s: float = 0.0
    replay: str = "full"
    replay_tokens: int = 0
    refill_tokens: int = 0
    survivor_tokens: int = 0
    fallback: str = ""
    shadow_fallback: str = ""
    replaced: list[str] = field(default_factory=list)
    positions: int = 1
    lost_stage: int | None = None
    total_s: float = 0.0
    attempts: int = 1
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


async def run_heal(ops: SwarmOps, replay: Replay, detected_at: float, cause: str,
                       max_attempts: int = 3) -> HealEvent | None:
    """Heal the ring and rebuild the session's KV caches; return what happened.

    Steps, each attempt: probe and ``locate_failure``; unless the blamed stage's connection is
    gone, settle and probe again and blame only what persisted (``locate_failure(earlier=...)``);
    pick a spare for that layer range (one stage or a chain; when there is none and the engine can
    re-route, ``pick_wider``: a replacement of a window of positions around it); swap; then, when something was
    committed and the engine can (``repair``), keep the survivors' session and ``resume``; else
    (or when ``repair`` says why not) reset and replay ``replay.prefix`` in full; check the driver
    token. A SwarmError during an attempt (a second failure) starts the next attempt from the probe;
    when that probe blames nobody after a replacement was swapped in (the second failure was a
    pause), the session is replayed in full on the ring as it is.

    Args:
        ops: the engine. replay: from ``plan_replay``. detected_at: ``ops.now()`` when the fault
            surfaced (a timeout or a lost stream). cause: that fault, for the record.
        max_attempts: give up after this many.
    Returns:
        The HealEvent, or None when the re-check finds every stage answering and nothing stuck (a
        stage paused and resumed): nothing was replaced and the session goes on as it was.
    Raises:
        NoSpare: no spare holds the failed range (names it). ReplayMismatch: the replay gave
        another token than the driver (the output would diverge). HealError: every attempt failed.
    """
    errors: list[str] = [cause]
    replaced: list[str] = []
    swapped: HealEvent | None = None  # the last attempt's event once its replacement was swapped in
    for attempt in range(1, max_attempts + 1):
        t0 = ops.now()
        failure = await _blame(ops)
        if failure is None:
            if attempt == 1:
                return None  # every stage answers and nothing is stuck: a pause, not a loss
            if swapped is None:
                raise HealError(f"the heal failed ({'; '.join(errors)}) and then no stage could be blamed")
            # the replacement is in and every stage answers again: the second failure was a pause
            # during the rebuild (issue 31's chaos soak: a survivor SIGSTOPped then). Rebuild in full
            # on the ring as it is
            try:
                swapped.attempts, swapped.errors, swapped.shadow_fallback = attempt, list(errors), ""
                t2, token = await _replay_in_full(
                    ops, replay, swapped, f"a stage paused during the rebuild ({errors[-1]}): replayed in full")
                _finish(swapped, replay, token, t2, ops.now())
            except ReplayMismatch:
                raise
            except SwarmError as exc:
                errors.append(f"attempt {attempt}: {exc}")
                continue
            return swapped
        layers = ops.range_of(failure.index)
        event = HealEvent(stage=failure.index, layers=layers, reason=failure.reason, attempts=attempt,
                          errors=list(errors), detect_s=t0 - detected_at, detected_at=detected_at)
        spare = await ops.pick_spare(layers)
        first = failure.index
        if spare is None and hasattr(ops, "pick_wider"):
            # the lost range's other holders all sit in the ring (issue 31's chaos soak): re-route a
            # window of positions around it, a holder there taking over its neighbour's layers too
            wider = await ops.pick_wider(failure.index)
            if wider is not None:
                first, count, spare = wider
                event.stage, event.positions, event.lost_stage = first, count, failure.index
                event.layers = (ops.range_of(first)[0], ops.range_of(first + count - 1)[1])
        if spare is None:
            raise NoSpare(f"stage {failure.index} holding layers [{layers[0]}, {layers[1]}) is lost "
                          f"({failure.reason}) and {getattr(ops, 'no_spare', NO_WARM_SPARE)}")
        try:
            t1 = ops.now()
            event.detect_s = t1 - detected_at
            if hasattr(ops, "peer_of"):
                replaced.append(ops.peer_of(failure.index))
                event.replaced = list(replaced)
            ids = await ops.swap(first, spare)
            event.spare, event.spares = str(spare), list(ids) if ids else [str(spare)]
            swapped = event
            t2, token = await _rebuild(ops, replay, event, first)
            event.swap_s = t2 - t1
            t3 = ops.now()
        except ReplayMismatch:
            raise
        except SwarmError as exc:  # a second failure during the heal: start over from the probe
            errors.append(f"attempt {attempt}: {exc}")
            continue
        _finish(event, replay, token, t2, t3)
        return event
    raise HealError(f"the heal failed {max_attempts} times: {'; '.join(errors)}")


async def _replay_in_full(ops: SwarmOps, replay: Replay, event: HealEvent, why: str) -> tuple[float, int | None]:
    """Reset and replay ``replay.prefix`` in full on the ring as it is; ``event`` says so (``why``).

    Returns:
        (``ops.now()`` when the replay began, the driver token it produced or None).
    """
    event.replay, event.fallback = "full", why
    event.refill_tokens, event.survivor_tokens = 0, len(replay.prefix)
    await ops.reset()
    t2 = ops.now()
    return t2, await ops.replay(replay.prefix)


def _finish(event: HealEvent, replay: Replay, token: int | None, t2: float, t3: float) -> None:
    """Close ``event`` for a rebuild that ran from ``t2`` to ``t3`` and gave ``token``.

    Raises:
        ReplayMismatch: ``token`` is not the driver already committed (the output would diverge).
    """
    event.replay_s, event.replay_tokens = t3 - t2, len(replay.prefix)
    if replay.driver is not None and token != replay.driver:
        raise ReplayMismatch(f"replaying {len(replay.prefix)} tokens through the repaired ring gave token "
                             f"{token}, but {replay.driver} was already committed: refusing to continue")
    event.total_s = t3 - event.detected_at


async def _blame(ops: SwarmOps) -> Failure | None:
    """Probe and ``locate_failure``; unless the blamed stage's connection is gone, settle, probe
    again and blame only what persisted (a silent stage may be paused, frames may be in flight).

    Returns:
        The failure, or None when every stage answers and nothing is stuck.
    """
    reports, sent, returned = await ops.probe()
    failure = locate_failure(reports, sent, returned)
    if failure is None or not reports[failure.index].gone:
        earlier = Probe(tuple(reports), sent, returned)
        await ops.settle()
        reports, sent, returned = await ops.probe()
        failure = locate_failure(reports, sent, returned, earlier)
    return failure


async def _rebuild(ops: SwarmOps, replay: Replay, event: HealEvent, index: int) -> tuple[float, int | None]:
    """After the swap at ring position ``index``: keep the survivors' session and ``resume`` when
    something was committed and the engine can (``repair``), else reset and replay ``replay.prefix``
    in full. Fills ``event``'s replay mode and token counts.

    Returns:
        (``ops.now()`` when the rebuild of the session began, the driver token it produced or None).
    """
    repair = getattr(ops, "repair", None)
    if replay.driver is None:
        why = "nothing committed yet: the prefill starts again" if repair else ""
    else:
        why = "this engine cannot keep the survivors' session" if repair is None else \
            await repair(index, len(event.spares), replay)
    if why is None or isinstance(why, Kept):
        kept = why or Kept()
        event.replay, event.shadow_fallback = kept.mode, kept.note
        event.refill_tokens = max(0, len(replay.prefix) - 1) if kept.refill_tokens is None else kept.refill_tokens
        event.survivor_tokens = 1
        t2 = ops.now()
        return t2, await ops.resume()
    return await _replay_in_full(ops, replay, event, why)

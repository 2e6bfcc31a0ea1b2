"""Admission of a session at ``open``: is the frame sound, and does its KV cache fit the budget.

Owns: the pure checks of an ``open`` frame's place in the ring, the bytes a session reserves (KV for ``max_len``
and the heal log), the ``--kv-budget-mb`` decision (:func:`decide`) and :class:`Reservations` (live sessions'
bytes and those of opens in progress, so concurrent opens never over-admit).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from swarm import wire
from swarm.addrs import peer_id_from_addr
from swarm.errors import ConfigError, ContextOverflow, ProtocolError
from swarm.frames import Open
from swarm.ranges import LayerRange
from swarm.stage.session import Session


@dataclass(frozen=True)
class OpenPlace:
    """Where an ``open`` frame puts the session in the ring (checked by :func:`open_place`).

    Attributes:
        span: the layers the session runs here, half-open.
        head: its input comes from the coordinator (token ids); ``tail``: it returns token ids.
    """

    span: LayerRange
    head: bool
    tail: bool


def open_place(msg: Open, block) -> OpenPlace:
    """Check an ``open`` frame's layer span and its ``prev`` against the block.

    Args:
        msg: a validated ``open`` frame.
        block: the stage's ``LayerBlock`` (``check_span``, ``num_layers``).
    Returns:
        The session's span, and whether it is the head and the tail.
    Raises:
        ProtocolError: a span the block does not hold; a head naming ``prev``, or another stage
            not naming it.
    """
    try:
        span = block.check_span(None if msg.layers is None else LayerRange(*msg.layers))
    except ConfigError as exc:
        raise ProtocolError(f"open frame: {exc}") from None
    head, tail = span.start == 0, span.end == block.num_layers
    prev = msg.prev
    if head and prev is not None:
        raise ProtocolError(f"stage {span} is the head: its input comes from the coordinator, "
                            "not from a 'prev' stage")
    if not head and prev is None:
        raise ProtocolError(f"stage {span} is not the head and needs 'prev' (the PeerId of "
                            "its predecessor)")
    return OpenPlace(span, head, tail)


def open_links(msg: Open, place: OpenPlace, self_peer: str, max_ctx: int) -> int:
    """Check an ``open`` frame's successor, shadow and mirror, and its ``max_len``.

    Args:
        msg: a validated ``open`` frame.
        place: what :func:`open_place` found.
        self_peer: this stage's PeerId (it is never its own successor or mirror).
        max_ctx: the stage's maximum context, positions.
    Returns:
        The positions the session's cache holds (``max_len``, or ``max_ctx`` when it names none).
    Raises:
        ProtocolError: a successor where none belongs or none where one does, this stage as its
            own successor, a shadow that sends on, a mirror that is no later stage.
        ContextOverflow: ``max_len`` over ``max_ctx``.
    """
    span, tail, next_addr = place.span, place.tail, msg.next
    shadow, mirror = bool(msg.shadow), msg.mirror
    if tail and next_addr is not None:
        raise ProtocolError(f"stage {span} is the tail and takes no successor")
    if next_addr is not None and peer_id_from_addr(next_addr) == self_peer:
        raise ProtocolError("the successor named in 'next' is this stage itself")
    if shadow and (next_addr is not None or mirror is not None):
        raise ProtocolError("a shadow sends nothing on: its open frame names no 'next' and no 'mirror'")
    if not tail and next_addr is None and not shadow:
        raise ProtocolError(f"stage {span} is not the tail and needs a successor")
    if mirror is not None and (tail or peer_id_from_addr(mirror) in (self_peer, "")
                               or msg.mirror_until <= span.end):
        raise ProtocolError(f"stage {span} cannot mirror to {mirror} up to layer {msg.mirror_until}: a "
                            "mirror goes to another stage (/p2p/ address) holding the layers after this one's")
    max_len = msg.max_len or max_ctx
    if max_len > max_ctx:
        raise ContextOverflow(f"the session asks for {max_len} positions; this stage's maximum context is "
                              f"{max_ctx}")
    return max_len


def kv_need(max_len: int, kv_bytes_per_position: int, row_bytes: int, tail: bool,
            heal_log_mb: float | None) -> tuple[int, int]:
    """The bytes a session reserves, and the positions of hidden states it keeps to resend.

    A non-tail stage keeps the hidden states it sends on (``SentLog``) for a heal's ``repair``,
    reserved with the KV cache: all ``max_len`` positions, or what ``--heal-log-mb`` holds.

    Args:
        max_len: positions of the session's cache.
        kv_bytes_per_position: KV bytes of one position over the session's layers.
        row_bytes: bytes of one position's hidden states on the wire (hidden size x item size).
        tail: the session is the tail here (it sends token ids: no log).
        heal_log_mb: ``--heal-log-mb``, MiB, or None for no limit.
    Returns:
        ``(need_bytes, log_rows)``.
    """
    log_rows = 0 if tail else max_len
    if not tail and heal_log_mb is not None:
        log_rows = min(max_len, int(heal_log_mb * 2**20) // row_bytes)
    return max_len * kv_bytes_per_position + log_rows * row_bytes, log_rows


def wire_itemsize(wire_dtype: str | None, stage_dtype) -> int:
    """Bytes per value of the hidden states a stage sends: the session's wire dtype, else its own."""
    import torch

    dtype = wire.WIRE_DTYPES[wire_dtype] if wire_dtype is not None else stage_dtype
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Verdict:
    """What :func:`decide` says of one open.

    Attributes:
        admit: the session fits; ``too_big``: it would not fit the whole budget even alone (else a
            refused session is "busy": retry when one ends).
        evict_to: shrink the prefix cache to at most this many bytes first, or None to leave it.
    """

    admit: bool
    too_big: bool = False
    evict_to: int | None = None


def decide(need: int, held: int, budget: int | None, cached: int | None) -> Verdict:
    """Admit a session that needs ``need`` bytes against ``--kv-budget-mb``.

    Cold prefixes make room, live sessions never: when the session fits beside what is held but not
    beside the prefix cache too, the cache shrinks to what is left (to nothing when even the
    sessions leave no room).

    Args:
        need: bytes the new session reserves (:func:`kv_need`).
        held: bytes reserved by live sessions and opens in progress (:meth:`Reservations.held`).
        budget: ``--kv-budget-mb`` in bytes, or None for no limit.
        cached: bytes the prefix cache holds, or None when there is none.
    Returns:
        The verdict, with how far to evict first.
    """
    if budget is None:
        return Verdict(admit=True)
    if need > budget:
        return Verdict(admit=False, too_big=True)
    evict_to = None
    if cached is not None and held + need + cached > budget:
        evict_to = max(0, budget - held - need)
    return Verdict(admit=held + need <= budget, evict_to=evict_to)


class Reservations:
    """The KV bytes reserved against ``--kv-budget-mb``: live sessions' and opens' in progress.

    Args:
        sessions: the live sessions by id (the server's dict, read only here); each holds its
            ``reserved`` bytes.
    """

    def __init__(self, sessions: dict[str, Session]) -> None:
        self.sessions = sessions
        # KV bytes of opens admitted but still in progress (dialing the successor, proving a tile,
        # reusing a prefix): counted against --kv-budget-mb so concurrent opens cannot over-admit
        self.opening: dict[str, int] = {}

    def held(self, besides: str | None = None) -> int:
        """Bytes reserved, leaving out session ``besides`` (a session re-opened by its owner)."""
        held = sum(s.reserved for s in list(self.sessions.values()) if s.session_id != besides)
        return held + sum(n for sid, n in self.opening.items() if sid != besides)

    def holders(self, besides: str | None = None) -> int:
        """How many sessions and opens in progress hold bytes, leaving out session ``besides``."""
        return sum(1 for s in self.sessions.values() if s.session_id != besides) + len(self.opening)

    @contextmanager
    def opening_session(self, sid: str, need: int) -> Iterator[None]:
        """Hold ``need`` bytes for an admitted open until it ends (recorded as a session, or failed)."""
        self.opening[sid] = need
        try:
            yield
        finally:
            self.opening.pop(sid, None)

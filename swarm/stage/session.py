"""Per-session state at a stage, and the queued work of a session.

Owns: ``Session`` (KV cache, streams, epoch, progress, job queue, heal and shadow state), ``Evidence`` (what a
session with a job keeps for its receipt and audits), ``SentLog`` (hidden states sent on, for a heal), ``Job``
(a queued chunk, refill or receipt request) and ``session_of``. Data only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swarm import receipts
from swarm.frames import Forward, Receipt, Refill
from swarm.ranges import LayerRange

if TYPE_CHECKING:  # annotations only: the session's parts, owned elsewhere
    from swarm.config import SamplingParams
    from swarm.mirror import Mirror
    from swarm.model.cache import KVCache
    from swarm.openings import WindowLog
    from swarm.transport.framing import FramedStream


class SentLog:
    """The hidden states a non-tail stage sent on for one session, by absolute position, as raw wire
    bytes: on a heal that replaces its successor, it resends positions ``[0, n)`` (``repair`` with
    ``resend``) so the replacement fills its KV cache without the survivors recomputing anything.

    Every record at ``pos`` first drops the rows from ``pos`` on (a rollback), so the log holds rows
    ``[0, length)`` exactly as the last frames covering them carried them: the committed positions'
    rows are those of the chunks that committed them. Bounded by the session's ``max_len`` rows of
    ``D`` values in the wire dtype, reserved against ``--kv-budget-mb`` at ``open``, and dropped
    with the session.

    Args:
        hidden_size: D. max_len: rows it may hold: the session's maximum context, or fewer under
            ``--heal-log-mb`` (a session that outgrows it keeps none: its successor's heal replays in full).
    """

    def __init__(self, hidden_size: int, max_len: int) -> None:
        self.hidden_size, self.max_len = hidden_size, max_len
        self.dtype: str | None = None  # wire dtype name of the rows, fixed by the first record
        self.row_bytes = 0
        self.data = bytearray()
        self.scale: bytearray | None = None  # float8: one float32 scale per row
        self.broken = ""  # why the log cannot be trusted (then it holds nothing)

    @property
    def length(self) -> int:
        """Positions ``[0, length)`` are held."""
        return len(self.data) // self.row_bytes if self.row_bytes and not self.broken else 0

    def record(self, pos: int, tensor: dict) -> None:
        """Keep the rows of a sent tensor map (``wire.encode_tensor``, shape (1, T, D)) at ``[pos, pos + T)``."""
        if self.broken:
            return
        shape, data = tensor.get("shape"), tensor.get("data")
        if not (isinstance(shape, list) and len(shape) == 3 and shape[0] == 1 and shape[1] >= 1
                and shape[2] == self.hidden_size):
            self._break(f"a sent tensor has shape {shape!r}")
            return
        if self.dtype is None:
            self.dtype, self.row_bytes = tensor["dtype"], len(data) // shape[1]
            self.scale = bytearray() if "scale" in tensor else None
        if pos + shape[1] > self.max_len:
            self._break(f"rows up to {pos + shape[1]} pass the log's cap of {self.max_len} (--heal-log-mb)")
            return
        if tensor["dtype"] != self.dtype or pos > self.length:
            self._break(f"rows at {pos} in {tensor['dtype']} do not continue the log ({self.length} rows of {self.dtype})")
            return
        del self.data[pos * self.row_bytes:]
        self.data += data
        if self.scale is not None:
            del self.scale[pos * 4:]
            self.scale += tensor.get("scale") or b""

    def _break(self, why: str) -> None:
        self.broken, self.data, self.scale = why, bytearray(), None

    def frames(self, n: int, rows_per_frame: int, start: int = 0) -> list[tuple[int, dict]]:
        """Tensor maps of rows ``[start, n)`` (``n <= length``), ``rows_per_frame`` at a time: ``[(pos, map)]``."""
        out = []
        for pos in range(start, n, rows_per_frame):
            t = min(rows_per_frame, n - pos)
            m = {"dtype": self.dtype, "shape": [1, t, self.hidden_size],
                 "data": bytes(self.data[pos * self.row_bytes:(pos + t) * self.row_bytes])}
            if self.scale is not None:
                m["scale"] = bytes(self.scale[pos * 4:(pos + t) * 4])
            out.append((pos, m))
        return out


@dataclass
class Job:
    """A queued chunk (or receipt request) of one session at this stage."""

    msg: Forward | Refill | Receipt
    x: torch.Tensor | None = None  # (1, T) token ids at the head, else (1, T, D); None: a receipt request
    done: int = 0  # positions computed so far (a long chunk is computed a slice per step)
    parts: list = field(default_factory=list)  # outputs of the slices computed so far
    queued_at: float = 0.0  # time.perf_counter() when queued (the scheduler's timing counters)


@dataclass
class Evidence:
    """What a session opened with a job keeps for its stage receipt and audits."""

    ledger: receipts.StageLedger  # rolling digests of the frames received and sent
    windows: WindowLog | None = None  # the rows behind the receipt's Merkle root (None: no --audit-retention-mb)
    answers: list = field(default_factory=list)  # the tail's token id after each position (None: not answered)


@dataclass
class Scheduling:
    """How a session's chunks arrive and wait at this stage: what the scheduler plans with."""

    queue: deque = field(default_factory=deque)  # Jobs waiting for the scheduler, in arrival order
    queued_end: int = 0  # pos + T of the last queued chunk: where the next one may start at most
    busy: bool = False  # computing a received chunk
    last_active: float = 0.0  # trio clock of the last frame for this session
    last_rows: int = 0  # positions of its last queued chunk: a few when it decodes, many when it prefills
    # trio clock when its last decode/verify chunk was queued, or its prompt's last chunk done (0: neither)
    last_short: float = 0.0
    short_gap: float = 0.0  # seconds between its last two decode/verify chunks (0: fewer than two in a row)


@dataclass
class HealState:
    """What a heal reads and re-points at this stage: progress, the successor, the copies kept."""

    received: int = -1  # highest chunk id received (heal progress reports)
    sent: int = -1  # highest chunk id sent on (the tail: as a result)
    successor_lost: bool = False  # its successor stopped taking frames (until a repair names a new one)
    sent_log: SentLog | None = None  # hidden states sent on (non-tail stages), for a heal's resend
    # a warm spare's copy of a stage's session (open with shadow: true): it only fills its KV cache
    # from the refill frames its predecessor mirrors, sends nothing on, until a repair promotes it
    shadow: bool = False
    mirror: Mirror | None = None  # copies of the forwards sent on, to the successor's shadow


@dataclass
class Session:
    """One session's state at this stage, with its scheduling, heal and evidence parts."""

    session_id: str
    cache: KVCache
    reply: FramedStream  # back to the coordinator that opened the session
    next_addr: str | None
    coordinator: str = ""  # PeerId that opened (and alone may steer) the session
    source: str = ""  # PeerId whose forward frames the session accepts: the predecessor, or the coordinator
    next_stream: FramedStream | None = None
    epoch: int = 0
    sampling: SamplingParams | None = None  # at the tail when the session samples; None = greedy
    wire_dtype: torch.dtype | None = None  # of hidden states sent on; None = the stage's dtype
    span: LayerRange | None = None  # the layers it runs: the block or a sub-range the open frame named
    batch: bool = False  # may share packed forwards (--batch-tile GEMMs); else alone, one GEMV per row
    reserved: int = 0  # KV bytes reserved against --kv-budget-mb (max_len positions)
    positions: int = 0
    frames_in: int = 0
    frames_out: int = 0
    errors: list = field(default_factory=list)
    prefix_ns: str | None = None  # the prefix-cache namespace (open frame named a prefix), else None
    reused: int = 0  # positions [0, reused) of the KV cache came from the prefix cache at open
    scheduling: Scheduling = field(default_factory=Scheduling)
    heal: HealState = field(default_factory=HealState)
    evidence: Evidence | None = None  # when the open frame named a job

    @property
    def is_head(self) -> bool:
        """Its layers start the model: the input is token ids from the coordinator."""
        return self.span.start == 0

    def is_tail(self, num_layers: int) -> bool:
        """Its layers end the model: the output is token ids for the coordinator."""
        return self.span.end == num_layers


def record_answers(answers: list, pos: int, rows: int, ids: list[int]) -> None:
    """Keep the tail's answers for a chunk of ``rows`` positions at ``pos``: ``ids`` answer its last
    rows. Every answer from ``pos`` on is dropped first (a rollback), as in ``swarm.openings.WindowLog``,
    so afterwards position ``p`` holds the id the tail last sent after it: what its receipt signs."""
    del answers[pos:]
    answers.extend([None] * (pos - len(answers)))
    answers.extend([None] * (rows - len(ids)) + [int(i) for i in ids])


def session_of(msg) -> str | None:
    """The ``session`` of a raw frame map, where it names one (for the error reply to a frame that
    failed validation)."""
    return msg.get("session") if isinstance(msg, dict) and isinstance(msg.get("session"), str) else None

"""Per-session state at a stage, and the queued work of a session.

Owns: ``Session`` (KV cache, the coordinator's reply stream, the successor, epoch, the progress
counters a probe reads, the receipt ledger, the queue of jobs), ``Job`` (one queued chunk or receipt
request) and ``session_of`` (the session id a frame names). Data only: the server, scheduler,
outbox and signing modules of this package act on it. May import: torch (types), ``swarm.receipts``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from swarm import receipts


@dataclass
class Job:
    """A queued chunk (or receipt request) of one session at this stage."""

    msg: dict
    x: torch.Tensor | None = None  # (1, T) token ids at the head, else (1, T, D); None: a receipt request
    done: int = 0  # positions computed so far (a long chunk is computed a slice per step)
    parts: list = field(default_factory=list)  # outputs of the slices computed so far


@dataclass
class Session:
    """One session's state at this stage."""

    session_id: str
    cache: object
    reply: object  # FramedStream back to the coordinator that opened the session
    next_addr: str | None
    coordinator: str = ""  # PeerId that opened (and alone may steer) the session
    source: str = ""  # PeerId whose forward frames the session accepts: the predecessor, or the coordinator
    next_stream: object | None = None
    epoch: int = 0
    sampling: object = None  # SamplingParams at the tail when the session samples; None = greedy
    wire_dtype: object = None  # torch dtype of hidden states sent on; None = the stage's dtype
    positions: int = 0
    received: int = -1  # highest chunk id received (heal progress reports)
    sent: int = -1  # highest chunk id sent on (the tail: as a result)
    busy: bool = False  # computing a received chunk
    frames_in: int = 0
    frames_out: int = 0
    errors: list = field(default_factory=list)
    ledger: receipts.StageLedger | None = None  # rolling digests, when the open frame named a job
    reserved: int = 0  # KV bytes reserved against --kv-budget-mb (max_len positions)
    last_active: float = 0.0  # trio clock of the last frame for this session
    queue: deque = field(default_factory=deque)  # Jobs waiting for the scheduler, in arrival order
    queued_end: int = 0  # pos + T of the last queued chunk: where the next one may start at most
    batch: bool = False  # may share packed forwards (--batch-tile GEMMs); else alone, one GEMV per row
    span: object = None  # LayerRange this session runs: the block or a sub-range the open frame named

    @property
    def is_head(self) -> bool:
        """Its layers start the model: the input is token ids from the coordinator."""
        return self.span.start == 0

    def is_tail(self, num_layers: int) -> bool:
        """Its layers end the model: the output is token ids for the coordinator."""
        return self.span.end == num_layers


def session_of(msg) -> str | None:
    return msg.get("session") if isinstance(msg, dict) and isinstance(msg.get("session"), str) else None

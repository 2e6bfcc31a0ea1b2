"""``SessionBook``: what the ring client keeps of one open session, in one record per session.

Owned by ``RingClient.books`` (session id -> book); ``RingRepair`` writes a heal's part of it (the
closed digests, the epoch of the last repair).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.receipts import RollingDigest


@dataclass
class SessionBook:
    """One session's books at the coordinator.

    Attributes:
        sent: the highest chunk id sent to the head (-1: none).
        returned: the highest chunk id whose result arrived from the tail (-1: none).
        ledger: with a job, the rolling digests of the forward frames sent to the head and of the result
            frames from the tail (receipts); None without one.
        segments: the ledger's closed digests (a heal that kept the survivors replaced the head or the tail).
        repaired_epoch: the epoch of the last such repair (-1: none): errors of older epochs are stale.
        prefixed: opened with a prefix: a replacement stage gets one too (empty: it holds none).
        prefix_salt: the request's cache salt, in every prefix namespace of the session.
    """

    sent: int = -1
    returned: int = -1
    ledger: tuple[RollingDigest, RollingDigest] | None = None
    segments: list[dict] = field(default_factory=list)
    repaired_epoch: int = -1
    prefixed: bool = False
    prefix_salt: str = ""


@dataclass
class Generation:
    """One generation's session at the ring, as a heal sees it: the session id (a heal that resets the
    session opens a new one) and what every open of it asks of the stages.

    Attributes:
        session: the session id now. max_len: positions it may hold (prompt + budget).
        sampling: the tail's sampling settings on the wire (None: greedy). wire_dtype: of hidden states.
        job: ``{"id", "nonce"}`` when its stages sign receipts, else None.
        prefix_cache: it opens with the prompt for the stages' prefix caches. prefix_salt: their scope.
    """

    session: str
    max_len: int
    sampling: dict | None = None
    wire_dtype: str | None = None
    job: dict | None = None
    prefix_cache: bool = False
    prefix_salt: str = ""

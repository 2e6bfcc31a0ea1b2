"""What a stage keeps of its recent jobs so that an audit can open them: the retention store.

Owns: :class:`RetentionStore`, the signed receipt and the window commitment (rows and Merkle tree,
``swarm.audit.Commitment``) of each recent job, by (session, job id), bounded in bytes
(``--audit-retention-mb``), oldest first out. Kept in memory: the stage has no state directory.
A job signed again (a second receipt request) replaces its entry. Data only; no clock, no I/O.
May import: the standard library, ``swarm.audit``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

from swarm.audit import Commitment

log = logging.getLogger(__name__)

FORGOTTEN_KEPT = 4096  # evicted jobs remembered by id, so an audit of one hears "evicted", not "unknown"


@dataclass(frozen=True)
class Retained:
    """One job's receipt (signed, this stage's) and its window commitment."""

    receipt: dict
    commitment: Commitment

    @property
    def nbytes(self) -> int:
        return self.commitment.nbytes


class RetentionStore:
    """Recent jobs' rows for audits, at most ``max_bytes`` in all, the oldest evicted first.

    Args:
        max_bytes: the budget (``--audit-retention-mb`` in bytes); 0 keeps nothing.
    Raises:
        ValueError: a negative budget.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the retention budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._jobs: OrderedDict[tuple[str, str], Retained] = OrderedDict()
        self._evicted: deque = deque(maxlen=FORGOTTEN_KEPT)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, session: str, job_id: str, receipt: dict, commitment: Commitment) -> bool:
        """Keep a job's receipt and commitment (replacing an earlier one of the same job), evicting the
        oldest jobs until it fits. Returns False (and keeps nothing) when it alone exceeds the budget."""
        key = (session, job_id)
        self._drop(key)
        entry = Retained(receipt, commitment)
        if entry.nbytes > self.max_bytes:
            self._forget(key)
            log.warning("audit.not_retained session=%s job=%s bytes=%d budget=%d (--audit-retention-mb)",
                        session, job_id, entry.nbytes, self.max_bytes)
            return False
        while self.nbytes + entry.nbytes > self.max_bytes and self._jobs:
            old, _ = next(iter(self._jobs.items()))
            self._drop(old)
            self._forget(old)
        self._jobs[key] = entry
        self.nbytes += entry.nbytes
        return True

    def get(self, session: str, job_id: str) -> Retained | None:
        """The job's entry, or None (see :meth:`evicted` for why)."""
        return self._jobs.get((session, job_id))

    def evicted(self, session: str, job_id: str) -> bool:
        """Whether the job was kept once and evicted since (or was too large to keep)."""
        return (session, job_id) in self._evicted

    def _drop(self, key) -> None:
        entry = self._jobs.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _forget(self, key) -> None:
        self._evicted.append(key)
        self.evictions += 1

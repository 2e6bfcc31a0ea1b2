"""Who a reader of the swarm shuts out: identities against which it verified a fraud proof itself.

Owns: :class:`Exclusions`: routing, heals and placement ask it which stages to leave out (``excluded``); it reads
the proofs against each from the DHT, re-runs each once on this process's own weights in a worker thread and
excludes when one holds; ``judged(peer)`` says what befell a stage's proof (the dashboard).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

import trio

from swarm import proofs
from swarm.auditor.judge import Blocks, ProofCheck, verify_proof
from swarm.errors import ProofRefused

log = logging.getLogger(__name__)


class Exclusions:
    """Identities shut out on verified evidence (see the module docstring).

    Args:
        blocks: this process's weights (:class:`Blocks`), or None: then no proof can be re-run and
            nobody is excluded (logged once per proof).
        timeout_s: for reading the proofs of one batch of PeerIds.
    """

    def __init__(self, blocks: Blocks | None, timeout_s: float = 5.0) -> None:
        self.blocks, self.timeout_s = blocks, timeout_s
        self.verified: dict[str, ProofCheck] = {}  # PeerId -> the proof that held
        self.refused: dict[str, str] = {}  # PeerId -> why the proof against it was refused
        self.unchecked: dict[str, str] = {}  # PeerId -> why the proof against it could not be re-run
        self._judged: dict[str, str] = {}  # proof digest -> "valid" / the refusal line
        self._checks: dict[str, ProofCheck] = {}  # proof digest -> its check, for those that held
        self._limiter = trio.CapacityLimiter(1)

    async def excluded(self, dht, peer_ids: Iterable[str]) -> frozenset[str]:
        """The PeerIds among ``peer_ids`` (and earlier ones) with a proof this process verified."""
        todo = [p for p in set(peer_ids) if p not in self.verified]
        with trio.move_on_after(self.timeout_s):
            async with trio.open_nursery() as nursery:
                for peer in todo:
                    nursery.start_soon(self._check, dht, peer)
        return frozenset(self.verified)

    def judged(self, peer: str) -> dict | None:
        """What this process made of the proof against ``peer`` (read by an earlier ``excluded``):
        ``{"proof": "excluded", "why": the verified proof's line}``, ``{"proof": "refused", "why": the
        reason}``, ``{"proof": "unchecked", "why": ...}`` (it could not re-run it), or None (no proof read)."""
        if peer in self.verified:
            return {"proof": "excluded", "why": self.verified[peer].line()}
        for state, why in (("refused", self.refused), ("unchecked", self.unchecked)):
            if peer in why:
                return {"proof": state, "why": why[peer]}
        return None

    async def _check(self, dht, peer: str) -> None:
        values = await dht.proofs.read_all(peer)
        for value in values:
            if peer in self.verified:
                return
            await self._judge(peer, value)

    async def _judge(self, peer: str, value: bytes) -> None:
        """Re-run one proof against ``peer`` (once per digest) and exclude ``peer`` when it holds."""
        digest = hashlib.blake2b(value, digest_size=16).hexdigest()
        if digest in self._judged:
            if self._judged[digest] == "valid" and peer not in self.verified:  # judged under another read
                self.verified[peer] = self._checks[digest]
            return
        if self.blocks is None:
            self._judged[digest] = self.unchecked[peer] = "no local weights to re-run the proof"
            log.warning("audit.proof_unchecked accused=%s: no local weights to re-run it; not excluded", peer)
            return
        try:
            check = await trio.to_thread.run_sync(verify_proof, proofs.decode(value), self.blocks,
                                                  limiter=self._limiter)
        except ProofRefused as exc:
            line = str(exc) + (f" (evidence against auditor {exc.against})" if exc.against else "")
            self._judged[digest] = self.refused[peer] = line
            log.warning("audit.proof_refused accused=%s %s", peer, line)
            return
        except Exception:  # a task root: a fault re-running someone's document must not stop routing
            log.exception("audit.proof_check_failed accused=%s; not excluded", peer)
            self._judged[digest] = self.unchecked[peer] = "the check failed"
            return
        if check.accused != peer:  # read under another PeerId's key: no DHT node stores that (a double)
            self._judged[digest] = self.refused[peer] = f"the proof accuses {check.accused}, not {peer}"
            return
        self._judged[digest] = "valid"
        self._checks[digest] = check
        self.verified[peer] = check
        self.refused.pop(peer, None)
        self.unchecked.pop(peer, None)
        log.warning("audit.excluded peer=%s layers=%s job=%s: %s", peer, list(check.layers), check.job_id,
                    check.line())

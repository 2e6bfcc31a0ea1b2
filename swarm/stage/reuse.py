"""The stage's side of the prefix cache (issue 17): sessions' KV reused at ``open``, kept at ``close``.

Owns: :class:`PrefixReuse`: the ``PrefixStore`` under its byte allowance (``--prefix-cache-mb``, within what
``--kv-budget-mb`` leaves), a session's namespace, a new session's cache filled from the store and a closed
session's whole blocks kept, both in the worker thread under the compute limiter.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import trio

from swarm.stage.admission import Reservations
from swarm.stage.prefix import PrefixStore
from swarm.stage.session import Session

log = logging.getLogger(__name__)


class PrefixReuse:
    """Reuse and keep sessions' prefix blocks (see the module docstring).

    Args:
        cache_mb: ``--prefix-cache-mb``, MiB; ``block_tokens``: ``--prefix-block``, positions per block.
        budget_bytes: ``budget_bytes()`` is ``--kv-budget-mb`` in bytes now, or None for no limit.
        reservations: the KV bytes live sessions and opens reserve (the store gets what is left).
        block: the stage's ``LayerBlock``.
        limiter: the scheduler's compute limiter (one thread on the block and its caches at a time).
        tile_of: ``tile_of(sess)``, rows per GEMM of the session (its bits depend on it).
    """

    def __init__(self, cache_mb: float, block_tokens: int, budget_bytes: Callable[[], int | None],
                 reservations: Reservations, block, limiter: trio.CapacityLimiter,
                 tile_of: Callable[[Session], int]) -> None:
        self.cache_mb, self.block_tokens, self.budget_bytes = cache_mb, block_tokens, budget_bytes
        self.reservations, self.block, self.limiter, self.tile_of = reservations, block, limiter, tile_of
        self.store = PrefixStore(block_tokens, budget_bytes=self.allowed)
        # trio.Event -> namespace, of sessions' KV being kept in the prefix cache now
        self.storing: dict[trio.Event, str] = {}

    def allowed(self) -> int:
        """Bytes the prefix cache may hold now: ``--prefix-cache-mb``, and within ``--kv-budget-mb``
        what live sessions do not reserve."""
        allowed = int(self.cache_mb * 2**20)
        budget = self.budget_bytes()
        if budget is not None:
            allowed = min(allowed, max(0, budget - self.reservations.held()))
        return allowed

    def stats(self) -> dict:
        """The prefix cache's counters (``info`` and ``/health``)."""
        return {**self.store.stats, "budget_bytes": self.allowed(), "block_tokens": self.block_tokens}

    def namespace(self, sess: Session, upstream: str) -> str:
        """What a session's cached blocks are scoped by: the coordinator's fingerprint of the path
        before this stage (``upstream``), the coordinator's PeerId (it alone vouches for the ids),
        and what decides this stage's bits: weights, layers, dtype, GEMM tile."""
        b = self.block
        text = repr([upstream, sess.coordinator, b.digest_of(sess.span), sess.span.as_list(), str(b.dtype),
                     self.tile_of(sess)])
        return hashlib.sha256(text.encode()).hexdigest()

    async def reuse(self, sess: Session, prefix: dict) -> None:
        """Fill a new session's KV cache from the prefix cache: the leading whole blocks of the
        prompt ``prefix["ids"]`` that this stage holds, never the prompt's last position (its row
        gives the first token). Checked block by block (a corrupt one ends the reuse there and is
        dropped). Sets ``sess.reused``; the coordinator starts the prefill at the fewest any stage
        reused, rolling the others back to it."""
        store, ids = self.store, prefix["ids"]
        sess.prefix_ns = self.namespace(sess, prefix["ns"])
        # a session closed just before in this namespace (a chat's previous turn) is still being kept; one of
        # another namespace (another salt or coordinator) is not waited for: its blocks are none of this
        # session's, and the wait would tell this client that someone just finished (issue 45 item 16)
        pending = [done for done, ns in self.storing.items() if ns == sess.prefix_ns]
        if pending and ids:
            with trio.move_on_after(5.0):
                for done in pending:
                    await done.wait()
        keys = store.lookup(sess.prefix_ns, ids, len(ids) - 1) if len(ids) > 1 else []  # [] only names the scope
        if not keys:
            return
        store.pin(keys)
        try:
            sess.reused = await trio.to_thread.run_sync(store.load, keys, sess.cache, limiter=self.limiter)
        finally:
            store.unpin(keys)
        log.info("prefix.reused session=%s positions=%d", sess.session_id, sess.reused)

    async def keep(self, sess: Session, keep: list[int]) -> None:
        """After a session closed: keep the KV of the whole blocks of ``keep`` (its committed ids) that
        its cache computed, rows ``[0, len(keep) - 1)`` (the last committed token was never fed).
        Under the compute limiter, so no step is writing this cache meanwhile."""
        def store() -> int:
            return self.store.store(sess.prefix_ns, keep, sess.cache, min(sess.cache.kv_len, len(keep) - 1))

        done = trio.Event()
        self.storing[done] = sess.prefix_ns
        try:
            stored = await trio.to_thread.run_sync(store, limiter=self.limiter)
        except Exception:  # a cache that cannot be kept costs a later prefill, never this stage
            log.exception("prefix.store_failed session=%s", sess.session_id)
            return
        finally:
            self.storing.pop(done, None)
            done.set()
        log.debug("prefix.stored session=%s blocks=%d", sess.session_id, stored)

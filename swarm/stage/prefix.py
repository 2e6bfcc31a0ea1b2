"""A stage's store of reusable prefix blocks: KV rows of ended sessions, kept by the token ids they encode.

Owns: ``PrefixStore`` (fixed-size blocks of K/V rows keyed by a hash chain over token ids, LRU eviction under a
byte budget, pins, checksums, stats) and ``chain_keys`` (the pure key function). Scoping is the caller's: all of
it is in the ``namespace`` that roots the chain. Why reuse is exact, and the sources: docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from swarm.model.cache import KVCache

log = logging.getLogger(__name__)


def chain_keys(namespace: str, ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """The keys of the full blocks of ``ids``: ``root = sha256(namespace)``, ``key_i = sha256(key_{i-1} ||
    ids[i*bt:(i+1)*bt] as little-endian int64)`` (vLLM automatic prefix caching's chained block hash).

    Args:
        namespace: what scopes the chain (the caller puts model digest, layer range, dtype, PeerId in it).
        ids: token ids, each in [-2**63, 2**63); a trailing partial block has no key.
        block_tokens: positions per block (>= 1).
    Returns:
        ``len(ids) // block_tokens`` keys of 32 bytes; the keys of a prefix of ``ids`` are a prefix of these.
    Raises:
        ValueError: ``block_tokens < 1``, or an id out of int64 range.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    key = hashlib.sha256(namespace.encode()).digest()
    pack = struct.Struct(f"<{block_tokens}q").pack
    keys = []
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        try:
            packed = pack(*ids[start:start + block_tokens])
        except struct.error as exc:
            raise ValueError(f"token ids of block {len(keys)} do not pack as int64: {exc}") from None
        key = hashlib.sha256(key + packed).digest()
        keys.append(key)
    return keys


@dataclass(eq=False)
class PrefixBlock:
    """One stored block: the K and V rows of ``block_tokens`` positions for every layer of a cache.

    Attributes:
        keys: (layers, block_tokens, Hkv, Dh), values: (layers, block_tokens, Hkv, Dv); the cache's dtype
            and device, layers in ``layer_ids`` order (copies: the session's cache may be freed).
        layer_ids: the absolute layer indices of the cache the rows came from.
        index: the block's place in its chain (positions ``[index * block_tokens, (index + 1) * block_tokens)``).
        parent: the key of the previous block of the chain (the namespace root for block 0).
        checksum: blake2b (32 bytes) over the bytes of ``keys`` then ``values``, taken when stored.
        nbytes: bytes of ``keys`` and ``values``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    layer_ids: tuple[int, ...]
    index: int
    parent: bytes
    checksum: bytes
    nbytes: int


def _checksum(*tensors: torch.Tensor) -> bytes:
    """blake2b over the raw bytes of ``tensors`` (copied to the CPU first when they are elsewhere)."""
    h = hashlib.blake2b(digest_size=32)
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # any dtype, bf16 included
        h.update(raw.numpy().data)
    return h.digest()


class PrefixStore:
    """Prefix blocks of one stage, by chain key, in LRU order, within a byte budget.

    Invariant: a block is only stored when its parent is (``store`` stops at the first block that does
    not fit), and only leaves (blocks no stored block names as parent) are evicted, so eviction never
    strands a chain. A block dropped for a bad checksum may leave its descendants stored but unreachable
    until the same prefix is stored again (then they are reachable, and correct, again); meanwhile they
    age out, leaf first, like the rest.

    Threads: not thread-safe. The stage calls it from the trio thread; ``store`` and ``load`` (the
    copies and hashing) may run in a worker thread while no other call on the store runs.

    Args:
        block_tokens: positions per block (>= 1).
        budget_bytes: the most bytes the blocks may hold: None (no limit), an int, or a callable returning
            the bytes allowed now (or None), read once per ``store`` (the stage passes its KV budget less
            what live sessions reserve: live sessions always win over cached prefixes, see ``evict_to``).
    Raises:
        ValueError: ``block_tokens < 1``.
    """

    def __init__(self, block_tokens: int = 32, budget_bytes: Callable[[], int | None] | int | None = None) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = int(block_tokens)
        self._budget = budget_bytes
        self._blocks: OrderedDict[bytes, PrefixBlock] = OrderedDict()  # least recently used first
        self._children: dict[bytes, int] = {}  # key -> stored blocks naming it as parent
        self._pins: dict[bytes, int] = {}
        self.nbytes = 0
        self._stats = {"hits": 0, "misses": 0, "lookups": 0, "evictions": 0, "checksum_failures": 0, "stored": 0}

    # --- queries ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def block(self, key: bytes) -> PrefixBlock | None:
        """The stored block of ``key`` (or None), for inspection; does not touch the LRU order."""
        return self._blocks.get(key)

    @property
    def stats(self) -> dict[str, int]:
        """Counters for the stage's ``info`` frame and /health.

        ``blocks``, ``bytes``: held now. ``stored``: blocks ever stored. ``hits``: blocks reused by
        ``load``. ``lookups``: ``lookup`` calls; ``misses``: those that matched no block. ``evictions``:
        blocks evicted for room (not those dropped for a bad checksum). ``checksum_failures``: blocks
        whose bytes no longer matched their checksum at ``load``.
        """
        return {"blocks": len(self._blocks), "bytes": self.nbytes, **self._stats}

    def lookup(self, namespace: str, ids: Sequence[int], limit: int) -> list[bytes]:
        """The keys of the longest run of stored blocks from block 0 that ``ids`` starts with, touched (LRU).

        Args:
            namespace: as given to ``store``.
            ids: the new session's token ids.
            limit: the most positions to reuse; full blocks within ``min(limit, len(ids))`` only. The caller
                leaves at least the last prompt position out (its logits must be computed).
        Returns:
            Keys of blocks 0..n-1 (n may be 0), for ``pin`` and ``load``.
        """
        self._stats["lookups"] += 1
        run = []
        for key in chain_keys(namespace, ids[:max(0, limit)], self.block_tokens):
            if key not in self._blocks:
                break
            run.append(key)
        if not run:
            self._stats["misses"] += 1
        self._touch(run)
        return run

    # --- store and load --------------------------------------------------------------------------

    @torch.no_grad()  # not inference mode: the copies stay ordinary tensors (inspectable, writable in tests)
    def store(self, namespace: str, ids: Sequence[int], cache: KVCache, valid: int) -> int:
        """Keep the full blocks of rows ``[0, valid)`` of ``cache`` not stored yet (present ones are touched).

        Reads the cache's per-layer buffers (``KVCache._keys`` / ``_values``, (1, capacity, Hkv, Dh),
        position-major) directly: the cache has no public row accessor. Blocks that would exceed the budget
        first evict least-recently-used unpinned leaves outside this chain; when there is still no room,
        the blocks from there on are not stored, so what is stored stays a chain from block 0.

        Args:
            namespace: the chain's scope (see ``chain_keys``).
            ids: the token ids whose rows the cache holds, position i at ``ids[i]``.
            cache: the session's KV cache (B = 1), rows ``[0, valid)`` committed.
            valid: positions whose rows are known good; ``valid <= cache.kv_len`` and ``<= len(ids)``.
        Returns:
            Blocks newly stored.
        Raises:
            ValueError: ``valid`` out of range, a batch dimension other than 1, a layer missing from the cache,
                layers of different shapes or dtypes (a block packs all layers in one tensor).
        """
        if not 0 <= valid <= min(cache.kv_len, len(ids)):
            raise ValueError(f"valid={valid} is not within kv_len {cache.kv_len} and {len(ids)} ids")
        keys = chain_keys(namespace, ids[:valid], self.block_tokens)
        if not keys:
            return 0
        layer_ids = tuple(cache.layer_ids)
        row_shapes = set()
        for layer in layer_ids:
            k, v = cache._keys.get(layer), cache._values.get(layer)
            if k is None or v is None:
                raise ValueError(f"the cache holds no rows for layer {layer}")
            if k.shape[0] != 1:
                raise ValueError(f"prefix blocks need B = 1, the cache of layer {layer} has B = {k.shape[0]}")
            row_shapes.add((k.shape[2:], v.shape[2:], k.dtype))
        if len(row_shapes) != 1:
            raise ValueError(f"the cache's layers differ in (Hkv, Dh) or dtype: {sorted(map(str, row_shapes))}")
        (k_row, v_row, dtype), = row_shapes
        block_bytes = self.block_tokens * len(layer_ids) * (k_row.numel() + v_row.numel()) * dtype.itemsize
        allowed = self._budget() if callable(self._budget) else self._budget
        protect = set(keys)  # this chain's present blocks are the parents of what is added
        parent = hashlib.sha256(namespace.encode()).digest()
        stored, run = 0, []
        for i, key in enumerate(keys):
            if key not in self._blocks:
                if allowed is not None and self.nbytes + block_bytes > allowed:
                    self._evict(allowed - block_bytes, protect)
                    if self.nbytes + block_bytes > allowed:
                        log.debug("prefix.store_stopped block=%d bytes=%d allowed=%d", i, self.nbytes, allowed)
                        break
                self._add(key, self._copy_block(cache, layer_ids, i, parent))
                stored += 1
            run.append(key)
            parent = key
        self._stats["stored"] += stored
        self._touch(run)
        return stored

    @torch.inference_mode()  # the cache's buffers are inference tensors, as a forward makes them
    def load(self, keys: Sequence[bytes], cache: KVCache) -> int:
        """Verify and copy the leading blocks of ``keys`` into the empty ``cache``, touching them (LRU).

        The rows go in through ``cache.begin(0, R)``, one ``update`` per layer in ``cache.layer_ids`` order
        with (1, Hkv, R, Dh) tensors, ``commit``: the buffers grow by the cache's own rule, and a following
        ``begin(R, T)`` continues as if this cache had computed the rows (they are the stored bytes).
        A block whose checksum no longer matches is dropped (counted, logged) and the copy stops before it;
        so does a key that is no longer stored.

        Args:
            keys: from ``lookup`` (blocks 0..n-1 of one chain), pinned by the caller if anything may evict
                between the two calls.
            cache: an empty KV cache (``kv_len == 0``, B = 1) over the layers the blocks were stored from.
        Returns:
            Positions reused R (``cache.kv_len`` afterwards): ``block_tokens`` times the good leading blocks.
        Raises:
            ValueError: ``cache.kv_len != 0``, or the blocks come from other layers than the cache's.
            ContextOverflow: R exceeds the cache's ``max_len``.
        """
        if cache.kv_len != 0:
            raise ValueError(f"load needs an empty cache, this one has kv_len {cache.kv_len}")
        good: list[PrefixBlock] = []
        run: list[bytes] = []
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None:
                break
            if block.layer_ids != tuple(cache.layer_ids):
                raise ValueError(f"block {i} holds layers {list(block.layer_ids)}, the cache {cache.layer_ids}")
            if _checksum(block.keys, block.values) != block.checksum:
                self._stats["checksum_failures"] += 1
                log.warning("prefix.checksum_mismatch block=%d layers=%s bytes=%d: dropped, reuse stops before it",
                            i, list(block.layer_ids), block.nbytes)
                self._drop(key)
                break
            good.append(block)
            run.append(key)
        if not good:
            return 0
        reused = len(good) * self.block_tokens
        cache.begin(0, reused)
        try:
            for li, layer in enumerate(cache.layer_ids):
                k = torch.cat([b.keys[li] for b in good]).transpose(0, 1).unsqueeze(0)  # (1, Hkv, R, Dh)
                v = torch.cat([b.values[li] for b in good]).transpose(0, 1).unsqueeze(0)  # (1, Hkv, R, Dv)
                cache.update(k, v, layer)
        except BaseException:
            cache.abort()
            raise
        cache.commit()
        self._stats["hits"] += len(good)
        self._touch(run)
        return reused

    # --- pins and eviction -----------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> None:
        """Count a reference on each key: a pinned block is never evicted (a key need not be stored yet)."""
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Release one reference per key taken by ``pin``.

        Raises:
            ValueError: a key is not pinned (nothing is released then).
        """
        keys = list(keys)
        need: dict[bytes, int] = {}
        for key in keys:
            need[key] = need.get(key, 0) + 1
        for key, n in need.items():
            if self._pins.get(key, 0) < n:
                raise ValueError("unpin of a prefix block that is not pinned")
        for key, n in need.items():
            left = self._pins[key] - n
            if left:
                self._pins[key] = left
            else:
                del self._pins[key]

    def evict_to(self, nbytes_allowed: int) -> int:
        """Evict least-recently-used unpinned leaves until ``nbytes <= nbytes_allowed`` (or none is left):
        the stage calls it to make room for a live session.

        Args:
            nbytes_allowed: bytes the store may keep.
        Returns:
            Bytes freed (the store may stay above ``nbytes_allowed`` when pinned blocks hold it).
        """
        return self._evict(nbytes_allowed, frozenset())

    # --- internals -------------------------------------------------------------------------------

    def _copy_block(self, cache: KVCache, layer_ids: tuple[int, ...], i: int, parent: bytes) -> PrefixBlock:
        start, end = i * self.block_tokens, (i + 1) * self.block_tokens
        k = torch.stack([cache._keys[layer][0, start:end] for layer in layer_ids])  # (layers, bt, Hkv, Dh)
        v = torch.stack([cache._values[layer][0, start:end] for layer in layer_ids])  # (layers, bt, Hkv, Dv)
        nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        return PrefixBlock(k, v, layer_ids, i, parent, _checksum(k, v), nbytes)

    def _add(self, key: bytes, block: PrefixBlock) -> None:
        self._blocks[key] = block
        self._children[block.parent] = self._children.get(block.parent, 0) + 1
        self.nbytes += block.nbytes

    def _drop(self, key: bytes) -> int:
        block = self._blocks.pop(key)
        left = self._children[block.parent] - 1
        if left:
            self._children[block.parent] = left
        else:
            del self._children[block.parent]
        self.nbytes -= block.nbytes
        return block.nbytes

    def _evict(self, nbytes_allowed: int, protect: Iterable[bytes]) -> int:
        """Evict LRU-first unpinned, unprotected leaves until ``nbytes <= nbytes_allowed``; bytes freed."""
        protect = set(protect)
        freed = 0
        progress = True
        while self.nbytes > nbytes_allowed and progress:
            progress = False  # a pass may turn a parent later in the order into a leaf; another pass finds
            for key in list(self._blocks):  # earlier ones (only pins make a parent older than its child)
                if self.nbytes <= nbytes_allowed:
                    break
                if key in protect or self._pins.get(key) or self._children.get(key):
                    continue
                freed += self._drop(key)
                self._stats["evictions"] += 1
                progress = True
        return freed

    def _touch(self, run: Sequence[bytes]) -> None:
        """Mark a chain's blocks most recently used, the deepest first, so block 0 ends up the most
        recent: a chain is evicted from its end (as vLLM evicts, among blocks of equal last use, the one
        covering more tokens first)."""
        for key in reversed(run):
            if key in self._blocks:
                self._blocks.move_to_end(key)

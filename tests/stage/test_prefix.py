"""The stage's prefix store (swarm.stage.prefix): resumed == fresh at the KV level on real layer blocks,
scoping by namespace and ids, LRU eviction under a budget, pins, checksums, chains cut short."""

from __future__ import annotations

import hashlib
import logging
import struct

import pytest
import torch

from swarm.model.block import load_block
from swarm.model.cache import KVCache
from swarm.ranges import LayerRange
from swarm.stage.prefix import PrefixStore, chain_keys

B = 16  # block_tokens
HKV, DH = 2, 8  # the synthetic llama's KV heads and head dim


@pytest.fixture(scope="module")
def stages(synthetic):
    """A two-stage ring of the synthetic llama: head [0, 2) (ids in, hidden out), tail [2, 4) (logits out)."""
    model = synthetic("llama")
    return [load_block(model, LayerRange(a, b), dtype="float64", device="cpu") for a, b in [(0, 2), (2, 4)]]


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 97, (n,), generator=g).tolist()


def _run(stages, caches, ids, pos):
    """Positions ``[pos, len(ids))`` through both stages: (1, T, V) logits."""
    head, tail = stages
    h = head.forward(caches[0], pos, token_ids=torch.tensor([ids[pos:]]))
    return tail.forward(caches[1], pos, hidden=h)


def _rows(cache, n):
    return [(cache._keys[i][:, :n].clone(), cache._values[i][:, :n].clone()) for i in cache.layer_ids]


def _same_rows(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b))


def _random_cache(n: int, seed: int = 0, layer_ids=(0, 1), dtype=torch.float64) -> KVCache:
    """A cache holding n random committed rows per layer (no model: the store only moves bytes)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(list(layer_ids), 512)
    cache.begin(0, n)
    for layer in layer_ids:
        k, v = (torch.randn(1, HKV, n, DH, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
        cache.update(k, v, layer)
    cache.commit()
    return cache


BLOCK_BYTES = 2 * 2 * B * HKV * DH * 8  # K and V, 2 layers, float64


@pytest.mark.parametrize("how", ["prefill", "decode"])
def test_a_reused_prefix_gives_the_bits_of_a_fresh_prefill(stages, how):
    ids = _ids(75)
    old = [s.new_cache(128) for s in stages]
    if how == "prefill":  # the stored session prefilled 70 positions in one chunk
        _run(stages, old, ids[:70], 0)
    else:  # ... or computed them one position at a time, as decode steps do
        for p in range(70):
            _run(stages, old, ids[:p + 1], p)
    stores = [PrefixStore(B), PrefixStore(B)]
    assert [st.store("ns", ids[:70], c, 70) for st, c in zip(stores, old)] == [4, 4]  # whole blocks: 64 positions
    resumed = [s.new_cache(128) for s in stages]
    for st, c in zip(stores, resumed):
        keys = st.lookup("ns", ids, len(ids) - 1)
        assert len(keys) == 4
        assert st.load(keys, c) == 64 and c.kv_len == 64
    for c, o in zip(resumed, old):
        assert _same_rows(_rows(c, 64), _rows(o, 64))  # the rows the first session computed, bit for bit
    del old  # the stored blocks are copies: the first session's caches may go
    out = _run(stages, resumed, ids, 64)
    fresh = [s.new_cache(128) for s in stages]
    out_fresh = _run(stages, fresh, ids, 0)
    assert torch.equal(out, out_fresh[:, 64:])
    for c, f in zip(resumed, fresh):
        assert c.kv_len == f.kv_len == 75 and _same_rows(_rows(c, 75), _rows(f, 75))
    assert stores[1].stats["hits"] == 4 and stores[1].stats["misses"] == 0


def test_chain_keys_hash_the_ids_chained_from_the_namespace():
    ids = _ids(40)
    root = hashlib.sha256(b"ns").digest()
    k0 = hashlib.sha256(root + struct.pack(f"<{B}q", *ids[:B])).digest()
    k1 = hashlib.sha256(k0 + struct.pack(f"<{B}q", *ids[B:2 * B])).digest()
    assert chain_keys("ns", ids, B) == [k0, k1]  # the partial block 2 has no key
    assert chain_keys("ns", ids[:2 * B], B) == [k0, k1] and chain_keys("ns", ids[:B - 1], B) == []
    assert chain_keys("other", ids, B)[0] != k0
    with pytest.raises(ValueError):
        chain_keys("ns", [2**63] * B, B)


def test_namespaces_and_differing_ids_scope_the_reuse():
    ids = _ids(70)
    store = PrefixStore(B)
    store.store("a", ids, _random_cache(70), 70)
    assert store.lookup("b", ids, 69) == []  # another namespace never sees a's blocks
    other = list(ids)
    other[2 * B + 3] += 1  # a different token in block 2: blocks 0 and 1 still match
    keys = store.lookup("a", other, 69)
    assert len(keys) == 2
    assert store.load(keys, KVCache([0, 1], 512)) == 2 * B
    assert len(store.lookup("a", ids, 47)) == 2  # the limit caps the run at whole blocks
    assert len(store.lookup("a", ids, 69)) == 4
    assert store.stats["misses"] == 1 and store.stats["lookups"] == 4 and store.stats["hits"] == 2


def test_lru_eviction_under_an_int_budget_evicts_the_least_recently_used_chain_from_its_end():
    a, b, c = _ids(32, 1), _ids(32, 2), _ids(32, 3)
    store = PrefixStore(B, budget_bytes=4 * BLOCK_BYTES)
    store.store("ns", a, _random_cache(32, 1), 32)
    store.store("ns", b, _random_cache(32, 2), 32)
    assert store.nbytes == 4 * BLOCK_BYTES and store.stats["blocks"] == 4
    assert len(store.lookup("ns", a, 32)) == 2  # a is now more recent than b
    assert store.store("ns", c, _random_cache(32, 3), 32) == 2
    assert store.stats["evictions"] == 2 and store.nbytes == 4 * BLOCK_BYTES
    assert len(store.lookup("ns", a, 32)) == 2 and store.lookup("ns", b, 32) == []  # b went, a stayed
    store.store("ns", b, _random_cache(32, 2), 16)  # b's block 0 comes back: c (used before a) loses its leaf
    assert store.stats["evictions"] == 3 and len(store.lookup("ns", c, 32)) == 1  # c's end went, its block 0 stays
    assert len(store.lookup("ns", a, 32)) == 2 and len(store.lookup("ns", b, 32)) == 1


def test_a_callable_budget_is_read_at_each_store_and_evict_to_makes_room():
    allowed = {"n": 4 * BLOCK_BYTES}
    store = PrefixStore(B, budget_bytes=lambda: allowed["n"])
    a, b = _ids(64, 1), _ids(16, 2)
    assert store.store("ns", a, _random_cache(64, 1), 64) == 4
    allowed["n"] = 2 * BLOCK_BYTES  # live sessions took the rest
    assert store.store("ns", b, _random_cache(16, 2), 16) == 1
    assert store.nbytes == 2 * BLOCK_BYTES and store.stats["evictions"] == 3
    assert len(store.lookup("ns", a, 64)) == 1  # a's chain was evicted from its end: block 0 is still reusable
    assert store.evict_to(0) == 2 * BLOCK_BYTES and store.nbytes == 0 and len(store) == 0
    assert store.stats["evictions"] == 5 and store.evict_to(0) == 0


def test_pinned_blocks_survive_eviction_until_unpinned():
    a, b = _ids(48, 1), _ids(32, 2)
    store = PrefixStore(B, budget_bytes=4 * BLOCK_BYTES)
    store.store("ns", a, _random_cache(48, 1), 48)
    keys = store.lookup("ns", a, 48)
    store.pin(keys)
    store.pin(keys[:1])  # counts: block 0 twice
    assert store.store("ns", b, _random_cache(32, 2), 32) == 1  # one free block's room, a's are pinned
    assert store.stats["evictions"] == 0 and store.nbytes == 4 * BLOCK_BYTES
    assert store.evict_to(0) == BLOCK_BYTES  # only b's block 0 goes
    assert len(store.lookup("ns", a, 48)) == 3
    store.unpin(keys)
    assert store.evict_to(BLOCK_BYTES) == 2 * BLOCK_BYTES  # blocks 2, 1 go; block 0 is still pinned once
    assert store.evict_to(0) == 0 and len(store) == 1
    store.unpin(keys[:1])
    assert store.evict_to(0) == BLOCK_BYTES and len(store) == 0
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin(keys[:1])


def test_a_chain_that_does_not_fit_keeps_a_leading_run_and_never_evicts_its_own_blocks():
    ids = _ids(64)
    store = PrefixStore(B, budget_bytes=int(2.5 * BLOCK_BYTES))
    assert store.store("ns", ids, _random_cache(64), 64) == 2
    keys = store.lookup("ns", ids, 64)
    assert len(keys) == 2 and keys == chain_keys("ns", ids, B)[:2] and store.stats["evictions"] == 0
    assert store.store("ns", ids, _random_cache(64), 64) == 0  # blocks 0, 1 are its own parents: kept
    assert len(store.lookup("ns", ids, 64)) == 2 and store.stats["evictions"] == 0
    assert PrefixStore(B, budget_bytes=BLOCK_BYTES - 1).store("ns", ids, _random_cache(64), 64) == 0


def test_a_corrupted_block_is_detected_dropped_and_recomputed(stages, caplog):
    ids = _ids(70)
    head = stages[0]
    store = PrefixStore(B)
    old = head.new_cache(128)
    head.forward(old, 0, token_ids=torch.tensor([ids]))
    store.store("ns", ids, old, 70)
    keys = store.lookup("ns", ids, 69)
    blk = store.block(keys[2])
    assert blk.index == 2
    blk.values[1].view(torch.int64)[3, 0, 0] ^= 1  # one bit of one value of block 2 flips in memory
    cache = head.new_cache(128)
    with caplog.at_level(logging.WARNING, logger="swarm.stage.prefix"):
        assert store.load(keys, cache) == 2 * B  # blocks 0 and 1 reused, 2 dropped, nothing after it
    assert store.stats["checksum_failures"] == 1 and keys[2] not in store and keys[3] in store
    assert store.stats["hits"] == 2 and len(store.lookup("ns", ids, 69)) == 2  # block 3 is unreachable now
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "block=2" in rec.getMessage() and rec.args[:2] == (2, [0, 1])  # index, layers, bytes: no token ids
    out = head.forward(cache, 2 * B, token_ids=torch.tensor([ids[2 * B:]]))
    fresh = head.new_cache(128)
    out_fresh = head.forward(fresh, 0, token_ids=torch.tensor([ids]))
    assert torch.equal(out, out_fresh[:, 2 * B:]) and _same_rows(_rows(cache, 70), _rows(fresh, 70))
    assert store.store("ns", ids, cache, 70) == 1  # block 2 again: 3 is reachable (and right) once more
    assert len(store.lookup("ns", ids, 69)) == 4


def test_store_keeps_only_valid_rows_and_dedupes():
    ids = _ids(70)
    store = PrefixStore(B)
    cache = _random_cache(70)
    assert store.store("ns", ids, cache, 40) == 2  # rows [0, 40): 2 whole blocks
    assert store.store("ns", ids, cache, 70) == 2  # blocks 0, 1 already there
    assert store.stats["stored"] == 4 and store.stats["blocks"] == 4 and store.stats["bytes"] == 4 * BLOCK_BYTES
    assert store.store("ns", ids, cache, 15) == 0
    with pytest.raises(ValueError, match="valid"):
        store.store("ns", ids, cache, 71)  # past kv_len
    with pytest.raises(ValueError, match="valid"):
        store.store("ns", ids[:30], cache, 40)  # past the ids
    keys = store.lookup("ns", ids, 69)
    with pytest.raises(ValueError, match="empty cache"):
        store.load(keys, cache)
    with pytest.raises(ValueError, match="layers"):
        store.load(keys, KVCache([2, 3], 512))
    with pytest.raises(ValueError):
        PrefixStore(0)


def test_a_bfloat16_cache_round_trips():
    ids = _ids(40)
    store = PrefixStore(B)
    old = _random_cache(40, dtype=torch.bfloat16)
    assert store.store("ns", ids, old, 40) == 2 and store.nbytes == BLOCK_BYTES // 2
    cache = KVCache([0, 1], 512)
    assert store.load(store.lookup("ns", ids, 40), cache) == 2 * B
    assert cache._keys[0].dtype == torch.bfloat16 and _same_rows(_rows(cache, 32), _rows(old, 32))


@pytest.mark.gpu
def test_a_cuda_cache_round_trips():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ids = _ids(40)
    old = KVCache([0, 1], 512)
    old.begin(0, 40)
    for layer in (0, 1):
        old.update(*(torch.randn(1, HKV, 40, DH, device="cuda", dtype=torch.bfloat16) for _ in range(2)), layer)
    old.commit()
    store = PrefixStore(B)
    assert store.store("ns", ids, old, 40) == 2 and store.block(chain_keys("ns", ids, B)[0]).keys.is_cuda
    cache = KVCache([0, 1], 512)
    assert store.load(store.lookup("ns", ids, 40), cache) == 2 * B
    assert _same_rows(_rows(cache, 32), _rows(old, 32))

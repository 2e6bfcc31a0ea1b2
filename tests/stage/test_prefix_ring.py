"""Prefix KV reuse across sessions (issue 17) on in-process rings: real StageServers on real libp2p
hosts (loopback), one coordinator identity for every turn.

The contract is resumed == fresh: a conversation whose turns reuse the stages' cached prefix
blocks gives bit for bit the ids of the same conversation on stages without a prefix cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from swarm.config import RingSpec, SpecConfig
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient
from swarm.coordinator.drafters import NgramDrafter
from swarm.errors import collapse
from swarm.model.block import model_num_layers
from swarm.model.resolve import model_manifest_digest
from swarm.transport import load_or_create_key, open_host
from tests.support.ring import LOOPBACK, start_ring

pytestmark = pytest.mark.ring

RANGES = [(0, 1), (1, 3), (3, 4)]
FIRST = [1, 5, 9, 3, 7, 2, 8, 4, 6, 11, 12, 13, 14, 15]
TURNS = [FIRST, [21, 22, 23], [31, 32, 33, 34], [41, 42], [51, 52, 53]]  # 5 turns: each appends to the history
NEW = 7
BLOCK = 4


async def _converse(ring: RingClient, turns, prefix_cache: bool, spec_config=None, sampling=None, on_turn=None):
    """Each turn's prompt is the history (earlier prompts and answers) plus its new ids."""
    history, outs, cached = [], [], []
    for t, new in enumerate(turns):
        prompt = history + list(new)
        if on_turn is not None:
            await on_turn(t)
        options = DecodeOptions(NEW, spec=spec_config, drafter=NgramDrafter() if spec_config else None,
                                sampling=sampling, prefix_cache=prefix_cache)
        decoded = await decode(ring, prompt, options)
        out, rec = decoded.output_ids, decoded.as_record()
        outs.append(out)
        cached.append(rec["cached_tokens"])
        history = prompt + out
    return outs, cached


def converse(model_dir: Path, key_dir: Path, *, prefix_cache: bool = True, turns=TURNS, spec_config=None,
             sampling=None, conversations: int = 1, on_turn=None, **stage_kwargs):
    """Run ``conversations`` conversations one after another on one fresh in-process ring; returns
    ([(outs, cached) per conversation], the stage servers)."""
    stage_kwargs.setdefault("prefix_block", BLOCK)

    async def main():
        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, RANGES, key_dir, **stage_kwargs)
                async with open_host(load_or_create_key(key_dir / "coord.key"), [LOOPBACK]) as host, \
                        trio.open_nursery() as inner:
                    ring = RingClient(host, spec, 30.0, 10.0)
                    await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), inner)
                    got = []
                    for c in range(conversations):
                        conv_turns = [list(turns[0])] + [[x + 50 * c for x in t] for t in turns[1:]]
                        hook = (lambda t, c=c: on_turn(c, t, servers)) if on_turn else None
                        got.append(await _converse(ring, conv_turns, prefix_cache, spec_config, sampling, hook))
                    inner.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        return got, servers

    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def record_kv_at_close(monkeypatch) -> list:
    """Patch every StageServer to note, when a session closes, (its layers, a digest of the bytes of
    every KV row it holds): two runs whose sessions held the same bits note the same list."""
    import hashlib

    from swarm.frames import Close
    from swarm.stage.server import StageServer

    noted: list = []
    real = StageServer.dispatch

    async def dispatch(self, stream, msg):
        sess = self.sessions.get(msg.session) if isinstance(msg, Close) else None
        if sess is not None:
            c, h = sess.cache, hashlib.sha256()
            for layer in c.layer_ids:
                for buf in (c._keys[layer], c._values[layer]):
                    h.update(buf[:, :c.kv_len].contiguous().view(torch.uint8).numpy().tobytes())
            noted.append((tuple(sess.span.as_list()), c.kv_len, h.hexdigest()))
        return await real(self, stream, msg)

    monkeypatch.setattr(StageServer, "dispatch", dispatch)
    return noted


def _expected_min_cached(turns, outs, block: int = BLOCK) -> list[int]:
    """What every turn after the first can reuse at least: the whole blocks of the previous turn's
    prompt + answer except its last token (never fed), capped below this prompt's last position."""
    history, want = [], []
    for t, new in enumerate(turns):
        prompt = history + list(new)
        if t == 0:
            want.append(0)
        else:
            kept = (len(history) - 1) // block * block
            want.append(min(kept, (len(prompt) - 1) // block * block))
        history = prompt + outs[t]
    return want


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2"])
def test_resumed_equals_fresh_over_five_turns(synthetic, tmp_path, family, monkeypatch):
    model = synthetic(family)
    kv = record_kv_at_close(monkeypatch)
    [(fresh, fresh_cached)], _ = converse(model, tmp_path / "a", prefix_cache=False)
    kv_fresh = list(kv)
    kv.clear()
    [(resumed, cached)], servers = converse(model, tmp_path / "b")
    assert resumed == fresh
    # every stage's KV rows at the end of every turn: the same bits (the stages' close frames may arrive in
    # either order, so the records are compared as sets of (span, kv_len, digest))
    assert len(kv) == 15 and sorted(kv) == sorted(kv_fresh)
    assert fresh_cached == [0] * 5
    assert cached == _expected_min_cached(TURNS, fresh), cached
    for s in servers:
        st = s.prefix_stats()
        assert st["hits"] > 0 and st["stored"] > 0 and st["checksum_failures"] == 0


def test_resumed_equals_fresh_with_speculation_and_seeded_sampling(synthetic, tmp_path, monkeypatch):
    from swarm.config import SamplingParams

    model = synthetic("llama")
    spec = SpecConfig(k=3, depth=2, prefill_chunk=5)
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    kv = record_kv_at_close(monkeypatch)
    [(fresh, _)], _ = converse(model, tmp_path / "a", prefix_cache=False, spec_config=spec, sampling=sampling)
    kv_fresh = list(kv)
    kv.clear()
    [(resumed, cached)], _ = converse(model, tmp_path / "b", spec_config=spec, sampling=sampling)
    assert resumed == fresh
    committed = [(layers, n) for layers, n, _ in kv]  # speculation may leave rejected rows past the commit
    assert committed == [(layers, n) for layers, n, _ in kv_fresh] and kv == kv_fresh
    assert all(c > 0 for c in cached[1:]), cached


def test_batched_sessions_reuse_exactly(synthetic, tmp_path):
    """``swarm serve`` sessions may be packed (--batch-tile GEMMs): their cache is scoped by the tile."""
    model = synthetic("llama")

    async def main(key_dir, prefix_cache):
        async with trio.open_nursery() as nursery:
            spec, _ = await start_ring(nursery, model, RANGES, key_dir, prefix_block=BLOCK)
            async with open_host(load_or_create_key(key_dir / "coord.key"), [LOOPBACK]) as host, \
                    trio.open_nursery() as inner:
                ring = RingClient(host, spec, 30.0, 10.0, batch=True)
                await ring.connect(4, model_manifest_digest(model), inner)
                got = await _converse(ring, TURNS, prefix_cache)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
        return got

    fresh, _ = trio.run(main, tmp_path / "a", False)
    resumed, cached = trio.run(main, tmp_path / "b", True)
    assert resumed == fresh and cached[1:] == _expected_min_cached(TURNS, fresh)[1:]


def test_conversations_sharing_a_system_prompt_share_its_blocks(synthetic, tmp_path):
    model = synthetic("llama")
    [(a, ca), (b, cb)], servers = converse(model, tmp_path, conversations=2, turns=TURNS[:2])
    [(fa, _), (fb, _)], _ = converse(model, tmp_path / "fresh", prefix_cache=False, conversations=2,
                                     turns=TURNS[:2])
    assert (a, b) == (fa, fb)
    # the second conversation's first turn is the same system prompt: its leading blocks come from the first's
    assert cb[0] == (len(FIRST) - 1) // BLOCK * BLOCK > 0
    for s in servers:  # stored once: the second conversation added only blocks past the shared prompt
        st = s.prefix_stats()
        total_positions = len(FIRST) + NEW + len(TURNS[1]) + NEW
        assert st["blocks"] <= 2 * (total_positions // BLOCK) - (len(FIRST) - 1) // BLOCK


def test_a_small_kv_budget_evicts_cold_prefixes_never_a_live_session(synthetic, tmp_path):
    model = synthetic("llama")
    [(fresh, _)], _ = converse(model, tmp_path / "a", prefix_cache=False)
    # room for one session's reservation (the longest turn's max_len) and a few blocks, not for all of them
    from swarm.model.block import load_block
    from swarm.ranges import LayerRange

    block = load_block(model, LayerRange(1, 3), dtype="float64", device="cpu")
    longest = sum(len(t) for t in TURNS) + NEW * len(TURNS)
    need = longest * (block.kv_bytes_per_position() + block.hidden_size * 8)
    budget_mb = (need + 6 * BLOCK * block.kv_bytes_per_position()) / 2**20
    [(resumed, cached)], servers = converse(model, tmp_path / "b", kv_budget_mb=budget_mb)
    assert resumed == fresh
    middle = servers[1].prefix_stats()
    assert middle["evictions"] > 0, middle
    assert middle["bytes"] <= middle["budget_bytes"] + 1 or middle["bytes"] <= 6 * BLOCK * block.kv_bytes_per_position()


def test_prefix_cache_off_at_a_stage_means_no_reuse_and_same_ids(synthetic, tmp_path):
    model = synthetic("llama")
    [(fresh, _)], _ = converse(model, tmp_path / "a", prefix_cache=False)
    [(resumed, cached)], servers = converse(model, tmp_path / "b", prefix_cache_mb=0.0)
    assert resumed == fresh and cached == [0] * 5
    assert all(s.prefix_stats() is None for s in servers)


def test_a_corrupted_block_at_one_stage_is_recomputed_and_the_ids_stay_exact(synthetic, tmp_path):
    model = synthetic("llama")
    [(fresh, _)], _ = converse(model, tmp_path / "a", prefix_cache=False, turns=TURNS[:3])

    async def corrupt(conversation, turn, servers):
        if turn == 1:  # before the second turn: one value of block 1 flips in the middle stage's memory
            blocks = servers[1].prefix._blocks

            def second_block():
                return next((b for b in blocks.values() if b.parent in blocks and blocks[b.parent].parent not in blocks),
                            None)

            # the first turn's blocks are kept once the stage has read the coordinator's close, which
            # may still be on its way when decode returns (the coordinator does not wait for close_ok)
            with trio.fail_after(10):
                while servers[1].sessions or servers[1].reuse.storing or second_block() is None:
                    await trio.sleep(0.01)
            second_block().keys[0, 0, 0, 0] += 1e-9

    [(resumed, cached)], servers = converse(model, tmp_path / "b", turns=TURNS[:3], on_turn=corrupt)
    assert resumed == fresh
    assert cached[1] == BLOCK  # the middle stage reused only block 0: everyone else rolled back to it
    assert servers[1].prefix_stats()["checksum_failures"] == 1
    assert cached[2] == _expected_min_cached(TURNS[:3], fresh)[2]  # the next turn reuses in full again


@pytest.mark.parametrize("victim", [1, 0], ids=["middle", "head"])
def test_a_heal_during_a_resumed_request_stays_exact(synthetic, tmp_path, victim):
    """Turn 2 reuses turn 1's prefix; a stage dies mid-answer and a spare (no prefix) takes over: the
    predecessor's log of sent states does not reach back past the reuse, so the heal replays in full."""
    from tests.support.ring import start_stages

    model = synthetic("llama")
    [(fresh, _)], _ = converse(model, tmp_path / "fresh", prefix_cache=False, turns=TURNS[:2])

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                ring = await start_stages(nursery, model, RANGES, tmp_path, "s", prefix_block=BLOCK)
                (spare,) = await start_stages(nursery, model, [RANGES[victim]], tmp_path, "spare", prefix_block=BLOCK)
                spec = RingSpec(model=str(model), stages=tuple(s for s, _, _ in ring), spares=(spare[0],))
                async with open_host(load_or_create_key(tmp_path / "c.key"), [LOOPBACK]) as host, \
                        trio.open_nursery() as inner:
                    client = RingClient(host, spec, 30.0, 10.0, heartbeat_s=1.0)
                    await client.connect(4, model_manifest_digest(model), inner)
                    out1 = (await decode(client, TURNS[0], DecodeOptions(NEW, prefix_cache=True))).output_ids
                    prompt = TURNS[0] + out1 + TURNS[1]
                    fired = []

                    def on_ids(out):
                        if len(out) >= 3 and not fired:
                            ring[victim][2].cancel()
                            fired.append(len(out))

                    decoded = await decode(client, prompt, DecodeOptions(NEW, prefix_cache=True), on_ids=on_ids)
                    out2, rec = decoded.output_ids, decoded.as_record()
                    inner.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        assert fired
        return [out1, out2], rec

    try:
        outs, rec = trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    assert outs == fresh
    assert rec["cached_tokens"] > 0 and len(rec["heal_events"]) == 1


def test_a_resumed_job_receipt_verifies_and_says_what_was_reused(synthetic, tmp_path):
    import json

    from swarm import receipts
    from swarm.coordinator.jobs import write_job_receipt

    model = synthetic("llama")

    async def main():
        async with trio.open_nursery() as nursery:
            spec, _ = await start_ring(nursery, model, RANGES, tmp_path, prefix_block=BLOCK)
            key = load_or_create_key(tmp_path / "coord.key")
            async with open_host(key, [LOOPBACK]) as host, trio.open_nursery() as inner:
                ring = RingClient(host, spec, 30.0, 10.0)
                digest = model_manifest_digest(model)
                await ring.connect(4, digest, inner)
                out1 = (await decode(ring, TURNS[0], DecodeOptions(NEW, prefix_cache=True))).output_ids
                prompt = TURNS[0] + out1 + TURNS[1]
                job = {"id": "resumed-job", "nonce": receipts.new_nonce()}
                decoded = await decode(ring, prompt, DecodeOptions(NEW, job=job, prefix_cache=True))
                out, rec = decoded.output_ids, decoded.as_record()
                res = write_job_receipt(tmp_path / "receipts", key, job, rec.pop("receipt_parts"), model=model.name,
                                        model_digest=digest, num_layers=4, prompt_ids=prompt, output_ids=out,
                                        ring=[i.entry() for i in ring.infos], record=rec)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
        return rec, res

    rec, res = trio.run(main)
    assert res["verified"], res
    doc = json.loads(open(res["path"]).read())
    receipts.verify_job(doc)
    reused = [r.get("reused") for r in doc["stage_receipts"]]
    assert rec["cached_tokens"] > 0 and all(n is not None and n >= rec["cached_tokens"] for n in reused), reused

"""Continuous batching at a stage: several sessions' rows in one packed forward, each session's
result bit-identical to its solo run (exactness contract 4), long prompts sliced between decode rows."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import trio

from swarm import wire
from swarm.config import ConfigError, SamplingParams, StageConfig
from swarm.kernels import invariant
from swarm.kernels.check import check_block
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from swarm.stage.server import StageServer
from swarm.transport import load_or_create_key
from swarm.transport.identity import peer_id_of
from tests.support.models import FAMILY_CONFIGS
from tests.support.streams import MemStream, NoNetwork

TILE = 2  # the stage default (--batch-tile)
PROMPTS = [5, 9, 1, 13]  # prompt lengths of four sessions
# each step: session -> (rows, rollback): which sessions are ready together, with how many rows
# (1: decode, 3: a verify chunk) and how many earlier positions they roll back (rejected drafts)
STEPS = [{0: (1, 0), 1: (1, 0)}, {0: (3, 0), 1: (1, 0), 2: (1, 0), 3: (1, 0)}, {1: (1, 0), 3: (2, 0)},
         {0: (1, 2), 2: (3, 0), 3: (1, 0)}, {0: (2, 0), 1: (1, 0), 2: (1, 1), 3: (1, 0)}]


def _input(block, t: int, gen: torch.Generator) -> torch.Tensor:
    if block.is_head:
        return torch.randint(0, block.vocab_size, (1, t), generator=gen)
    return torch.randn(1, t, block.hidden_size, generator=gen, dtype=torch.float64).to(block.dtype)


def _plan(block, seed: int = 0):
    """Inputs per session: the prompt, then one chunk per step it takes part in, with positions."""
    gen = torch.Generator().manual_seed(seed)
    plan = {i: [(0, _input(block, n, gen))] for i, n in enumerate(PROMPTS)}
    end = dict(enumerate(PROMPTS))
    steps = []
    for step in STEPS:
        rows = {}
        for i, (t, back) in step.items():
            pos = end[i] - back
            rows[i] = (pos, _input(block, t, gen))
            end[i] = pos + t
        steps.append(rows)
    return plan, steps


def _run_solo(block, plan, steps, i):
    cache = block.new_cache()
    outs = [block.forward_batch([(cache, 0, plan[i][0][1])], tile=TILE)[0]]
    for rows in steps:
        if i in rows:
            pos, x = rows[i]
            outs.append(block.forward_batch([(cache, pos, x)], tile=TILE)[0])
    return outs


def _run_batched(block, plan, steps, seed: int):
    rng = random.Random(seed)
    caches = {i: block.new_cache() for i in plan}
    outs = {i: [block.forward_batch([(caches[i], 0, plan[i][0][1])], tile=TILE)[0]] for i in plan}
    for rows in steps:
        order = list(rows)
        rng.shuffle(order)  # a session's place in the packed step must not matter either
        ys = block.forward_batch([(caches[i], *rows[i]) for i in order], tile=TILE)
        for i, y in zip(order, ys):
            outs[i].append(y)
    return outs


def _assert_bitwise(block, plan, steps):
    batched = _run_batched(block, plan, steps, seed=1)
    for i in plan:
        solo = _run_solo(block, plan, steps, i)
        assert len(solo) == len(batched[i])
        for k, (a, b) in enumerate(zip(solo, batched[i])):
            assert a.shape == b.shape and torch.equal(a, b), f"session {i} output {k} differs by " \
                                                             f"{(a.double() - b.double()).abs().max().item():.3g}"


# widths that are not multiples of the CPU's vector length: a row's place in the packed tensor then
# decides which elements a vectorized kernel leaves to its scalar tail loop
ODD = {"gpt2": dict(n_embd=40, n_inner=172)}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("part", [(0, 2), (2, 4)])
@pytest.mark.parametrize("tile", [2, 4])
def test_packed_forward_is_bit_identical_to_solo(synthetic, family, part, tile, monkeypatch):
    monkeypatch.setitem(globals(), "TILE", tile)
    odd = ODD.get(family, dict(hidden_size=40, intermediate_size=172))
    block = load_block(synthetic(family, "float32", **odd), LayerRange(*part), dtype="float32", device="cpu")
    plan, steps = _plan(block)
    _assert_bitwise(block, plan, steps)


@pytest.mark.parametrize("tile", [2, 4])
def test_packed_forward_is_bit_identical_to_solo_at_a_realistic_width(synthetic, tile, monkeypatch):
    """576-wide rows (SmolLM2's width): plain GEMMs here give a row different bits depending on how
    many rows share them; the fixed tiles must not."""
    monkeypatch.setitem(globals(), "TILE", tile)
    model = synthetic("llama", "float32", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                      num_key_value_heads=3, num_hidden_layers=2, vocab_size=2048)
    for part in ((0, 1), (1, 2)):
        block = load_block(model, LayerRange(*part), dtype="float32", device="cpu")
        assert check_block(block, TILE).ok
        plan, steps = _plan(block, seed=part[0])
        _assert_bitwise(block, plan, steps)


@pytest.mark.parametrize("tile", [2, 4])
def test_real_model_packed_forward_is_bit_identical(stories_dir, tile, monkeypatch):
    monkeypatch.setitem(globals(), "TILE", tile)
    for part in ((0, 5), (0, 2), (2, 5)):
        block = load_block(stories_dir, LayerRange(*part), dtype="float32", device="cpu")
        plan, steps = _plan(block, seed=part[0])
        _assert_bitwise(block, plan, steps)


def test_a_bad_chunk_in_a_packed_step_writes_no_cache(synthetic):
    block = load_block(synthetic("llama", "float32"), LayerRange(0, 4), dtype="float32", device="cpu")
    a, b = block.new_cache(), block.new_cache()
    block.forward_batch([(a, 0, torch.tensor([[1, 2, 3]])), (b, 0, torch.tensor([[4]]))], tile=TILE)
    with pytest.raises(Exception, match="not contiguous"):
        block.forward_batch([(a, 3, torch.tensor([[5]])), (b, 7, torch.tensor([[6]]))], tile=TILE)
    assert (a.kv_len, b.kv_len) == (3, 1)


def test_batching_flags_are_checked(tmp_path):
    for bad in (dict(max_batch_rows=0), dict(batch_tile=-1), dict(batch_tile=0), dict(prefill_slice=0),
                dict(batch_tile=True), dict(batch_wait_ms=-1.0), dict(batch_wait_ms=float("nan"))):
        with pytest.raises(ConfigError):
            StageConfig.of(model="m", layers=LayerRange(0, 1), **bad)


# ---- the scheduler ------------------------------------------------------------------------------


def _server(model, layers, keys, **kwargs):
    block = load_block(model, layers, dtype="float32", device="cpu")
    server = StageServer(StageConfig.of(model=str(model), layers=layers, **kwargs), block, "synthetic", "d" * 64,
                         key=load_or_create_key(keys / "stage.key"))
    server.host = NoNetwork(peer_id_of(server.key))
    return server


def _drive(server, coord, sessions: dict, sampled: set = frozenset(), steps_log=None, batch: bool = True,
           row_gap_s: float = 0.0, max_len: int = 128, slice_s: float = 0.0):
    """Feed each session's prompt, then decode its tokens one at a time, all sessions at once, through
    the stage's real frame handler and scheduler. ``sessions``: sid -> (prompt ids, new tokens);
    ``row_gap_s``: a pause before each next row (the rest of a ring's round trip); ``slice_s``: seconds
    each step with a prompt's slice waits before its compute (outside the step's measured time), as
    a bigger model's slice would take: a test that needs a session's next row to arrive while a
    prompt still has slices to go must not depend on how fast this machine computes the tiny one."""
    c = MemStream(peer_id_of(coord))
    if steps_log is not None:
        compute = server.scheduler._compute_step

        def logged(plan, resuming=None):
            long = plan.long
            steps_log.append(([(s.session_id, j.msg.pos, j.x.shape[1]) for s, j in plan.short],
                              None if long is None else (long.session.session_id, long.job.done)))
            if long is not None and slice_s:
                time.sleep(slice_s)  # the worker thread: a slice never runs inline
            return compute(plan, resuming)

        server.scheduler._compute_step = logged

    async def one(sid, prompt, new):
        extra = {"sampling": SamplingParams(temperature=0.9, seed=7).to_wire()} if sid in sampled else {}
        if batch:
            extra["batch"] = True
        await server.handle_frame(c, wire.open_frame(coord, sid, None, max_len, **extra).to_wire())
        out, pos, feed = [], 0, list(prompt)
        for step in range(new):
            await server.handle_frame(c, wire.frame("forward", session=sid, epoch=0, pos=pos, chunk=step, tokens=feed))
            while True:
                got = [x for x in c.sent if x.get("session") == sid and x.get("type") in ("result", "error")]
                if len(got) > step:
                    break
                await trio.sleep(0.002)  # (a busy loop would starve the worker thread of the GIL)
            assert got[-1]["type"] == "result", got[-1]
            out.append(got[-1]["token_ids"][-1])
            pos, feed = pos + len(feed), [out[-1]]
            await trio.sleep(row_gap_s)
        await server.handle_frame(c, wire.frame("close", session=sid))
        return out

    async def main():
        results = {}
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                server.nursery = nursery
                nursery.start_soon(server.scheduler.run)
                async with trio.open_nursery() as clients:
                    for sid, (prompt, new) in sessions.items():
                        async def run(sid=sid, prompt=prompt, new=new):
                            results[sid] = await one(sid, prompt, new)
                        clients.start_soon(run)
                nursery.cancel_scope.cancel()
        return results

    return trio.run(main)


def test_scheduler_batches_sessions_and_slices_a_long_prompt(synthetic, tmp_path):
    """Sessions that are ready together share a forward; a long prompt goes a slice per step, with
    the other sessions' decode rows in between; every session gets exactly its solo tokens."""
    model = synthetic("llama", "float32")
    coord = load_or_create_key(tmp_path / "coord.key")
    rng = random.Random(3)
    sessions = {f"s{i}": ([rng.randrange(97) for _ in range(n)], 6) for i, n in enumerate([3, 5, 2, 7, 4])}
    sessions["long"] = ([rng.randrange(97) for _ in range(100)], 3)
    sampled = {"s1", "s3"}
    log: list = []
    server = _server(model, LayerRange(0, 4), tmp_path, prefill_slice=16, prefill_slice_shared=16,
                     prefill_piggyback=False)  # fixed slices (sized by cost: test_a_long_prompt_rides_along_...)
    together = _drive(server, coord, sessions, sampled, steps_log=log)
    for sid, job in sessions.items():
        alone = _drive(_server(model, LayerRange(0, 4), tmp_path, prefill_slice=16, prefill_slice_shared=16), coord,
                       {sid: job}, sampled)
        assert together[sid] == alone[sid], sid
    stats = server.stats
    assert stats["max_sessions"] >= 3 and stats["batched_steps"] >= 3, stats
    slices = [i for i, (_, piece) in enumerate(log) if piece and piece[0] == "long"]
    assert len(slices) == 7  # 100 positions, 16 per slice
    between = [small for small, _ in log[slices[0]:slices[-1] + 1] if any(pos > 0 for _, pos, _ in small)]
    assert between, "no decode row ran while the long prompt was being computed"
    assert server.sessions == {} and not server.scheduler._runq


def test_a_long_prompt_yields_to_sessions_with_work_waiting(synthetic, tmp_path):
    """While other sessions have rows waiting, a long prompt advances --prefill-slice-shared rows
    per step; alone, --prefill-slice rows; and every session still gets its solo tokens."""
    model = synthetic("llama", "float32")
    coord = load_or_create_key(tmp_path / "coord.key")
    rng = random.Random(4)
    sessions = {"short": ([rng.randrange(97) for _ in range(3)], 8),
                "long": ([rng.randrange(97) for _ in range(60)], 2)}
    log: list = []  # (the slices' sizes by cost while a row is due: test_a_long_prompt_rides_along_...)
    server = _server(model, LayerRange(0, 4), tmp_path, prefill_slice=32, prefill_slice_shared=2,
                     prefill_piggyback=False)
    together = _drive(server, coord, sessions, steps_log=log, slice_s=0.01)
    for sid, job in sessions.items():
        alone = _drive(_server(model, LayerRange(0, 4), tmp_path, prefill_slice=32), coord, {sid: job})
        assert together[sid] == alone[sid], sid
    # the long prompt's slices: (step, positions done before it); a row that arrives mid-slice pauses
    # the slice (a step of its own, then the slice resumes: tests/stage/test_batching.py's overtake
    # tests), so whether a row and a slice share a step is timing; the slice's size is not
    slices = [(i, p[1]) for i, (_, p) in enumerate(log) if p and p[0] == "long"]
    widths = [(i, b - a) for (i, a), (_, b) in zip(slices, slices[1:])]
    decoding = [i for i, (small, _) in enumerate(log) if any(sid == "short" and pos > 0 for sid, pos, _ in small)]
    during = [w for i, w in widths if decoding[0] <= i < decoding[-1]]
    assert during and set(during) == {2}, log  # while the short session decodes: 2 rows a step
    alone = [w for i, w in widths if i > decoding[-1]]
    assert 32 in alone or slices[-1][1] + 32 >= 60, widths  # and full slices once it is alone


@pytest.mark.parametrize("piggyback", [True, False])
def test_a_long_prompt_rides_along_with_a_decoding_sessions_rows(synthetic, tmp_path, piggyback):
    """While another session decodes (its next row due), a long prompt's rows only ride along in its
    steps, and wait for its rows in between (Sarathi-Serve's stall-free batching; --no-prefill-piggyback
    turns it off: slices alone between its rows); once that session is gone, full slices. Every session
    still gets its solo tokens (the sizes are pure: tests/stage/test_scheduler.py)."""
    model = synthetic("llama", "float32")
    coord = load_or_create_key(tmp_path / "coord.key")
    rng = random.Random(6)
    sessions = {"short": ([rng.randrange(97) for _ in range(3)], 12),
                "long": ([rng.randrange(97) for _ in range(120)], 2)}
    log: list = []
    server = _server(model, LayerRange(0, 4), tmp_path, prefill_slice=32, prefill_slice_shared=2,
                     prefill_piggyback=piggyback)
    together = _drive(server, coord, sessions, steps_log=log, row_gap_s=0.02, slice_s=0.01)  # the row: 20 ms away
    for sid, job in sessions.items():
        assert _drive(_server(model, LayerRange(0, 4), tmp_path, prefill_slice=32), coord, {sid: job}) == \
            {sid: together[sid]}, sid
    decoding = [i for i, (small, _) in enumerate(log) if any(sid == "short" and pos > 0 for sid, pos, _ in small)]
    during = [small for small, piece in log[decoding[0]:decoding[-1]] if piece and piece[0] == "long"]
    alone = [small for small in during if not small]
    if piggyback:  # it rode along (sized by a measured row's cost) and waited for the rows in between
        assert during and not alone and server.stats["prefill_waits"] > 0, log
        assert server.scheduler.costs.row_s is not None, log
    else:
        assert during, log  # the long prompt went on while the short session decoded
        assert alone and server.stats["prefill_waits"] == 0, log  # slices alone between its rows


@pytest.mark.parametrize("fails", [False, True], ids=["goes-on", "fails-going-on"])
def test_a_decode_row_overtakes_a_long_prompt_slice_between_layers(synthetic, tmp_path, monkeypatch, fails):
    """A chunk that arrives while a long prompt's slice is computed alone pauses that slice at its next
    layer: the new session's rows are computed (and answered) first, then the slice goes on; both
    sessions get their solo tokens, bit for bit. A slice that fails going on fails its session only."""
    model = synthetic("llama", "float32")
    coord = load_or_create_key(tmp_path / "coord.key")
    rng = random.Random(8)
    prompts = {"long": [rng.randrange(97) for _ in range(60)], "short": [rng.randrange(97) for _ in range(3)]}
    solo = {sid: _drive(_server(model, LayerRange(0, 4), tmp_path, prefill_slice=64), coord, {sid: (p, 1)})[sid]
            for sid, p in prompts.items()}
    server = _server(model, LayerRange(0, 4), tmp_path, prefill_slice=64)
    block = server.scheduler.block
    in_slice, arrived = threading.Event(), threading.Event()
    plain = block.forward_steps

    def watched(rows, *args, **kwargs):  # the long slice holds after its first layer until the row is queued
        steps, first = plain(rows, *args, **kwargs), rows[0][2].shape[1] == 60
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            if first:
                first = False
                in_slice.set()
                arrived.wait(10)
            yield
            if fails and rows[0][2].shape[1] == 60:
                raise RuntimeError("a torch failure")

    monkeypatch.setattr(block, "forward_steps", watched)
    c = MemStream(peer_id_of(coord))

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                server.nursery = nursery
                nursery.start_soon(server.scheduler.run)
                for sid in ("long", "short"):
                    if sid == "short":
                        assert await trio.to_thread.run_sync(in_slice.wait, 10)
                    await server.handle_frame(c, wire.open_frame(coord, sid, None, 128).to_wire())
                    await server.handle_frame(c, wire.frame("forward", session=sid, epoch=0, pos=0, chunk=0,
                                                            tokens=prompts[sid]))
                arrived.set()
                while len([x for x in c.sent if x.get("type") in ("result", "error")]) < 2:
                    await trio.sleep(0.005)
                nursery.cancel_scope.cancel()

    trio.run(main)
    results = [x for x in c.sent if x.get("type") in ("result", "error")]
    assert [x["session"] for x in results] == ["short", "long"], results  # the short one did not wait
    assert results[0]["token_ids"][-1:] == solo["short"]
    if fails:
        assert results[1]["type"] == "error" and "a torch failure" in results[1]["reason"], results[1]
        assert "long" not in server.sessions
    else:
        assert results[1]["token_ids"][-1:] == solo["long"]
    assert server.stats["prefill_preempted"] == 1 and server.scheduler.paused is None


def test_two_prompts_go_at_full_slices_and_yield_only_to_a_decoding_session(synthetic, tmp_path):
    """Prompts beside prompts are not throttled (the one with the least left goes first at
    --prefill-slice rows); once a session decodes, the other prompt goes --prefill-slice-shared rows a
    step. Every session still gets its solo tokens."""
    model = synthetic("llama", "float32")
    coord = load_or_create_key(tmp_path / "coord.key")
    rng = random.Random(5)
    sessions = {"a": ([rng.randrange(97) for _ in range(40)], 6), "b": ([rng.randrange(97) for _ in range(90)], 2)}
    log: list = []
    server = _server(model, LayerRange(0, 4), tmp_path, prefill_slice=32, prefill_slice_shared=2,
                     prefill_piggyback=False)  # fixed shared slices (sized by cost: test_a_long_prompt_rides_...)
    together = _drive(server, coord, sessions, steps_log=log, slice_s=0.01)
    for sid, job in sessions.items():
        assert _drive(_server(model, LayerRange(0, 4), tmp_path, prefill_slice=32), coord, {sid: job}) == \
            {sid: together[sid]}, sid
    first_decode = next(i for i, (small, _) in enumerate(log) if any(pos > 0 for sid, pos, _ in small))
    before = [piece for _, piece in log[:first_decode] if piece]
    assert before and all(done % 32 == 0 for _, done in before), log  # full slices while both prefill
    after = [piece[1] for small, piece in log[first_decode:] if piece and piece[0] == "b"]
    assert any(b - a == 2 for a, b in zip(after, after[1:])), log  # beside a's decode rows: 2 a step


@pytest.mark.parametrize("mode", ["rows", "fma"])
def test_sessions_that_do_not_ask_to_batch_share_forwards_only_in_the_fma_mode(synthetic, tmp_path, monkeypatch, mode):
    """Rows mode: sessions that did not ask to batch run alone, one GEMV per row. fma mode: every
    step's rows share one forward (the kernels give a row the same bits in any forward). Either way
    each session gets its solo tokens, and those equal the block's own forward."""
    from swarm.kernels import fma

    if mode == "fma" and not fma.available()[0]:
        pytest.skip(f"no fma kernels here: {fma.available()[1]}")
    if mode == "rows":
        monkeypatch.setenv("SWARM_KERNELS", "rows")
    model = synthetic("llama", "float32", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                      num_key_value_heads=3, num_hidden_layers=2, vocab_size=2048)
    coord = load_or_create_key(tmp_path / "coord.key")
    sessions = {"a": ([1, 2, 3], 4), "b": ([4, 5], 4), "c": ([6], 4)}
    log: list = []
    server = _server(model, LayerRange(0, 2), tmp_path)
    assert server.block.kernel_mode == mode
    together = _drive(server, coord, sessions, steps_log=log, batch=False)
    if mode == "rows":
        assert server.stats["max_sessions"] == 0 and server.stats["batched_steps"] == 0
    else:
        assert server.stats["max_sessions"] >= 2 and server.stats["batched_steps"] >= 1, server.stats
    assert max(len(small) for small, _ in log) >= 2  # they were ready together
    for sid, job in sessions.items():
        assert _drive(_server(model, LayerRange(0, 2), tmp_path), coord, {sid: job}, batch=False) == {sid: together[sid]}
    # and a solo run equals the block's own forward: what swarm coordinate computes
    block = load_block(model, LayerRange(0, 2), dtype="float32", device="cpu")
    cache = block.new_cache()
    ids, feed, pos = [], [1, 2, 3], 0
    for _ in range(4):
        ids.append(int(block.forward(cache, pos, token_ids=torch.tensor([feed]))[0, -1].argmax()))
        pos, feed = pos + len(feed), [ids[-1]]
    assert together["a"] == ids


def test_stage_whose_tile_fails_its_proof_falls_back_to_one_gemv_per_row(synthetic, tmp_path, monkeypatch):
    """A BLAS that gives a row other bits by its place in a tile: the start-up proof of the tile
    fails (the same check_block the tests run), the stage logs it and packs sessions with tile 1,
    and batched results still equal solo ones."""
    real = invariant.linear_rows

    def place_dependent(x, weight_t, bias, tile):
        out = real(x, weight_t, bias, tile)
        if tile > 1:  # perturb every row but the first of each tile, as a misbehaving kernel would
            out = out.clone()
            for i in range(0, out.shape[0], tile):
                out[i + 1:i + tile] = torch.nextafter(out[i + 1:i + tile], torch.full_like(out[i + 1:i + tile], 1e9))
        return out

    import swarm.kernels.check

    monkeypatch.setattr(invariant, "linear_rows", place_dependent)
    monkeypatch.setattr(swarm.kernels.check, "_REPORTS", {})  # prove again with the faulty kernel
    monkeypatch.setenv("SWARM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SWARM_KERNELS", "rows")  # tiles are the rows mode's (the fma mode packs any number)
    model = synthetic("llama", "float32")
    server = _server(model, LayerRange(0, 4), tmp_path)
    assert server.kernels["mode"] == "rows" and server.kernels["rows_ok"]
    assert server.kernels["batch_ok"] is None  # proven at the first batch open
    coord = load_or_create_key(tmp_path / "coord.key")
    jobs = {"a": ([1, 2, 3], 3), "b": ([4, 5], 3)}
    together = _drive(server, coord, jobs)
    assert server.kernels["batch_ok"] is False and "tile 2" in server.kernels["reason"]
    assert server.scheduler.tile == 1
    assert server.stats["max_sessions"] == 2  # still packed, now one GEMV per row
    for sid, job in jobs.items():
        assert _drive(_server(model, LayerRange(0, 4), tmp_path), coord, {sid: job}, batch=False) == {sid: together[sid]}


def test_a_stage_proves_each_block_once_per_process(synthetic, tmp_path, monkeypatch):
    import swarm.kernels.check

    monkeypatch.setattr(swarm.kernels.check, "_REPORTS", {})
    monkeypatch.setenv("SWARM_CACHE", str(tmp_path / "cache"))
    calls = []
    real = swarm.kernels.check.check_block
    monkeypatch.setattr(swarm.kernels.check, "check_block", lambda block, tile: calls.append(tile) or real(block, tile))
    model = synthetic("llama", "float32")
    first = _server(model, LayerRange(0, 4), tmp_path)
    again = _server(model, LayerRange(0, 4), tmp_path)
    other = _server(model, LayerRange(0, 2), tmp_path)
    assert calls == [1, 1] and first.kernels == again.kernels and other.kernels["rows_ok"]  # tile 1 at start
    coord = load_or_create_key(tmp_path / "coord.key")
    _drive(first, coord, {"a": ([1, 2], 2)}, batch=False)
    assert calls == [1, 1] and first.kernels["batch_ok"] is None  # no batch session yet: no tile proof
    _drive(first, coord, {"b": ([1, 2], 2)})
    _drive(again, coord, {"c": ([1, 2], 2)})
    assert calls == [1, 1, 2] and first.kernels["batch_ok"] and again.kernels["batch_ok"]
    # and a later process on this machine reuses the proofs from the cache instead of proving again
    monkeypatch.setattr(swarm.kernels.check, "_REPORTS", {})
    later = _server(model, LayerRange(0, 4), tmp_path)
    _drive(later, coord, {"d": ([1, 2], 2)})
    assert calls == [1, 1, 2] and later.kernels["rows_ok"] and later.kernels["batch_ok"]
    assert len(list((tmp_path / "cache" / "proofs").glob("*.json"))) == 3


def test_stage_timing_counters_count_each_chunk_step_and_sent_frame(synthetic, tmp_path):
    """info_ok ``timing`` (docs/protocol.md): every queued forward is parsed, picked and answered once;
    each counter's seconds are positive and below the wall time of the run; the tail encodes no hidden states."""
    import time

    model = synthetic("llama", "float32")
    server = _server(model, LayerRange(0, 4), tmp_path)
    assert set(server.info().timing.values()) == {0}
    coord = load_or_create_key(tmp_path / "coord.key")
    t0 = time.perf_counter()
    _drive(server, coord, {"a": ([1, 2, 3], 4), "b": ([4, 5], 3)}, batch=False)
    wall = time.perf_counter() - t0
    t = server.info().timing
    assert (t["chunks"], t["picked"], t["frames_out"]) == (7, 7, 7), t
    assert 4 <= t["steps"] <= 7, t  # the two sessions' chunks may share steps
    for name in ("parse_s", "queue_s", "to_thread_s", "compute_s", "from_thread_s", "outbox_s", "send_s"):
        assert 0 < t[name] < wall, (name, t)
    assert t["encode_s"] == 0, t


def test_short_steps_run_inline_once_their_compute_is_known_brief_with_the_same_bits(synthetic, tmp_path):
    """``--inline-step-ms``: after the first short steps (computed in the worker thread, which
    measures them), decode steps of a small block run in the trio thread; with 0 none do; the
    tokens are the same either way (the same calls, only another thread)."""
    model = synthetic("llama", "float32")
    coord = load_or_create_key(tmp_path / "coord.key")
    runs = {}
    for limit in (30.0, 0.0):
        server = _server(model, LayerRange(0, 4), tmp_path, inline_step_ms=limit)
        runs[limit] = (_drive(server, coord, {"a": ([1, 2, 3], 6)}, batch=False), server.info().timing)
    (inline_out, inline_t), (thread_out, thread_t) = runs[30.0], runs[0.0]
    assert inline_out == thread_out
    assert thread_t["inline_steps"] == 0 and thread_t["steps"] == 6, thread_t
    assert 1 <= inline_t["inline_steps"] <= 5 and inline_t["steps"] == 6, inline_t  # the first one measures

"""A stage refuses bad frames with a reason and keeps serving its other sessions (in-process, real libp2p)."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch
import trio

from swarm import wire
from swarm.errors import StageLost, StreamClosed, SwarmError
from swarm.wire import PROTOCOL_ID
from swarm.transport import load_or_create_key, open_host
from tests.support.models import reference_greedy
from tests.support.ring import LOOPBACK, ring_generate, start_ring

pytestmark = pytest.mark.ring

PROMPT = [1, 5, 9, 3, 7, 2, 8]


def run_with_ring(model_dir, ranges, key_dir, body, timeout_s=60):
    """Start an in-process ring, then ``await body(spec, servers, host)`` with a client host."""

    async def main():
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, ranges, key_dir)
                async with open_host(load_or_create_key(key_dir / "probe.key"), [LOOPBACK]) as host:
                    result = await body(spec, servers, host)
                nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


async def _expect_error(stream, match: str) -> dict:
    msg = await stream.recv(timeout_s=10)
    assert msg["type"] == "error", msg
    assert match in msg["reason"], msg["reason"]
    return msg


@pytest.fixture
def model(synthetic):
    return synthetic("llama")


def test_bad_frames_get_reasons_and_stage_stays_up(model, tmp_path):
    ref = reference_greedy(model, PROMPT, 8, "float64")

    async def body(spec, servers, host):
        s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
        cases = [
            ({"v": 9, "type": "info"}, "unsupported protocol version"),
            ({"v": 1, "type": "bogus"}, "unknown frame type"),
            (wire.frame("forward", session="nope", epoch=0, pos=0, chunk=0, tokens=[1]), "no session"),
            (wire.open_frame(host.key_pair, "s1", None, 64).to_wire(), "not the tail and needs a successor"),
            (wire.frame("result", session="s1", epoch=0, pos=0, chunk=0, token_ids=[1]), "does not accept"),
        ]
        for msg, reason in cases:
            await s.send(msg)
            await _expect_error(s, reason)
        # the same stream still answers
        await s.send(wire.frame("info"))
        assert (await s.recv(timeout_s=10))["type"] == "info_ok"
        # a session fed bad data fails with a reason and is dropped (its KV freed); others are unaffected
        bad_head = [([10_000], 0, "outside the vocabulary"), ([1], 5, "not contiguous"),
                    ([1] * 17, 0, "maximum context of 16")]
        for n, (tokens, pos, reason) in enumerate(bad_head):
            await s.send(wire.open_frame(host.key_pair, f"p{n}", spec.stages[1].addr, 16).to_wire())
            assert (await s.recv(timeout_s=10))["type"] == "open_ok"
            await s.send(wire.frame("forward", session=f"p{n}", epoch=0, pos=pos, chunk=0, tokens=tokens))
            err = await _expect_error(s, reason)
            assert err["session"] == f"p{n}" and f"p{n}" not in servers[0].sessions
            await s.send(wire.frame("forward", session=f"p{n}", epoch=0, pos=0, chunk=1, tokens=[1]))
            await _expect_error(s, "no session")
        # stage 1 expects hidden states of the model's width, batch 1
        s1 = await host.open_stream(spec.stages[1].addr, PROTOCOL_ID, timeout_s=10)
        bad_hidden = [(dict(hidden=wire.encode_tensor(torch.zeros(1, 2, 7, dtype=torch.float64))), "expected 32"),
                      (dict(hidden=wire.encode_tensor(torch.zeros(2, 2, 32, dtype=torch.float64))), "batch size 2"),
                      (dict(hidden=wire.encode_tensor(torch.zeros(1, 0, 32, dtype=torch.float64))), "T = 0"),
                      (dict(hidden={"dtype": "int8", "shape": [1, 1, 32], "data": b"0" * 32}), "not allowed"),
                      (dict(hidden={"dtype": "float64", "shape": [1, 1, 32], "data": b"0" * 8}), "needs 256"),
                      (dict(tokens=[1]), "expects hidden states")]
        for n, (payload, reason) in enumerate(bad_hidden):
            await s1.send(wire.open_frame(host.key_pair, f"q{n}", None, 16, prev=host.peer_id).to_wire())
            assert (await s1.recv(timeout_s=10))["type"] == "open_ok"
            await s1.send(wire.frame("forward", session=f"q{n}", epoch=0, pos=0, chunk=0, **payload))
            await _expect_error(s1, reason)
            assert f"q{n}" not in servers[1].sessions
        return await ring_generate(spec, model, 4, PROMPT, 8, tmp_path)

    assert run_with_ring(model, [(0, 2), (2, 4)], tmp_path, body) == ref


def test_oversized_and_garbage_frames_drop_only_that_stream(model, tmp_path):
    ref = reference_greedy(model, PROMPT, 6, "float64")

    async def body(spec, servers, host):
        for raw in (struct.pack(">I", 0xFFFFFFF0), struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1"):
            s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
            await s.raw.write(raw)
            with pytest.raises((StreamClosed, SwarmError)):
                while True:  # an error frame may arrive first; then the stream ends
                    msg = await s.recv(timeout_s=10)
                    assert msg["type"] == "error"
        return await ring_generate(spec, model, 4, PROMPT, 6, tmp_path)

    assert run_with_ring(model, [(0, 1), (1, 4)], tmp_path, body) == ref


def test_peer_that_is_not_a_stage(model, tmp_path):
    """A libp2p peer that does not speak /swarm/ring/1 is named in the error."""

    async def main():
        with trio.fail_after(30):
            async with open_host(load_or_create_key(tmp_path / "other.key"), [LOOPBACK]) as other, \
                    open_host(load_or_create_key(tmp_path / "me.key"), [LOOPBACK]) as me:
                from swarm.config import RingSpec, StageSpec
                from swarm.ranges import LayerRange

                spec = RingSpec(model=str(model), stages=(StageSpec(other.addrs()[0], LayerRange(0, 4)),))
                with pytest.raises(StageLost, match="is not a swarm stage: .*does not speak /swarm/ring/1"):
                    await ring_generate(spec, model, 4, PROMPT, 2, tmp_path)

    trio.run(main)


def test_prompt_longer_than_context(synthetic, tmp_path):
    d = synthetic("llama", max_position_embeddings=8)

    async def body(spec, servers, host):
        from swarm.errors import ContextOverflow

        with pytest.raises(ContextOverflow, match="maximum context is 8"):
            await ring_generate(spec, d, 4, list(range(1, 10)), 2, tmp_path)
        return await ring_generate(spec, d, 4, [1, 2, 3], 5, tmp_path)  # stops at the context limit

    assert run_with_ring(d, [(0, 2), (2, 4)], tmp_path, body) == reference_greedy(d, [1, 2, 3], 5, "float64")


def test_only_assigned_peers_steer_a_session(model, tmp_path):
    """Frames for a session from a peer it was not assigned to are refused ("forbidden") and leave
    the session untouched; an open must be signed by the peer that sends it; a non-head stage
    needs its predecessor's PeerId."""
    ref = reference_greedy(model, PROMPT, 1, "float64")

    async def body(spec, servers, host):
        s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
        await s.send(wire.open_frame(host.key_pair, "x", spec.stages[1].addr, 32).to_wire())
        assert (await s.recv(timeout_s=10))["type"] == "open_ok"
        async with open_host(load_or_create_key(tmp_path / "mallory.key"), [LOOPBACK]) as mallory:
            m = await mallory.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
            for msg in (wire.frame("close", session="x"), wire.frame("cancel", session="x", epoch=9),
                        wire.frame("progress", session="x"), wire.frame("receipt", session="x"),
                        wire.frame("forward", session="x", epoch=0, pos=0, chunk=0, tokens=[3, 3])):
                await m.send(msg)
                err = await _expect_error(m, "the session was not assigned to that peer")
                assert err["code"] == "forbidden" and mallory.peer_id in err["reason"]
            # a re-open of someone else's session id, an unsigned open, an open signed by another key
            await m.send(wire.open_frame(mallory.key_pair, "x", spec.stages[1].addr, 32).to_wire())
            await _expect_error(m, "not assigned to that peer")
            unsigned = wire.frame("open", session="y", next=spec.stages[1].addr, max_len=8, sig="00" * 64)
            forged = {**wire.open_frame(host.key_pair, "y", spec.stages[1].addr, 8).to_wire()}
            for msg in (unsigned, forged):
                await m.send(msg)
                await _expect_error(m, f"not signed by the peer that sent it ({mallory.peer_id})")
            # a tampered field breaks the coordinator's own signature too
            await s.send({**wire.open_frame(host.key_pair, "z", spec.stages[1].addr, 8).to_wire(), "max_len": 64})
            await _expect_error(s, "not signed")
        sess = servers[0].sessions["x"]
        assert sess.epoch == 0 and sess.cache.kv_len == 0  # mallory changed nothing
        # stage 1 takes hidden states only from the predecessor named in its open
        s1 = await host.open_stream(spec.stages[1].addr, PROTOCOL_ID, timeout_s=10)
        await s1.send(wire.open_frame(host.key_pair, "w", None, 8).to_wire())
        await _expect_error(s1, "needs 'prev'")
        await s1.send(wire.open_frame(host.key_pair, "x", None, 32, prev=servers[0].host.peer_id).to_wire())
        assert (await s1.recv(timeout_s=10))["type"] == "open_ok"
        await s1.send(wire.frame("forward", session="x", epoch=2, pos=0, chunk=0,
                                 hidden=wire.encode_tensor(torch.zeros(1, 1, 32, dtype=torch.float64))))
        err = await _expect_error(s1, "refuses 'forward'")
        assert err["epoch"] == 2  # the refused frame's: a coordinator that repaired the session since ignores it
        # the real session still works end to end
        await s.send(wire.frame("forward", session="x", epoch=0, pos=0, chunk=0, tokens=PROMPT))
        while True:
            msg = await s1.recv(timeout_s=10)
            if msg["type"] == "result":
                return msg["token_ids"][-1:]

    assert run_with_ring(model, [(0, 2), (2, 4)], tmp_path, body) == ref


def test_allow_coordinator(model, tmp_path):
    from swarm.errors import RemoteError
    from swarm.transport.identity import peer_id_of

    me = peer_id_of(load_or_create_key(tmp_path / "coord.key"))  # ring_generate's coordinator key
    ref = reference_greedy(model, PROMPT, 4, "float64")

    async def main(allowed):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model, [(0, 2), (2, 4)], tmp_path, allow_coordinators=allowed)
                out = await ring_generate(spec, model, 4, PROMPT, 4, tmp_path)
                nursery.cancel_scope.cancel()
        return out

    assert trio.run(main, (me,)) == ref
    other = peer_id_of(load_or_create_key(tmp_path / "someone-else.key"))
    with pytest.raises(RemoteError, match=f"PeerId {me} may not open sessions on this stage"):
        try:
            trio.run(main, (other,))
        except BaseExceptionGroup as group:
            from swarm.errors import collapse

            raise collapse(group) from None


def test_max_ctx_is_reported_and_enforced(model, tmp_path):
    from swarm.config import StageConfig
    from swarm.errors import ConfigError, ContextOverflow
    from swarm.model.block import load_block
    from swarm.ranges import LayerRange
    from swarm.stage.server import StageServer

    with pytest.raises(ConfigError, match="--max-ctx 500 exceeds the model's maximum context of 128"):
        StageServer(StageConfig.of(model=str(model), layers=LayerRange(0, 4), max_ctx=500),
                    load_block(model, LayerRange(0, 4), dtype="float64"), "m", "d")

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model, [(0, 2), (2, 4)], tmp_path, max_ctx=12)
                info: dict = {}
                out = await ring_generate(spec, model, 4, PROMPT, 10, tmp_path, info=info)  # 7 + 10 > 12
                assert info["context_limited"] and len(out) == 12 - len(PROMPT)
                with pytest.raises(ContextOverflow, match="maximum context is 12"):
                    await ring_generate(spec, model, 4, list(range(1, 13)), 2, tmp_path)  # refused before work
                async with open_host(load_or_create_key(tmp_path / "probe.key"), [LOOPBACK]) as host:
                    s = await host.open_stream(spec.stages[1].addr, PROTOCOL_ID, timeout_s=10)
                    await s.send(wire.open_frame(host.key_pair, "big", None, 13, prev=host.peer_id).to_wire())
                    err = await _expect_error(s, "asks for 13 positions; this stage's maximum context is 12")
                    assert err["code"] == "overflow" and "big" not in servers[1].sessions
                nursery.cancel_scope.cancel()
        return out

    assert trio.run(main) == reference_greedy(model, PROMPT, 5, "float64")


def test_kv_budget_admits_then_refuses_busy(model, tmp_path):
    from swarm.errors import RemoteError

    per_pos = 2 * 2 * 2 * 8 * 8  # K and V x 2 layers x 2 KV heads x head dim 8 x float64
    budget_mb = 1.5 * 64 * per_pos / 2**20  # room for one session of 64 positions, not two

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model, [(0, 2), (2, 4)], tmp_path, kv_budget_mb=budget_mb)
                assert servers[0].block.kv_bytes_per_position() == per_pos
                async with open_host(load_or_create_key(tmp_path / "probe.key"), [LOOPBACK]) as host:
                    s = await host.open_stream(spec.stages[1].addr, PROTOCOL_ID, timeout_s=10)
                    await s.send(wire.open_frame(host.key_pair, "a", None, 64, prev=host.peer_id).to_wire())
                    assert (await s.recv(timeout_s=10))["type"] == "open_ok"
                    assert servers[1].sessions["a"].reserved == 64 * per_pos
                    await s.send(wire.open_frame(host.key_pair, "b", None, 64, prev=host.peer_id).to_wire())
                    err = await _expect_error(s, f"KV budget of {budget_mb:g} MiB (--kv-budget-mb) is taken: "
                                                 "1 sessions hold 32.0 KiB and this one needs 32.0 KiB")
                    assert err["code"] == "busy" and "b" not in servers[1].sessions
                    with pytest.raises(RemoteError, match="is busy: its KV budget"):  # a whole job is refused
                        await ring_generate(spec, model, 4, PROMPT, 57, tmp_path)
                    await s.send(wire.open_frame(host.key_pair, "huge", None, 128, prev=host.peer_id).to_wire())
                    err = await _expect_error(s, "more than this stage's whole KV budget")  # never fits: not busy
                    assert err["code"] == "overflow"
                    await s.send(wire.frame("close", session="a"))
                    assert (await s.recv(timeout_s=10))["type"] == "close_ok"
                out = await ring_generate(spec, model, 4, PROMPT, 8, tmp_path)  # room again
                nursery.cancel_scope.cancel()
        return out

    assert trio.run(main) == reference_greedy(model, PROMPT, 8, "float64")


def test_concurrent_opens_never_over_admit_the_kv_budget(model, tmp_path):
    """Two opens racing for room for one: an open admitted but still dialing its successor holds its
    bytes, so the other is refused busy (the old code checked the budget, then awaited the dial
    before recording the session, and admitted both)."""
    per_pos = 2 * 2 * 2 * 8 * 8  # as above: float64, 2 layers

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model, [(0, 2), (2, 4)], tmp_path, kv_budget_mb=1.0)
                head = servers[0]
                need = 64 * (per_pos + head.block.hidden_size * 8)  # KV + the log of hidden states sent on
                head.config = dataclasses.replace(head.config, admission=dataclasses.replace(  # one, not two
                    head.config.admission, kv_budget_mb=1.5 * need / 2**20))
                dial = head.outboxes.successor_or_answer

                async def slow_dial(*a, **k):  # a successor far away: the dial takes a while
                    await trio.sleep(0.3)
                    return await dial(*a, **k)

                head.outboxes.successor_or_answer = slow_dial
                answers = {}
                async with open_host(load_or_create_key(tmp_path / "probe.key"), [LOOPBACK]) as host:
                    async def open_one(sid):
                        s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
                        await s.send(wire.open_frame(host.key_pair, sid, spec.stages[1].addr, 64).to_wire())
                        answers[sid] = await s.recv(timeout_s=10)

                    async with trio.open_nursery() as opens:
                        opens.start_soon(open_one, "a")
                        opens.start_soon(open_one, "b")
                    assert head.reservations.opening == {}  # nothing left held once the opens ended
                    kinds = sorted(m["type"] for m in answers.values())
                    assert kinds == ["error", "open_ok"], answers
                    refused = next(m for m in answers.values() if m["type"] == "error")
                    assert refused["code"] == "busy" and "1 sessions hold" in refused["reason"], refused
                    assert len(head.sessions) == 1
                    assert head.reserved_bytes() == need <= head.config.admission.kv_budget_bytes
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_idle_sessions_expire(model, tmp_path):
    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model, [(0, 4)], tmp_path, session_ttl_s=0.4)
                async with open_host(load_or_create_key(tmp_path / "probe.key"), [LOOPBACK]) as host:
                    s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
                    for sid in ("idle", "busy"):
                        await s.send(wire.open_frame(host.key_pair, sid, None, 32).to_wire())
                        assert (await s.recv(timeout_s=10))["type"] == "open_ok"
                    t0 = trio.current_time()
                    while trio.current_time() - t0 < 1.2:  # keep "busy" alive with heartbeats
                        await s.send(wire.frame("progress", session="busy"))
                        await trio.sleep(0.1)
                    alive = set(servers[0].sessions)
                    got = []
                    with trio.move_on_after(0.2):  # the idle one's error is already queued
                        while True:
                            got.append(await s.recv())
                nursery.cancel_scope.cancel()
        return got, alive

    got, alive = trio.run(main)
    expired = [m for m in got if m["type"] == "error"]
    assert len(expired) == 1 and expired[0]["session"] == "idle" and "expired after 0.4 s idle" in expired[0]["reason"]
    assert alive == {"busy"}


def test_unhashable_values_get_an_error_and_the_stream_lives(model, tmp_path):
    async def body(spec, servers, host):
        s = await host.open_stream(spec.stages[1].addr, PROTOCOL_ID, timeout_s=10)
        await s.send(wire.open_frame(host.key_pair, "keep", None, 16, prev=host.peer_id).to_wire())
        assert (await s.recv(timeout_s=10))["type"] == "open_ok"
        for msg in ({"v": 1, "type": ["info"]}, {"v": 1, "type": "info", "session": ["x"]}, {"type": {"a": 1}},
                    {"v": True, "type": "info"}, {"v": 1.0, "type": "info"},
                    wire.frame("forward", session="keep2", epoch=0, pos=0, chunk=0,
                               hidden={"dtype": ["float32"], "shape": [1, 1, 32], "data": b""})):
            await s.send(msg)
            assert (await s.recv(timeout_s=10))["type"] == "error"
        assert "keep" in servers[1].sessions  # the stream and its session survived
        await s.send(wire.frame("forward", session="keep", epoch=0, pos=0, chunk=0,
                                hidden={"dtype": ["float32"], "shape": [1, 1, 32], "data": b""}))
        await _expect_error(s, "not allowed")
        return True

    assert run_with_ring(model, [(0, 2), (2, 4)], tmp_path, body)


def test_a_dead_successor_does_not_hold_up_other_opens(model, tmp_path):
    """One peer naming a successor that never answers must not delay opens that name another."""
    import socket

    from swarm.transport.identity import peer_id_of

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # accepts TCP, never speaks: a dial to it hangs until the hop timeout
    fake = peer_id_of(load_or_create_key(tmp_path / "fake.key"))
    dead = f"/ip4/127.0.0.1/tcp/{hole.getsockname()[1]}/p2p/{fake}"

    async def body(spec, servers, host):
        async with open_host(load_or_create_key(tmp_path / "mallory.key"), [LOOPBACK]) as mallory, \
                trio.open_nursery() as nursery:
            async def stall(i):
                m = await mallory.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
                await m.send(wire.open_frame(mallory.key_pair, f"stall{i}", dead, 8).to_wire())
                await m.recv(timeout_s=60)

            for i in range(3):
                nursery.start_soon(stall, i)
            await trio.sleep(0.5)
            t0 = trio.current_time()
            out = await ring_generate(spec, model, 4, PROMPT, 4, tmp_path)
            took = trio.current_time() - t0
            nursery.cancel_scope.cancel()
        return out, took

    try:
        out, took = run_with_ring(model, [(0, 2), (2, 4)], tmp_path, body, timeout_s=90)
    finally:
        hole.close()
    assert out == reference_greedy(model, PROMPT, 4, "float64") and took < 10


@pytest.mark.parametrize("kwargs,expect", [
    ({"kv_budget_mb": float("inf")}, "positive, finite"), ({"kv_budget_mb": float("nan")}, "positive, finite"),
    ({"heal_log_mb": -1.0}, "--heal-log-mb must be"), ({"heal_log_mb": float("nan")}, "--heal-log-mb must be"),
    ({"session_ttl_s": 1e-9}, "--session-ttl-s must be"), ({"drain_timeout_s": -1}, "--drain-timeout-s must be"),
    ({"allow_coordinators": ("12D3KooW" + "1" * 44,)}, "is not an ed25519 PeerId"),
    ({"admins": ("Qmfoo",)}, "--admin 'Qmfoo' is not"), ({"listen": "/ip4/127.0.0.1/tcp/99999"}, "0..65535"),
    ({"max_ctx": 0}, "--max-ctx must be >= 1"),
])
def test_stage_config_refuses(kwargs, expect):
    from swarm.config import StageConfig
    from swarm.errors import ConfigError
    from swarm.ranges import LayerRange

    with pytest.raises(ConfigError, match=expect):
        StageConfig.of(model="m", layers=LayerRange(0, 1), **kwargs)


def test_tail_answers_only_the_rows_logits_from_asks_for(model, tmp_path):
    """A prefill chunk needs only its last row's token: the tail runs the LM head on the rows at
    ``[logits_from, pos + T)`` and answers for them alone (the same tokens as a full answer);
    a logits_from past the chunk fails the session with a reason."""
    ref = reference_greedy(model, PROMPT, 2, "float64")

    async def body(spec, servers, host):
        s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
        answers = {}
        for sid, lf in (("all", None), ("last", len(PROMPT) - 1), ("none", len(PROMPT))):
            await s.send(wire.open_frame(host.key_pair, sid, None, 16).to_wire())
            assert (await s.recv(timeout_s=10))["type"] == "open_ok"
            extra = {} if lf is None else {"logits_from": lf}
            await s.send(wire.frame("forward", session=sid, epoch=0, pos=0, chunk=0, tokens=PROMPT, **extra))
            msg = await s.recv(timeout_s=10)
            assert msg["type"] == "result" and msg.get("logits_from") == lf, msg
            answers[sid] = msg["token_ids"]
            # the next decode row is answered in full and agrees with the reference either way
            await s.send(wire.frame("forward", session=sid, epoch=0, pos=len(PROMPT), chunk=1, tokens=[ref[0]]))
            assert (await s.recv(timeout_s=10))["token_ids"] == [ref[1]]
        assert len(answers["all"]) == len(PROMPT) and answers["last"] == answers["all"][-1:] == [ref[0]]
        assert answers["none"] == []
        await s.send(wire.open_frame(host.key_pair, "past", None, 16).to_wire())
        assert (await s.recv(timeout_s=10))["type"] == "open_ok"
        await s.send(wire.frame("forward", session="past", epoch=0, pos=0, chunk=0, tokens=[1, 2], logits_from=3))
        await _expect_error(s, "lies past its last row")
        await s.send(wire.frame("forward", session="past", epoch=0, pos=4, chunk=0, tokens=[1], logits_from=2))
        await _expect_error(s, "must be an integer position >= pos")
        return True

    assert run_with_ring(model, [(0, 4)], tmp_path, body)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sessions_run_sub_ranges_of_overlapping_blocks(synthetic, tmp_path, family):
    """Stages holding [0, 3) and [1, 4) chained as [0, 1) -> [1, 4) and as [0, 3) -> [3, 4): the
    same ids as transformers, every session on its own sub-range (a stage serves any sub-range of
    its block); a sub-range outside the block, or one that starts the model on a stage without
    the embedding, is refused with a reason."""
    from swarm.config import RingSpec, StageSpec
    from swarm.ranges import LayerRange

    model = synthetic(family)
    ref = reference_greedy(model, PROMPT, 6, "float64")

    async def body(spec, servers, host):
        a, b = spec.stages
        outs, infos = [], []
        for cut in (1, 3):
            chain = RingSpec(model=str(model), stages=(StageSpec(a.addr, LayerRange(0, cut)),
                                                       StageSpec(b.addr, LayerRange(cut, 4))))
            info: dict = {}
            outs.append(await ring_generate(chain, model, 4, PROMPT, 6, tmp_path, info=info, job={"id": "j", "nonce": "00" * 16}))
            infos.append(info)
        s = await host.open_stream(b.addr, PROTOCOL_ID, timeout_s=10)
        await s.send(wire.open_frame(host.key_pair, "x1", None, 64, prev="12D3KooWx", layers=[2, 6]).to_wire())
        await _expect_error(s, "not inside this stage's block [1, 4)")
        await s.send(wire.open_frame(host.key_pair, "x2", a.addr, 64, layers=[0, 2]).to_wire())
        await _expect_error(s, "not inside this stage's block [1, 4)")
        return outs, infos

    outs, infos = run_with_ring(model, [(0, 3), (1, 4)], tmp_path, body)
    assert outs == [ref, ref]
    assert [e["layers"] for e in infos[0]["ring"]] == [[0, 1], [1, 4]]
    assert [e["layers"] for e in infos[1]["ring"]] == [[0, 3], [3, 4]]


@pytest.mark.parametrize("spare", [True, False], ids=["spare", "no-spare"])
def test_a_successor_stream_that_fails_mid_answer_gets_the_successor_replaced(model, tmp_path, spare):
    """Stage 0's stream to stage 1 fails while it sends a chunk (a relayed hop whose relay died): the
    chunk stage 0 received is never sent on, so the coordinator's probes see no gap in the chain of
    progress; stage 0's report says it lost its successor, and the heal blames stage 1 within
    seconds: onto a spare the answer comes out identical, without one it fails naming [2, 4).
    Before, the heal blamed nobody ("a pause"), and the answer waited out the hop timeout."""
    from swarm.heal import NoSpare

    async def body(spec, servers, host):
        ring = dataclasses.replace(spec, stages=spec.stages[:2], spares=spec.stages[2:] if spare else ())
        cut = []

        def cut_the_hop(ids):  # after the 3rd token: stage 0's next send to stage 1 fails
            if len(ids) >= 3 and not cut:
                (succ,) = servers[0].outboxes.successors.values()

                async def broken(msg, timeout_s=None):
                    raise StreamClosed("the relay under this hop died")

                succ.send = broken
                cut.append(trio.current_time())

        try:
            out = await ring_generate(ring, model, 4, PROMPT, 8, tmp_path, hop_timeout_s=30.0, on_ids=cut_the_hop)
        except SwarmError as exc:
            return exc, trio.current_time() - cut[0]
        return out, trio.current_time() - cut[0]

    got, took = run_with_ring(model, [(0, 2), (2, 4), (2, 4)], tmp_path, body, timeout_s=90)
    if spare:
        assert got == reference_greedy(model, PROMPT, 8, "float64") and took < 10, (got, took)
    else:
        assert isinstance(got, NoSpare) and "[2, 4)" in str(got) and "cut off" in str(got) and took < 10, (got, took)


def test_a_lagging_shadow_computes_the_rolled_back_chunks_the_next_one_builds_on(model, tmp_path):
    """A shadow is sent copies of what its stage computed, at the ring's pace. When it lags, a chunk
    of speculation that the ring rolled back (after its stage had computed it) may still be queued
    there as the next epoch's chunk arrives, starting inside it: the shadow computes it rather than
    dropping it as stale (which left a gap and failed the session), and holds the same bits as a
    session fed only what was kept."""
    held = object()

    async def until(cond, what):
        with trio.move_on_after(20):
            while not cond():
                await trio.sleep(0.005)
        assert cond(), f"not {what} within 20 s"

    async def body(spec, servers, host):
        server = servers[0]
        s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
        for sid in ("lagging", "kept"):
            await s.send(wire.open_frame(host.key_pair, sid, None, 32, shadow=True).to_wire())
            assert (await s.recv(timeout_s=10))["type"] == "open_ok"
        lagging = server.sessions["lagging"]
        await server.scheduler.limiter.acquire_on_behalf_of(held)  # the shadow's compute lags
        await s.send(wire.frame("refill", session="lagging", epoch=0, pos=0, until=4, tokens=PROMPT))
        await until(lambda: server.scheduler.in_flight == 1, "the prompt picked")
        n = len(PROMPT)
        # its stage computed [n, n + 3), the coordinator kept one token of it and moved to epoch 1
        await s.send(wire.frame("refill", session="lagging", epoch=0, pos=n, until=4, tokens=[4, 5, 6]))
        await s.send(wire.frame("refill", session="lagging", epoch=1, pos=n + 1, until=4, tokens=[7, 8]))
        await until(lambda: len(lagging.scheduling.queue) == 3, "three chunks queued")
        server.scheduler.limiter.release_on_behalf_of(held)
        await s.send(wire.frame("refill", session="kept", epoch=0, pos=0, until=4, tokens=PROMPT + [4]))
        await s.send(wire.frame("refill", session="kept", epoch=0, pos=n + 1, until=4, tokens=[7, 8]))
        kept = server.sessions["kept"]
        await until(lambda: not lagging.scheduling.queue and not kept.scheduling.queue
                    and not server.scheduler.in_flight, "computed")
        assert server.sessions.get("lagging") is lagging and lagging.cache.kv_len == kept.cache.kv_len == n + 3
        for layer, keys in kept.cache._keys.items():
            assert torch.equal(lagging.cache._keys[layer][:, :n + 3], keys[:, :n + 3]), layer
            assert torch.equal(lagging.cache._values[layer][:, :n + 3], kept.cache._values[layer][:, :n + 3])
        return True

    assert run_with_ring(model, [(0, 4)], tmp_path, body)

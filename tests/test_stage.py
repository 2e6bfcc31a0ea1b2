"""A stage refuses bad frames with a reason and keeps serving its other sessions (in-process, real libp2p)."""

from __future__ import annotations

import struct

import pytest
import torch
import trio

from swarm import wire
from swarm.errors import StageLost, StreamClosed, SwarmError
from swarm.wire import PROTOCOL_ID
from swarm.transport import load_or_create_key, open_host
from tests.conftest import reference_greedy
from tests.ring_util import LOOPBACK, ring_generate, start_ring

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
            (wire.frame("open", session="s1", next=None, max_len=64), "not the tail and needs a successor"),
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
            await s.send(wire.frame("open", session=f"p{n}", next=spec.stages[1].addr, max_len=16))
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
            await s1.send(wire.frame("open", session=f"q{n}", next=None, max_len=16))
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
        from swarm.errors import ConfigError

        with pytest.raises(ConfigError, match="maximum context is 8"):
            await ring_generate(spec, d, 4, list(range(1, 10)), 2, tmp_path)
        return await ring_generate(spec, d, 4, [1, 2, 3], 5, tmp_path)  # stops at the context limit

    assert run_with_ring(d, [(0, 2), (2, 4)], tmp_path, body) == reference_greedy(d, [1, 2, 3], 5, "float64")

"""Fuzzing the frame decoder, the frame validators and a stage's frame handler (hypothesis).

CI runs a bounded number of examples; ``SWARM_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py`` runs
more. The stage fuzz drives a real StageServer (a synthetic Llama, all 4 layers) through
``StageServer.handle_frame`` with in-memory streams, no network: a coordinator decodes one session
greedily while a hostile peer and the coordinator itself (for other session ids) send generated
frames in between. Every frame must be answered or ignored without an exception, within a
deadline, and the good session must produce exactly the reference tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm import wire
from swarm.config import StageConfig
from swarm.errors import ContextOverflow, ProtocolError
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from swarm.stage.server import StageServer
from swarm.transport import load_or_create_key
from swarm.transport.framing import FrameDecoder, encode_frame
from swarm.transport.identity import peer_id_of
from tests.support.models import reference_greedy
from tests.support.streams import MemStream, NoNetwork

EXAMPLES = int(os.environ.get("SWARM_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
PROMPT = [1, 5, 9, 3, 7, 2, 8]
NEW = 4

# ---- strategies ---------------------------------------------------------------------------------

SESSIONS = st.sampled_from(["good", "good", "good", "other", "x", "", "s" * 200])
SMALL_INT = st.one_of(st.integers(-3, 40), st.sampled_from([2**31 - 1, 2**31, 2**40, -(2**31)]))
TENSOR = st.fixed_dictionaries(
    {"dtype": st.sampled_from(["float32", "float64", "bfloat16", "float8_e4m3fn", "int8", "", None]),
     "shape": st.one_of(st.lists(st.integers(-2, 40), max_size=4), st.text(max_size=3)),
     "data": st.one_of(st.binary(max_size=600), SMALL_INT)},
    optional={"scale": st.binary(max_size=40)})
JUNK = st.one_of(st.none(), st.booleans(), SMALL_INT, st.text(max_size=12), st.binary(max_size=32),
                 st.lists(st.integers(-3, 200), max_size=20), TENSOR,
                 st.dictionaries(st.text(max_size=6), SMALL_INT, max_size=3), st.floats(allow_nan=False))
FIELDS = ["session", "epoch", "pos", "chunk", "tokens", "hidden", "next", "max_len", "sig", "prev", "job",
          "sampling", "wire_dtype", "token_ids", "receipt", "reason", "code", "received", "sent"]


@st.composite
def tensors(draw):
    """A well-formed tensor map of a plausible or slightly wrong shape, sometimes corrupted."""
    b, t, d = draw(st.sampled_from([1, 1, 2])), draw(st.integers(0, 4)), draw(st.sampled_from([32, 32, 31]))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float8_e4m3fn]))
    m = wire.encode_tensor(torch.randn(b, t, d, dtype=torch.float64), dtype)
    corrupt = draw(st.sampled_from(["none", "none", "data", "shape", "dtype", "scale"]))
    if corrupt == "data":
        m["data"] = m["data"][: draw(st.integers(0, max(0, len(m["data"]) - 1)))]
    elif corrupt == "shape":
        m["shape"] = draw(st.lists(st.integers(-1, 40), max_size=4))
    elif corrupt == "dtype":
        m["dtype"] = draw(st.sampled_from(["int8", "float16", "", "uint8"]))
    elif corrupt == "scale":
        m["scale"] = draw(st.binary(max_size=12))
    return m


POS = st.one_of(st.integers(0, 12), st.integers(0, 12), st.integers(0, 12), SMALL_INT)


@st.composite
def frames(draw, sessions=SESSIONS):
    """Random maps (mostly refused early) and well-formed frames of every type with one field
    possibly wrong (reaching the stage's deeper checks)."""
    kind = draw(st.sampled_from([*wire.SCHEMA, "bogus", *["forward"] * 6, "open", "receipt", "cancel"]))
    if draw(st.integers(0, 3)) == 0:  # free-form
        msg = {"v": draw(st.sampled_from([1, 2, "1", None, True, 1.0, [1]])),
               "type": draw(st.one_of(st.just(kind), JUNK))}
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True)):
            msg[name] = draw(JUNK)
        return msg
    msg = {"v": 1, "type": kind, "session": draw(sessions)}
    if kind == "forward":
        msg.update(epoch=draw(POS), pos=draw(POS), chunk=draw(POS))
        if draw(st.booleans()):
            msg["tokens"] = draw(st.lists(st.integers(-2, 120), min_size=0, max_size=6))
        else:
            msg["hidden"] = draw(tensors())
    elif kind == "open":
        msg.update(next=draw(st.one_of(st.none(), st.text(max_size=20))), max_len=draw(POS),
                   sig=draw(st.text(max_size=8)))
    elif kind in ("cancel",):
        msg["epoch"] = draw(POS)
    for name in draw(st.lists(st.sampled_from([*FIELDS, "type", "v"]), max_size=1)):  # maybe one wrong field
        msg[name] = draw(JUNK)
    return msg


# ---- pure layers --------------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(1, 97), max_size=40))
def test_frame_decoder_only_raises_protocol_errors(data, cuts):
    dec = FrameDecoder(max_bytes=4096)
    pos = 0
    try:
        for n in cuts + [len(data)]:
            dec.feed(data[pos:pos + n])
            pos += n
    except ProtocolError:
        pass


@FUZZ
@given(msgs=st.lists(frames(), max_size=6), cut=st.integers(1, 50))
def test_encoded_frames_roundtrip_through_the_decoder(msgs, cut):
    stream = b"".join(encode_frame(m) for m in msgs)
    dec, got = FrameDecoder(), []
    for i in range(0, len(stream), cut):
        got += dec.feed(stream[i:i + cut])
    assert got == msgs


@FUZZ
@given(msg=frames(), head=st.booleans(), kv_len=st.integers(0, 20))
def test_validators_are_total(msg, head, kv_len):
    try:
        m = wire.validate(msg)
    except ProtocolError:
        return
    # the typed frame travels as the map it came from (an optional field sent as nil is one left out)
    assert {k: v for k, v in m.to_wire().items() if v is not None} == {k: v for k, v in msg.items() if v is not None}
    assert wire.validate(m.to_wire()) == m
    if m.TYPE == "forward":
        try:
            out = wire.forward_inputs(m, is_head=head, vocab_size=97, hidden_size=32, kv_len=kv_len, max_len=32)
        except (ProtocolError, ContextOverflow):
            return
        t = next(iter(out.values()))
        assert t.shape[0] == 1 and 1 <= t.shape[1] <= 32 and m.pos <= kv_len


# ---- a stage under fire -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage(synthetic, tmp_path_factory):
    model = synthetic("llama")
    keys = tmp_path_factory.mktemp("fuzz-keys")
    block = load_block(model, LayerRange(0, 4), dtype="float64", device="cpu")
    server = StageServer(StageConfig.of(model=str(model), layers=LayerRange(0, 4)), block, "synthetic", "d" * 64,
                         key=load_or_create_key(keys / "stage.key"))
    server.host = NoNetwork(peer_id_of(server.key))
    coord, mallory = load_or_create_key(keys / "coord.key"), load_or_create_key(keys / "mallory.key")
    return server, coord, mallory, reference_greedy(model, PROMPT, NEW, "float64")


@FUZZ
@given(junk=st.lists(st.tuples(st.booleans(), frames()), max_size=30),
       signed=st.lists(st.tuples(st.sampled_from(["other", "x", "good"]), st.integers(0, 2**31 - 1)), max_size=3))
def test_stage_survives_hostile_frames_and_keeps_the_good_session_exact(stage, junk, signed):
    server, coord, mallory, reference = stage
    server.sessions.clear()
    c, m = MemStream(peer_id_of(coord)), MemStream(peer_id_of(mallory))
    # mallory may also hold properly signed sessions of her own (possibly reusing the good id)
    extra = [(False, wire.open_frame(mallory, sid, None, max_len).to_wire()) for sid, max_len in signed]

    async def run():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                server.nursery = nursery
                nursery.start_soon(server.scheduler.run)
                out = await session()
                nursery.cancel_scope.cancel()
            return out

    async def session():
        await server.handle_frame(c, wire.open_frame(coord, "good", None, 64).to_wire())
        assert c.sent[-1]["type"] == "open_ok"
        out, pos, feed = [], 0, list(PROMPT)
        hostile = extra + junk
        for step in range(NEW):
            for from_coordinator, msg in hostile[step::NEW]:
                if from_coordinator:
                    if msg.get("session") == "good":
                        continue  # the owner steering its own session is not an attack
                    await server.handle_frame(c, msg)
                else:
                    await server.handle_frame(m, msg)
            await server.handle_frame(c, wire.frame("forward", session="good", epoch=0, pos=pos, chunk=step,
                                                    tokens=feed))
            await server.idle()  # the scheduler has computed and sent everything queued
            results = [x for x in c.sent if x.get("type") == "result" and x.get("session") == "good"]
            assert results and results[-1]["chunk"] == step, c.sent[-3:]
            tok = results[-1]["token_ids"][-1]
            out.append(tok)
            pos += len(feed)
            feed = [tok]
        return out

    assert trio.run(run) == reference
    assert all(isinstance(x, dict) and x.get("type") in wire.SCHEMA for x in c.sent + m.sent)
    assert server.sessions["good"].coordinator == c.remote_peer_id


"""Frame codec (pure) and FramedStream semantics over a scripted in-memory raw stream."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest
import trio

from swarm.errors import FrameTooLarge, HopTimeout, ProtocolError, StreamClosed
from swarm.transport import FrameDecoder, FramedStream, decode_body, decode_length_prefix, encode_frame

from tests.support.transport import ScriptedRaw, trio_test


def _framed(raw: ScriptedRaw, max_frame_bytes: int = 1 << 20) -> FramedStream:
    return FramedStream(raw, remote_peer_id="peerX", protocol_id="/t/1", max_frame_bytes=max_frame_bytes)


# ---- pure codec --------------------------------------------------------------------------------


def test_encode_decode_round_trip_keeps_bytes_and_str() -> None:
    msg = {"session": "s1", "epoch": 3, "pos": 17, "payload": b"\x00\xffraw", "ids": [1, 2, 3]}
    frame = encode_frame(msg)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert decode_body(frame[4:]) == msg
    assert isinstance(decode_body(frame[4:])["payload"], bytes)


def test_decoder_handles_byte_at_a_time_and_many_frames() -> None:
    msgs = [{"i": i, "blob": bytes(i * 13)} for i in range(20)]
    stream = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    out = []
    for i in range(len(stream)):
        out += dec.feed(stream[i : i + 1])
    assert out == msgs and dec.buffered_bytes == 0


def test_sender_side_too_large() -> None:
    with pytest.raises(FrameTooLarge, match="max is 100"):
        encode_frame({"x": bytes(200)}, max_bytes=100)


def test_length_prefix_checked_before_body() -> None:
    assert decode_length_prefix(struct.pack(">I", 100), 100) == 100
    with pytest.raises(FrameTooLarge, match="4294967295"):
        decode_length_prefix(b"\xff\xff\xff\xff", 1 << 20)
    with pytest.raises(ProtocolError):
        decode_length_prefix(b"\x00\x01", 100)
    dec = FrameDecoder(max_bytes=1000)
    with pytest.raises(FrameTooLarge):
        dec.feed(struct.pack(">I", 1001))  # refused on the prefix alone, no body supplied
    with pytest.raises(FrameTooLarge):
        dec.feed(b"more")  # stays failed: the stream cannot be resynchronized


@pytest.mark.parametrize(
    "body, why",
    [
        (b"\xc1", "reserved byte"),
        (msgpack.packb([1, 2, 3]), "list top level"),
        (msgpack.packb(5), "int top level"),
        (msgpack.packb({"a": 1}) + b"\x00", "trailing bytes"),
        (msgpack.packb({"a": 1})[:-1], "truncated"),
        (msgpack.packb({1: "int key"}), "non-str key"),
        (b"", "empty"),
    ],
)
def test_malformed_bodies_are_protocol_errors(body: bytes, why: str) -> None:
    with pytest.raises(ProtocolError):
        decode_body(body)


def test_fuzz_decoder_only_raises_protocol_errors() -> None:
    rng = random.Random(1234)
    valid = encode_frame({"k": b"v" * 50, "n": [1, {"x": None}]})
    for _ in range(2000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        dec = FrameDecoder(max_bytes=4096)
        try:
            for frame in dec.feed(bytes(data)):
                assert isinstance(frame, dict)
        except ProtocolError:
            pass


# ---- FramedStream over a scripted raw stream ----------------------------------------------------


@trio_test
async def test_partial_reads_reassemble_and_queue_drains_before_eof() -> None:
    raw = ScriptedRaw(read_cap=3)  # every read returns at most 3 bytes
    fs = _framed(raw)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        msgs = [{"i": i, "b": bytes(range(i))} for i in range(10)]
        raw.push(b"".join(encode_frame(m) for m in msgs))
        raw.push_eof()
        for m in msgs:
            assert await fs.recv(timeout_s=2) == m
        with pytest.raises(StreamClosed, match="closed the stream"):
            await fs.recv(timeout_s=2)
        with pytest.raises(StreamClosed):  # stays closed
            await fs.recv(timeout_s=2)


@trio_test
async def test_oversized_declared_length_is_refused_without_reading_body() -> None:
    raw = ScriptedRaw(read_cap=1 << 30)
    fs = _framed(raw, max_frame_bytes=1024)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        raw.push(encode_frame({"ok": 1}) + struct.pack(">I", 0xFFFF_FFF0) + b"junk")
        assert await fs.recv(timeout_s=2) == {"ok": 1}  # frames before the bad one still arrive
        with pytest.raises(FrameTooLarge, match="4294967280"):
            await fs.recv(timeout_s=2)
        with pytest.raises(FrameTooLarge):
            await fs.recv(timeout_s=2)
    # The reader asked for the prefix (and at most one frame's worth ahead), never for the
    # declared body; then it reset the stream.
    assert all(n <= 1024 + 4 for n in raw.read_sizes), raw.read_sizes
    assert raw.reset_called
    with pytest.raises(StreamClosed, match="reset after"):
        await fs.send({"x": 1})


@trio_test
async def test_eof_mid_frame_is_stream_closed() -> None:
    raw = ScriptedRaw()
    fs = _framed(raw)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        raw.push(encode_frame({"x": bytes(100)})[:50])
        raw.push_eof()
        with pytest.raises(StreamClosed, match="mid-frame"):
            await fs.recv(timeout_s=2)


@trio_test
async def test_recv_timeout_leaves_stream_usable_and_aclose_is_local() -> None:
    raw = ScriptedRaw()
    fs = _framed(raw)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        with pytest.raises(HopTimeout, match="peerX"):
            await fs.recv(timeout_s=0.05)
        raw.push(encode_frame({"late": True}))
        assert await fs.recv(timeout_s=2) == {"late": True}
        await fs.send({"a": 1})
        assert raw.written == [encode_frame({"a": 1})]  # header and body in one write
        await fs.aclose()
        await fs.aclose()  # idempotent
        assert raw.closed
        with pytest.raises(StreamClosed, match="closed locally"):
            await fs.recv()
        with pytest.raises(StreamClosed, match="closed locally"):
            await fs.send({"a": 2})


@trio_test
async def test_send_rejects_oversized_and_non_maps_without_writing() -> None:
    raw = ScriptedRaw()
    fs = _framed(raw, max_frame_bytes=64)
    with pytest.raises(FrameTooLarge):
        await fs.send({"x": bytes(100)})
    with pytest.raises(TypeError):
        await fs.send([1, 2])  # type: ignore[arg-type]
    assert raw.written == []
    await fs.send({"x": 1})
    assert len(raw.written) == 1


@trio_test
async def test_reset_is_abrupt_and_final() -> None:
    raw = ScriptedRaw()
    fs = _framed(raw)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        raw.push(encode_frame({"queued": 1}))
        await fs.reset()
        assert raw.reset_called and not raw.closed  # RST, not a graceful FIN
        with pytest.raises(StreamClosed, match="reset locally"):
            await fs.recv()
        with pytest.raises(StreamClosed):
            await fs.send({"x": 1})
        await fs.aclose()  # harmless afterwards
        assert not raw.closed

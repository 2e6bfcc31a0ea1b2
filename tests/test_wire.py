import pytest
import torch

from swarm import wire
from swarm.errors import ProtocolError


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_tensor_roundtrip_exact(dtype):
    t = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    back = wire.decode_tensor(wire.encode_tensor(t), rank=3, last_dim=16)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_tensor_byte_length_checked():
    m = wire.encode_tensor(torch.zeros(1, 2, 4))
    m["data"] = m["data"][:-1]
    with pytest.raises(ProtocolError, match="31 bytes"):
        wire.decode_tensor(m)


@pytest.mark.parametrize("patch,msg", [
    ({"dtype": "int8"}, "not allowed"),
    ({"dtype": "object"}, "not allowed"),
    ({"shape": [1, -2, 4]}, "non-negative"),
    ({"shape": "1,2,4"}, "list"),
    ({"data": "text"}, "not bytes"),
])
def test_tensor_rejects(patch, msg):
    m = {**wire.encode_tensor(torch.zeros(1, 2, 4)), **patch}
    with pytest.raises(ProtocolError, match=msg):
        wire.decode_tensor(m)


def test_tensor_rank_and_hidden_size():
    m = wire.encode_tensor(torch.zeros(1, 2, 4))
    with pytest.raises(ProtocolError, match="rank"):
        wire.decode_tensor(m, rank=2)
    with pytest.raises(ProtocolError, match="expected 8"):
        wire.decode_tensor(m, last_dim=8)


def test_tensor_too_many_elements_refused_before_copy():
    m = {"dtype": "float32", "shape": [1 << 20, 1 << 20], "data": b""}
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode_tensor(m)


def test_validate_ok():
    f = wire.frame("forward", session="s", epoch=0, pos=3, chunk=1, tokens=[1, 2])
    assert wire.validate(f).to_wire() == f


@pytest.mark.parametrize("msg,err", [
    ([1, 2], "not a map"),
    ({"v": 2, "type": "info"}, "version"),
    ({"v": 1, "type": "launch"}, "unknown frame type"),
    ({"v": 1, "type": "open", "session": "s", "max_len": 3}, "lacks field 'next'"),
    ({"v": 1, "type": "forward", "session": "s", "epoch": 0, "pos": -1, "chunk": 0, "tokens": [1]}, "out of range"),
    ({"v": 1, "type": "forward", "session": "s", "epoch": True, "pos": 0, "chunk": 0, "tokens": [1]}, "type bool"),
    ({"v": 1, "type": "forward", "session": "s", "epoch": 0, "pos": 0, "chunk": 0}, "exactly one"),
    ({"v": 1, "type": "forward", "session": "s", "epoch": 0, "pos": 0, "chunk": 0, "tokens": []}, "non-empty"),
    ({"v": 1, "type": "forward", "session": "x" * 200, "epoch": 0, "pos": 0, "chunk": 0, "tokens": [1]}, "session id"),
])
def test_validate_rejects(msg, err):
    with pytest.raises(ProtocolError, match=err):
        wire.validate(msg)


def test_float8_roundtrip_with_per_row_scale():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1, 6, 64, generator=g) * torch.tensor([1e-3, 1.0, 10.0, 300.0, 1e4, 0.0]).view(1, 6, 1)
    m = wire.encode_tensor(t, dtype=torch.float8_e4m3fn)
    assert m["dtype"] == "float8_e4m3fn" and len(m["data"]) == 6 * 64 and len(m["scale"]) == 6 * 4
    back = wire.decode_tensor(m, rank=3, last_dim=64)
    assert back.dtype == torch.float32
    for row in range(6):
        peak = float(t[0, row].abs().max())
        # e4m3 has 3 mantissa bits: relative error <= 2^-4 of the row's peak after scaling
        assert float((back[0, row] - t[0, row]).abs().max()) <= peak * 2**-4 + 1e-30


def test_float8_needs_its_scale():
    m = wire.encode_tensor(torch.ones(1, 2, 4), dtype=torch.float8_e4m3fn)
    del m["scale"]
    with pytest.raises(ProtocolError, match="scale per row"):
        wire.decode_tensor(m)


@pytest.mark.parametrize("wire_dtype,stage,lossy", [
    (None, "float32", False), ("float32", "float32", False), ("float64", "float32", False),
    ("float32", "bfloat16", False), ("bfloat16", "float32", True), ("float16", "bfloat16", True),
    ("float8_e4m3fn", "bfloat16", True), ("bfloat16", "bfloat16", False),
])
def test_is_lossy(wire_dtype, stage, lossy):
    assert wire.is_lossy(wire_dtype, stage) is lossy


def test_open_frame_wire_dtype_checked():
    with pytest.raises(ProtocolError, match="wire_dtype"):
        wire.validate(wire.frame("open", session="s", next=None, max_len=4, sig="00", wire_dtype="int8"))


@pytest.mark.parametrize("layers,ok", [
    ([0, 3], True), ([2, 5], True), (None, True),
    ([3, 3], False), ([4, 2], False), ([-1, 2], False), ([0], False), ("0:3", False), ([0.0, 3], False),
    ([True, 3], False),
])
def test_open_frame_layers_checked(layers, ok):
    extra = {} if layers is None else {"layers": layers}
    msg = wire.frame("open", session="s", next=None, max_len=4, sig="00", **extra)
    if ok:
        assert wire.validate(msg).to_wire() == msg
    else:
        with pytest.raises(ProtocolError, match="layers"):
            wire.validate(msg)


def test_refill_and_repair_frames_validated(tmp_path):
    import torch

    from swarm.errors import ProtocolError
    from swarm.transport import load_or_create_key

    h = wire.encode_tensor(torch.zeros(1, 2, 8))
    wire.validate(wire.frame("refill", session="s", epoch=1, pos=0, until=3, hidden=h))
    wire.validate(wire.frame("refill", session="s", epoch=1, pos=0, until=3, tokens=[1, 2]))
    for bad, msg in [(dict(hidden=h, tokens=[1]), "exactly one"), (dict(tokens=[]), "non-empty"),
                     (dict(hidden=[1]), "tensor map")]:
        with pytest.raises(ProtocolError, match=msg):
            wire.validate(wire.frame("refill", session="s", epoch=1, pos=0, until=3, **bad))
    with pytest.raises(ProtocolError, match="lacks field 'until'"):
        wire.validate(wire.frame("refill", session="s", epoch=1, pos=0, tokens=[1]))
    key = load_or_create_key(tmp_path / "k.key")
    ok = wire.repair_frame(key, "s", 2, next_addr="/ip4/127.0.0.1/tcp/1/p2p/x", resend=10, until=4).to_wire()
    wire.validate(ok)
    for bad, msg in [(dict(resend=10, until=4), "needs 'next'"), (dict(next_addr="/a", resend=10), "go together"),
                     (dict(prev=""), "non-empty string")]:
        with pytest.raises(ProtocolError, match=msg):
            wire.validate(wire.repair_frame(key, "s", 2, **bad).to_wire())
    with pytest.raises(ProtocolError, match="must be an integer"):
        wire.validate({**ok, "resend": -1})


def test_shadow_and_mirror_fields_validated(tmp_path):
    from swarm.errors import ProtocolError
    from swarm.transport import load_or_create_key

    key = load_or_create_key(tmp_path / "k.key")
    addr = "/ip4/127.0.0.1/tcp/1/p2p/x"
    wire.validate(wire.open_frame(key, "s", None, 16, prev="p", shadow=True).to_wire())
    wire.validate(wire.open_frame(key, "s", addr, 16, mirror=addr, mirror_until=4).to_wire())
    for extra, msg in [(dict(shadow="yes"), "'shadow' must be true or false"),
                       (dict(mirror=addr), "needs 'mirror_until'"), (dict(mirror=addr, mirror_until=0), "mirror_until"),
                       (dict(mirror="", mirror_until=3), "multiaddr string")]:
        with pytest.raises(ProtocolError, match=msg):
            wire.validate(wire.open_frame(key, "s", addr, 16, **extra).to_wire())
    ok = wire.repair_frame(key, "s", 2, next_addr=addr, resend=10, until=4, mirror=True).to_wire()
    assert wire.validate(ok).mirror is True
    with pytest.raises(ProtocolError, match="'mirror' needs 'next' and 'resend'"):
        wire.validate(wire.repair_frame(key, "s", 2, next_addr=addr, mirror=True).to_wire())
    with pytest.raises(ProtocolError, match="must be true or false"):
        wire.validate({**ok, "mirror": 1})


@pytest.mark.parametrize("prefix,ok", [
    ({"ids": [1, 2, 3], "ns": "ab"}, True), ({"ids": [], "ns": "ab"}, True),
    ({"ids": [1, -2], "ns": "ab"}, False), ({"ids": [1, 2.0], "ns": "ab"}, False), ({"ids": [True], "ns": "x"}, False),
    ({"ids": [1], "ns": ""}, False), ({"ids": [1], "ns": "x" * 129}, False), ({"ids": [1]}, False),
    ({"ids": [1], "ns": "x", "more": 1}, False), ([1, 2], False), ({"ids": "12", "ns": "x"}, False),
])
def test_open_frame_prefix_checked(prefix, ok):
    msg = wire.frame("open", session="s", next=None, max_len=4, sig="00", prefix=prefix)
    if ok:
        assert wire.validate(msg).to_wire() == msg
    else:
        with pytest.raises(ProtocolError, match="prefix"):
            wire.validate(msg)


def test_close_keep_and_open_ok_reused_checked():
    assert wire.validate(wire.frame("close", session="s", keep=[1, 2, 3]))
    assert wire.validate(wire.frame("open_ok", session="s", reused=64))
    for bad in ([1, "2"], "123", [-1], list(range(wire.MAX_TOKENS_PER_FRAME + 1))):
        with pytest.raises(ProtocolError, match="keep"):
            wire.validate(wire.frame("close", session="s", keep=bad))
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ProtocolError, match="reused"):
            wire.validate(wire.frame("open_ok", session="s", reused=bad))


@pytest.mark.parametrize("msg,err", [
    ({"session": "s", "job": "j", "window": 0}, None),
    ({"session": "s", "job": "j"}, "lacks field 'window'"),
    ({"session": "s", "job": "j", "window": -1}, "out of range"),
    ({"session": "s", "job": "j", "window": True}, "has type bool"),
    ({"session": "s", "job": "", "window": 0}, "job id of 1..128"),
    ({"session": "s", "job": "j" * 129, "window": 0}, "job id of 1..128"),
    ({"session": "", "job": "j", "window": 0}, "session id"),
])
def test_audit_frame_checked(msg, err):
    frame = wire.frame("audit", **msg)
    if err is None:
        assert wire.validate(frame).to_wire() == frame
    else:
        with pytest.raises(ProtocolError, match=err):
            wire.validate(frame)
    ok = wire.frame("audit_ok", session="s", job="j", window=0, opening={})
    assert wire.validate(ok).to_wire() == ok
    with pytest.raises(ProtocolError, match="opening"):
        wire.validate(wire.frame("audit_ok", session="s", job="j", window=0))

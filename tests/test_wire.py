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
    assert wire.validate(f) is f


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

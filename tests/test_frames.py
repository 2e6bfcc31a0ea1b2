"""Typed frames (swarm.frames): every type travels as the map it is, and comes back as itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm import frames, receipts, wire
from swarm.errors import ProtocolError
from swarm.frames import (Audit, AuditOffer, AuditOfferOk, AuditOk, Cancel, Close, CloseOk, Drain, DrainOk, Error,
                          Forward, Info, InfoOk, LinkLost, Open, OpenOk, Progress, ProgressOk, Receipt, ReceiptOk,
                          Refill, Repair, RepairOk, Result)
from swarm.transport import load_or_create_key
from swarm.transport.framing import decode_body, encode_frame
from swarm.transport.identity import peer_id_of

HIDDEN = wire.encode_tensor(torch.arange(6, dtype=torch.float32).reshape(1, 2, 3))
ONE_OF_EACH = [
    Info(), Drain(), DrainOk(sessions=2),
    InfoOk(peer_id="12D3KooWx", model="m", model_digest="ab", layers=[0, 4], num_layers=4, hidden_size=8,
           vocab_size=32, dtype="float32", max_ctx=64, addrs=["/ip4/127.0.0.1/tcp/1"], draining=False,
           timing={"steps": 3}),
    Open(session="s", next=None, max_len=16, sig="00", prev="12D3KooWp", layers=[1, 3], batch=True,
         prefix={"ids": [1, 2], "ns": "n"}),
    OpenOk(session="s", reused=4), Close(session="s", keep=[1, 2, 3]), CloseOk(session="s"),
    Forward(session="s", epoch=1, pos=5, chunk=2, tokens=[7, 8], logits_from=6),
    Forward(session="s", epoch=0, pos=0, chunk=0, hidden=HIDDEN),
    Refill(session="s", epoch=2, pos=0, until=3, hidden=HIDDEN),
    Result(session="s", epoch=1, pos=5, chunk=2, token_ids=[9], logits_from=6),
    Cancel(session="s", epoch=3), Progress(session="s"),
    ProgressOk(session="s", received=-1, sent=-1, known=True, busy=False, lost_successor=False, draining=False),
    Repair(session="s", epoch=2, sig="00", next="/ip4/127.0.0.1/tcp/1/p2p/x", resend=4, until=2, mirror=True),
    RepairOk(session="s", kv_len=4, resent=4, mirrored=3),
    Receipt(session="s"), ReceiptOk(session="s", receipt={"sig": "00"}),
    Audit(session="s", job="j", window=0), AuditOk(session="s", job="j", window=0, opening={"rows": []}),
    AuditOffer(job={"job_id": "j"}), AuditOfferOk(job="j", queued=1, waiting=0),
    Error(reason="no", code="busy", session="s", epoch=2), Error(reason="gone", code="no_job", since_ms=5),
]


def test_every_frame_type_has_a_class_and_one_here():
    assert set(frames.FRAME_TYPES) == set(wire.SCHEMA) == {f.TYPE for f in ONE_OF_EACH}


@pytest.mark.parametrize("frame", ONE_OF_EACH, ids=lambda f: f.TYPE)
def test_a_frame_crosses_the_wire_and_comes_back_as_itself(frame):
    wire_map = frame.to_wire()
    assert wire_map["v"] == wire.VERSION and wire_map["type"] == frame.TYPE
    assert None not in (wire_map.get(name, 0) for name in frame.OPTIONAL)  # unset optional fields do not travel
    got = wire.validate(decode_body(encode_frame(frame)[4:]))
    assert type(got) is type(frame) and got == frame and got.to_wire() == wire_map


def test_required_fields_come_from_the_classes_and_are_checked():
    assert wire.SCHEMA["forward"] == {"session": (str,), "epoch": (int,), "pos": (int,), "chunk": (int,)}
    assert wire.SCHEMA["open"]["next"] == (str, type(None))  # required, nil at the tail
    wire_map = Result(session="s", epoch=0, pos=0, chunk=0, token_ids=[1]).to_wire()
    del wire_map["token_ids"]
    with pytest.raises(ProtocolError, match="result frame lacks field 'token_ids'"):
        wire.validate(wire_map)


def test_a_newer_peers_fields_ride_along_and_stay_signed(tmp_path):
    key = load_or_create_key(tmp_path / "c.key")
    signed = wire.open_frame(key, "s", None, 16, layers=[0, 2])
    newer = {**signed.to_wire(), "hint": {"x": 1}}  # a field this version does not know
    newer["sig"] = wire.open_frame(key, "s", None, 16, layers=[0, 2], extra={"hint": {"x": 1}}).sig
    got = wire.validate(newer)
    assert got.extra == {"hint": {"x": 1}} and got.to_wire() == newer
    assert receipts.assignment_ok(got, peer_id_of(key))  # what was signed is what arrived
    assert not receipts.assignment_ok(dataclasses.replace(got, extra={}), peer_id_of(key))
    assert receipts.assignment_ok(wire.validate(signed.to_wire()), peer_id_of(key))
    assert not receipts.assignment_ok(dataclasses.replace(signed, max_len=17), peer_id_of(key))


def test_an_optional_field_sent_as_nil_is_one_left_out():
    got = wire.validate({**Close(session="s").to_wire(), "keep": None})
    assert got == Close(session="s") and "keep" not in got.to_wire()


def test_rows_of_a_data_frame():
    assert Forward(session="s", epoch=0, pos=0, chunk=0, tokens=[1, 2, 3]).rows == 3
    assert Refill(session="s", epoch=0, pos=0, until=1, hidden=HIDDEN).rows == 2


def test_a_lost_link_is_a_value_that_never_travels():
    lost = LinkLost("stream reset")
    assert not isinstance(lost, frames.Frame) and lost.session is None and lost.TYPE == "_lost"
    with pytest.raises(TypeError, match="a frame is a map"):
        encode_frame(lost)

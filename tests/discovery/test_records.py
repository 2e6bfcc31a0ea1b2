"""discovery/records.py: signing, the validator's checks (each forgery fails closed), select."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from swarm.discovery.records import (MAX_TTL_S, RecordInvalid, StageRecord, open_record, record_key,
                                     select_record, sign_record)
from swarm.transport.identity import peer_id_of
from libp2p.crypto.ed25519 import create_new_key_pair

NOW = 1_000_000.0
MODEL = "ab" * 32
OTHER_MODEL = "cd" * 32


def _record(key, **over) -> StageRecord:
    pid = peer_id_of(key)
    base = dict(peer_id=pid, model_id=MODEL, model_name="stories260k", num_layers=5, layers=(0, 3),
                addrs=(f"/ip4/127.0.0.1/tcp/4001/p2p/{pid}",), max_ctx=512, free_kv_bytes=10 << 20,
                sessions=1, state="online", version="0.1.0", throughput_tps=120.5,
                rtt_ms={"12D3KooWpeer": 1.5}, seq=7, expires_at=NOW + 120)
    base.update(over)
    return StageRecord(**base)


@pytest.fixture(scope="module")
def key():
    return create_new_key_pair()


def test_round_trip(key):
    rec = _record(key)
    value = sign_record(key, rec)
    assert open_record(record_key(rec.peer_id), value, now=NOW) == rec
    assert open_record(record_key(rec.peer_id), value, now=NOW, accept_models=frozenset({MODEL})) == rec


@pytest.mark.parametrize("mutate,message", [
    (lambda key, v: v[:-1] + bytes([v[-1] ^ 1]), "signature"),                       # flipped signature bit
    (lambda key, v: b"\x00" + v, "malformed"),                                        # garbage
    (lambda key, v: msgpack.packb({"body": msgpack.packb({"v": 1}), "sig": b"x" * 64}), "malformed"),
])
def test_tampered_values_are_rejected(key, mutate, message):
    rec = _record(key)
    with pytest.raises(RecordInvalid, match=message):
        open_record(record_key(rec.peer_id), mutate(key, sign_record(key, rec)), now=NOW)


def test_body_edit_breaks_signature(key):
    rec = _record(key)
    outer = msgpack.unpackb(sign_record(key, rec))
    body = msgpack.unpackb(outer["body"])
    body["layers"] = [0, 5]  # claim more layers than signed
    outer["body"] = msgpack.packb(dict(sorted(body.items())))
    with pytest.raises(RecordInvalid, match="signature"):
        open_record(record_key(rec.peer_id), msgpack.packb(outer), now=NOW)


def test_peer_id_that_is_not_the_signer(key):
    other = create_new_key_pair()
    forged = _record(key, peer_id=peer_id_of(other))  # names another PeerId, signed by `key`
    with pytest.raises(RecordInvalid, match="key"):
        sign_record(key, forged)
    # hand-made: body names `other`, signature by `key`
    value = sign_record(key, _record(key))
    with pytest.raises(RecordInvalid, match="does not name the signer"):
        open_record(record_key(peer_id_of(other)), value, now=NOW)


@pytest.mark.parametrize("over,now,message", [
    ({"expires_at": NOW - 1}, NOW, "expired"),
    ({"expires_at": NOW + MAX_TTL_S + 5}, NOW, "too far out"),
    ({"layers": (3, 3)}, NOW, "layers"),
    ({"layers": (2, 6)}, NOW, "layers"),
    ({"state": "happy"}, NOW, "state"),
    ({"model_id": "not-hex"}, NOW, "model_id"),
    ({"sessions": -1}, NOW, "counts"),
    ({"throughput_tps": float("nan")}, NOW, "numbers"),
    ({"addrs": ()}, NOW, "addrs"),
])
def test_field_checks(key, over, now, message):
    rec = _record(key, **over)
    with pytest.raises(RecordInvalid, match=message):
        open_record(record_key(rec.peer_id), sign_record(key, rec), now=now)


def test_other_model_refused_where_not_accepted(key):
    rec = _record(key, model_id=OTHER_MODEL)
    with pytest.raises(RecordInvalid, match="not accepted"):
        open_record(record_key(rec.peer_id), sign_record(key, rec), now=NOW, accept_models=frozenset({MODEL}))


def test_select_prefers_highest_valid_seq(key):
    k = record_key(peer_id_of(key))
    old, new = sign_record(key, _record(key, seq=3)), sign_record(key, _record(key, seq=9))
    expired_newer = sign_record(key, _record(key, seq=99, expires_at=NOW - 1))
    assert select_record(k, [old, new], now=NOW) == 1
    assert select_record(k, [new, old], now=NOW) == 0
    assert select_record(k, [expired_newer, old], now=NOW) == 1
    assert select_record(k, [b"junk", old], now=NOW) == 1
    later = sign_record(key, dataclasses.replace(_record(key, seq=3), expires_at=NOW + 200))
    assert select_record(k, [old, later], now=NOW) == 1


REPRO_FACTS = {"schema": "swarm/repro/1", "device": "cpu", "isa": "x86_64 AVX2", "blas": "mkl 2024.2",
               "torch": "2.13.0", "dtype": "float32", "kernel": {"mode": "fma"}, "weights": "ef" * 32}


def _signed_body(key, body: dict) -> bytes:
    """A value signed over ``body`` as given (what another swarm version would publish)."""
    from swarm.discovery import records
    from swarm.transport.identity import sign

    raw = msgpack.packb(dict(sorted(body.items())), use_bin_type=True)
    return msgpack.packb({"body": raw, "sig": sign(key, records._SIGN_DOMAIN + raw)}, use_bin_type=True)


def test_the_reproducibility_class_travels_and_is_checked(key):
    from swarm import repro

    cls = repro.make(REPRO_FACTS).as_dict()
    rec = _record(key, repro=cls)
    value = sign_record(key, rec)
    assert open_record(record_key(rec.peer_id), value, now=NOW).repro == cls
    assert len(value) - len(sign_record(key, _record(key))) < 600  # the record stays small
    forged = _record(key, repro={**cls, "id": "rc1-0000000000000000"})
    with pytest.raises(RecordInvalid, match="repro .*not the digest of its facts"):
        open_record(record_key(rec.peer_id), sign_record(key, forged), now=NOW)


def test_old_records_and_newer_fields_still_open(key):
    rec = _record(key)
    body = msgpack.unpackb(rec.to_body())
    del body["repro"]  # a record of a stage that predates the class
    assert open_record(record_key(rec.peer_id), _signed_body(key, body), now=NOW).repro == {}
    body["a_later_field"] = [1, 2]  # a field of a later version: ignored, the rest opens
    assert open_record(record_key(rec.peer_id), _signed_body(key, body), now=NOW) == rec

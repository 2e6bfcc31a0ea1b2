"""swarm.openings: rows of frames, the window log, the commitment, signed openings and their check."""

from __future__ import annotations

import struct

import msgpack
import pytest

from swarm import openings, merkle, receipts
from swarm.errors import AuditFailed
from swarm.frames import Forward
from swarm.transport import load_or_create_key
from swarm.transport.identity import peer_id_of, sign

D = 3  # hidden size of the toy rows


def hidden(pos_rows: list[int], dtype="float32", scale=False) -> dict:
    """A (1, T, D) tensor map whose row t is D copies of the byte pos_rows[t] (4 bytes per value)."""
    data = b"".join(bytes([v]) * (4 * D) for v in pos_rows)
    m = {"dtype": dtype, "shape": [1, len(pos_rows), D], "data": data}
    if scale:
        m["scale"] = b"".join(struct.pack("<f", float(v)) for v in pos_rows)
    return m


def test_rows_are_the_exact_wire_bytes_of_each_position():
    assert openings.token_rows([1, 2**31 - 1]) == [b"\x01\0\0\0", b"\xff\xff\xff\x7f"]
    kind, rows = openings.hidden_rows(hidden([7, 8]))
    assert kind == "float32" and rows == [b"\x07" * 12, b"\x08" * 12]
    _, rows8 = openings.hidden_rows(hidden([7, 8], "float8_e4m3fn", scale=True))
    assert rows8[1] == b"\x08" * 12 + struct.pack("<f", 8.0)  # a float8 row carries its scale
    with pytest.raises(ValueError, match="do not split into rows"):
        openings.hidden_rows({"dtype": "float32", "shape": [1, 2, D], "data": b"x" * 5})
    with pytest.raises(ValueError, match="scale per row"):
        openings.hidden_rows({**hidden([1], "float8_e4m3fn"), "scale": b"xx"})


@pytest.mark.parametrize("scale", [False, True])
def test_rows_turn_back_into_the_frame_they_came_from(scale):
    m = hidden([3, 4, 5], "float8_e4m3fn" if scale else "float32", scale=scale)
    kind, rows = openings.hidden_rows(m)
    assert openings.tensor_map(kind, rows, D) == m
    assert openings.token_ids(openings.token_rows([0, 7, 2**31 - 1])) == [0, 7, 2**31 - 1]
    with pytest.raises(ValueError, match="present and of one length"):
        openings.tensor_map(kind, rows[:1] + [None], D)
    with pytest.raises(ValueError, match="4 bytes"):
        openings.token_ids([b"abc"])


def test_the_log_keeps_the_last_rows_computed_at_each_position():
    log = openings.WindowLog()
    log.record_chunk(Forward("s", 0, 0, 0, tokens=[5, 6, 7]), hidden([1, 2, 3]))
    log.record_chunk(Forward("s", 0, 3, 0, tokens=[8, 9]), hidden([4, 5]))
    log.record_chunk(Forward("s", 0, 4, 0, tokens=[10]), hidden([6]))  # a rollback into the last chunk
    assert len(log) == 5
    assert [r[1] for r in log.rows] == openings.token_rows([5, 6, 7, 8, 10])
    assert log.rows[4][2:] == ("float32", b"\x06" * 12)
    before = log.nbytes
    log.record_chunk(Forward("s", 0, 2, 0, tokens=[1]), hidden([9]))
    assert len(log) == 3 and log.nbytes < before


def test_the_tail_answers_only_the_last_rows_and_gaps_are_absent_rows():
    log = openings.WindowLog()
    log.record_chunk(Forward("s", 0, 2, 0, hidden=hidden([1, 2, 3])), [42])  # prefix-cached [0, 2); logits_from = 4
    assert log.rows[0] == log.rows[1] == (None, None, None, None)
    assert [r[3] for r in log.rows[2:]] == [None, None, struct.pack("<I", 42)]
    assert log.rows[4][2] == "token_ids" and log.rows[2][2] is None
    log.record_chunk(Forward("s", 0, 5, 0, hidden=hidden([4])), None)  # a refill that went no further
    assert log.rows[5] == ("float32", b"\x04" * 12, None, None)


def test_a_log_past_its_budget_drops_its_rows_for_good():
    log = openings.WindowLog(max_bytes=3 * (4 + 12 + 48))
    log.record_chunk(Forward("s", 0, 0, 0, tokens=[1, 2, 3]), hidden([1, 2, 3]))
    assert len(log) == 3 and not log.broken
    log.record_chunk(Forward("s", 0, 3, 0, tokens=[4]), hidden([4]))
    assert len(log) == 0 and log.nbytes == 0 and "--audit-retention-mb" in log.broken
    log.record_chunk(Forward("s", 0, 0, 0, tokens=[1]), hidden([1]))  # a rollback does not revive it
    assert len(log) == 0


def _commit(n: int, size: int) -> tuple[list, openings.Commitment]:
    log = openings.WindowLog()
    for pos in range(0, n, 5):  # chunks of 5 rows straddle windows of 4
        t = min(5, n - pos)
        ids = list(range(pos, pos + t))
        log.record_chunk(Forward("s", 0, pos, 0, tokens=ids), hidden([p % 256 for p in ids]))
    return log.snapshot(), openings.Commitment(log.snapshot(), size)


def test_a_chunk_straddling_a_window_gives_its_rows_to_both():
    rows, c = _commit(11, 4)
    assert c.field() == {"size": 4, "positions": 11, "leaves": 3, "root": c.tree.root.hex()}
    start, win, path = c.window(1)
    assert start == 4 and [r[1] for r in win] == openings.token_rows([4, 5, 6, 7])  # rows of chunks 0 and 1
    assert merkle.verify(merkle.leaf_hash(openings.leaf_data(1, 4, win)), 1, 3, path, c.tree.root)
    assert len(c.window(2)[1]) == 3  # the last window is short
    with pytest.raises(IndexError):
        c.window(3)
    with pytest.raises(ValueError, match="at least 1 position"):
        openings.Commitment(rows, 0)


@pytest.fixture
def signed(tmp_path):
    """A stage's signed receipt with a commitment over 11 positions in windows of 4, and its key."""
    key = load_or_create_key(tmp_path / "stage.key")
    _, c = _commit(11, 4)
    ledger = receipts.StageLedger("job-1", "n" * 32)
    body = ledger.body(session="sess", coordinator="c", peer_id=peer_id_of(key), model="m", model_digest="d",
                       range_digest="r", layers=[0, 1], num_layers=2, dtype="float32", wire_dtype="float32",
                       positions=11, windows=c.field())
    return receipts.sign_receipt(body, lambda d: sign(key, d)), c, key


def _open(receipt, c, key, k):
    opening = openings.sign_opening(openings.opening_body(receipt, c, k), lambda d: sign(key, d))
    return msgpack.unpackb(msgpack.packb(opening, use_bin_type=True), raw=False)  # as it arrives on the wire


def test_every_window_opens_and_checks(signed):
    receipt, c, key = signed
    for k in range(3):
        got = openings.check_opening(receipt, _open(receipt, c, key, k), k)
        assert got.window == k and got.start == 4 * k and got.peer_id == receipt["peer_id"]
        assert got.inputs() == [r[1] for r in c.rows[4 * k:4 * k + 4]]
        assert got.outputs() == [r[3] for r in c.rows[4 * k:4 * k + 4]]


def _tampers():
    def row_byte(o):
        o["rows"][1][1] = bytes([o["rows"][1][1][0] ^ 1]) + o["rows"][1][1][1:]

    def out_kind(o):
        o["rows"][0][2] = "bfloat16"

    def drop_row(o):
        o["rows"].pop()

    def path(o):
        o["path"][0] = bytes(32)

    def window(o):
        o["window"] = 2

    def root(o):
        o["root"] = "00" * 32

    def sig(o):
        o["sig"] = "00" * 64

    def schema(o):
        o["schema"] = "swarm/audit-opening/0"

    def bad_row(o):
        o["rows"][0] = [1, 2]

    return [(row_byte, "signature"), (out_kind, "signature"), (drop_row, "mismatch"), (path, "path"),
            (window, "mismatch"), (root, "mismatch"), (sig, "signature"), (schema, "schema"), (bad_row, "schema")]


@pytest.mark.parametrize("tamper,check", _tampers(), ids=lambda x: getattr(x, "__name__", x))
def test_a_tampered_opening_fails(signed, tamper, check):
    receipt, c, key = signed
    opening = _open(receipt, c, key, 1)
    tamper(opening)
    with pytest.raises(AuditFailed) as err:
        openings.check_opening(receipt, opening, 1)
    assert err.value.check == check, str(err.value)


def test_a_stage_that_re_signs_other_rows_fails_the_path(signed):
    """The stage itself lying about a window (rows changed, opening re-signed) is caught by the root."""
    receipt, c, key = signed
    opening = _open(receipt, c, key, 1)
    opening["rows"][2][3] = b"\x00" * 12
    del opening["sig"]
    opening = openings.sign_opening(opening, lambda d: sign(key, d))
    with pytest.raises(AuditFailed) as err:
        openings.check_opening(receipt, opening, 1)
    assert err.value.check == "path"


def test_a_receipt_without_windows_or_signature_cannot_be_audited(signed, tmp_path):
    receipt, c, key = signed
    opening = _open(receipt, c, key, 0)
    old = {k: v for k, v in receipt.items() if k != "windows"}
    old = receipts.sign_receipt(old, lambda d: sign(key, d))
    with pytest.raises(AuditFailed, match="commits to no windows"):
        openings.check_opening(old, opening)
    with pytest.raises(AuditFailed, match="signature does not verify"):
        openings.check_opening({**receipt, "positions": 12}, opening)
    other = load_or_create_key(tmp_path / "other.key")
    forged = openings.sign_opening({k: v for k, v in opening.items() if k != "sig"}, lambda d: sign(other, d))
    with pytest.raises(AuditFailed) as err:
        openings.check_opening(receipt, forged)
    assert err.value.check == "signature"


@pytest.mark.process
def test_the_module_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys, swarm.openings, swarm.merkle, swarm.repro; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

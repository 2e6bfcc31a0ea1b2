"""swarm.stage.retention's spill to disk (--audit-retention-dir): bounds, eviction order, reading back,
a corrupt file refused with a reason, cleaning at start-up; and an audit answered from a spilled job."""

from __future__ import annotations

import pytest
import trio

from swarm import openings
from swarm.frames import Audit
from swarm.stage.retention import RetentionCorrupt, RetentionStore, encode_spilled, spill_name
from tests.stage.test_retention import _Stream, commitment


def _signed(key, c: openings.Commitment, job: str) -> dict:
    from swarm import receipts
    from swarm.transport.identity import peer_id_of, sign

    body = receipts.StageLedger(job, "n" * 32).body(
        session="s", coordinator="c", peer_id=peer_id_of(key), model="m", model_digest="d", range_digest="r",
        layers=[0, 1], num_layers=2, dtype="float32", wire_dtype="float32", positions=c.positions,
        windows=c.field())
    return receipts.sign_receipt(body, lambda d: sign(key, d))


@pytest.fixture
def key(tmp_path):
    from swarm.transport import load_or_create_key

    return load_or_create_key(tmp_path / "stage.key")


def _store(tmp_path, key, in_memory: int, on_disk: int, jobs: int, rows: int = 10):
    """A store holding ``in_memory`` jobs in memory and room for ``on_disk`` spill files, after ``jobs`` puts."""
    one = commitment(rows).nbytes
    file_bytes = len(encode_spilled("s", "job-0", _entry(key, "job-0", rows)))
    store = RetentionStore(in_memory * one, tmp_path / "spill", on_disk * file_bytes + file_bytes // 2)
    receipts = {}
    for n in range(jobs):
        c = commitment(rows)
        receipts[n] = _signed(key, c, f"job-{n}")
        assert store.put("s", f"job-{n}", receipts[n], c)
    return store, receipts


def _entry(key, job, rows):
    from swarm.stage.retention import Retained

    c = commitment(rows)
    return Retained(_signed(key, c, job), c)


def test_evicted_jobs_spill_to_disk_oldest_deleted_first_within_the_bound(tmp_path, key):
    store, receipts = _store(tmp_path, key, in_memory=2, on_disk=3, jobs=7)
    files = sorted(p.name for p in (tmp_path / "spill").iterdir())
    assert len(files) == 3 and store.disk_bytes <= store.disk_max_bytes and store.nbytes <= store.max_bytes
    # memory: jobs 5, 6; disk: 2, 3, 4 (0 and 1, the oldest, deleted); nothing else in the directory
    assert files == sorted(spill_name("s", f"job-{n}") for n in (2, 3, 4))
    for n in (0, 1):
        assert store.get("s", f"job-{n}") is None and store.evicted("s", f"job-{n}")
    assert store.evictions == 2 and store.spilled == 5 and len(store) == 5
    for n in (2, 3, 4, 5, 6):  # read back: the same receipt, rows and root as signed
        got = store.get("s", f"job-{n}")
        assert got.receipt == receipts[n] and got.commitment.field() == commitment(10).field()
    assert store.reloaded == 3


def test_a_spilled_job_signed_again_leaves_the_disk(tmp_path, key):
    store, _ = _store(tmp_path, key, in_memory=1, on_disk=4, jobs=3)
    assert store.spilled == 2 and (tmp_path / "spill" / spill_name("s", "job-0")).exists()
    c = commitment(10)
    store.put("s", "job-0", _signed(key, c, "job-0"), c)  # job-0 back in memory, job-2 out to the disk
    assert not (tmp_path / "spill" / spill_name("s", "job-0")).exists()
    assert (tmp_path / "spill" / spill_name("s", "job-2")).exists() and len(store) == 3


def test_a_job_larger_than_the_disk_bound_is_forgotten_and_without_a_spill_dir_nothing_is_written(tmp_path, key):
    store = RetentionStore(commitment(10).nbytes, tmp_path / "spill", 100)  # no file fits 100 bytes
    for n in range(2):
        c = commitment(10)
        store.put("s", f"job-{n}", _signed(key, c, f"job-{n}"), c)
    assert store.evicted("s", "job-0") and list((tmp_path / "spill").iterdir()) == [] and store.disk_bytes == 0
    plain = RetentionStore(commitment(10).nbytes)
    for n in range(2):
        plain.put("s", f"job-{n}", {}, commitment(10))
    assert plain.spill_dir is None and plain.evicted("s", "job-0")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "rows", "another job"])
def test_a_corrupt_spill_file_is_a_clear_refusal_and_the_file_is_dropped(tmp_path, key, damage):
    import msgpack

    store, _ = _store(tmp_path, key, in_memory=1, on_disk=4, jobs=2)
    path = tmp_path / "spill" / spill_name("s", "job-0")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\xc1" * 40)
    else:
        doc = msgpack.unpackb(data, raw=False)
        if damage == "rows":
            doc["rows"][3][1] = b"\x01" * len(doc["rows"][3][1])  # one input row changed: another root
        else:
            doc["job"] = "job-9"
        path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    with pytest.raises(RetentionCorrupt, match=str(path)) as err:
        store.get("s", "job-0")
    want = {"truncate": "not a msgpack document|not a swarm/retained/1", "garbage": "not a msgpack",
            "rows": "do not hash to the root its receipt signed", "another job": "of another job"}[damage]
    assert err.match(want)
    assert not path.exists() and store.evicted("s", "job-0") and store.get("s", "job-0") is None
    assert store.get("s", "job-1") is not None  # the others are untouched


def test_a_stage_of_another_key_starting_on_the_directory_deletes_old_spill_files_only(tmp_path, key):
    spill = tmp_path / "spill"
    _store(tmp_path, key, in_memory=1, on_disk=4, jobs=3)
    (spill / ".x.ret.0123.part").write_bytes(b"half")  # an interrupted write
    (spill / "notes.txt").write_text("mine")
    assert len(list(spill.glob("*.ret"))) == 2
    store = RetentionStore(1 << 20, spill, 1 << 20)
    assert not (spill / ".x.ret.0123.part").exists()  # at once; the spill files wait for the key (adopt)
    assert store.adopt(lambda receipt: False) == 0  # none signed by this stage's key
    assert sorted(p.name for p in spill.iterdir()) == ["notes.txt"] and len(store) == 0
    assert store.get("s", "job-0") is None and not store.evicted("s", "job-0")


def test_an_audit_of_a_spilled_job_is_answered_and_a_corrupt_one_refused(tmp_path, key):
    from swarm import wire
    from swarm.stage.openings import Audits
    from swarm.transport.identity import peer_id_of

    store, receipts = _store(tmp_path, key, in_memory=1, on_disk=4, jobs=3)
    audits = Audits(store, "[0, 1)", key=lambda: key, peer_id=lambda: peer_id_of(key), busy=lambda: False,
                    error=lambda reason, code, session=None: wire.error_frame(reason, code, session))
    (tmp_path / "spill" / spill_name("s", "job-1")).write_bytes(b"not rows")

    async def main():
        stream = _Stream()
        await audits.answer(stream, Audit("s", "job-0", 1))
        await audits.answer(stream, Audit("s", "job-1", 0))
        await audits.answer(stream, Audit("s", "job-1", 0))
        ok, bad, gone = (m for _, m in stream.sent)
        assert ok["type"] == "audit_ok" and openings.check_opening(receipts[0], ok["opening"], 1).start == 4
        assert bad["code"] == "no_job" and "cannot be opened" in bad["reason"] and "not a msgpack" in bad["reason"]
        assert gone["code"] == "no_job" and "was evicted" in gone["reason"]

    trio.run(main)


def test_check_refuses_a_retention_dir_the_stage_could_not_use(tmp_path, monkeypatch) -> None:
    """`swarm stage --check` says what the real start would: a file, or a place nothing can be written."""
    from swarm.config import StageConfig
    from swarm.errors import ConfigError
    from swarm.ranges import LayerRange
    from swarm.stage.preflight import preflight
    from tests.support.models import make_synthetic

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = make_synthetic("llama", tmp_path / "m", dtype="float32")
    a_file = tmp_path / "afile"
    a_file.write_text("")

    def check(where):
        return preflight(StageConfig.of(model=str(model), layers=LayerRange(0, 1), device="cpu",
                                     key_path=tmp_path / "k.key", audit_retention_dir=where))

    with pytest.raises(ConfigError, match="not a directory"):
        check(a_file)
    with pytest.raises(ConfigError, match="not a writable directory"):
        check(a_file / "below")
    assert check(tmp_path / "new" / "spill")["weights_bytes"] > 0  # creatable: fine, and nothing is created
    assert not (tmp_path / "new").exists()

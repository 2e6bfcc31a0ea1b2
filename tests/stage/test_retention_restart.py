"""A restarted stage and its earlier jobs (issue 45 item 18): the spill files its own key signed are taken
over by the next run (others' and altered ones deleted), and a job it holds no record of is answered
with the time it (re)started, which the auditor counts as ``unavailable``, not as failed."""

from __future__ import annotations

import msgpack
import pytest
import trio

from swarm import openings, wire
from swarm.frames import Audit
from swarm.stage.openings import Audits
from swarm.stage.retention import RetentionStore, encode_spilled, spill_name
from tests.stage.test_retention import _Stream
from tests.stage.test_retention_spill import _entry, _store, key  # noqa: F401  (key: a fixture)


def _audits(store, key, started_ms=None):
    from swarm.transport.identity import peer_id_of

    return Audits(store, "[0, 1)", key=lambda: key, peer_id=lambda: peer_id_of(key), busy=lambda: False,
                  error=lambda reason, code, session=None: wire.error_frame(reason, code, session),
                  started_ms=started_ms)


def test_a_restarted_stage_opens_the_jobs_it_spilled_and_drops_the_files_not_its_own(tmp_path, key):
    from swarm.transport import load_or_create_key

    spill = tmp_path / "spill"
    _, receipts = _store(tmp_path, key, in_memory=1, on_disk=4, jobs=4)  # jobs 0-2 on disk, 3 in memory
    other = load_or_create_key(tmp_path / "other.key")
    (spill / spill_name("s", "job-x")).write_bytes(encode_spilled("s", "job-x", _entry(other, "job-x", 10)))
    altered = spill / spill_name("s", "job-2")
    doc = msgpack.unpackb(altered.read_bytes(), raw=False)
    doc["rows"][3][1] = b"\x01" * len(doc["rows"][3][1])
    altered.write_bytes(msgpack.packb(doc, use_bin_type=True))
    moved = spill / spill_name("s", "job-y")  # this stage's own file, under another job's name
    moved.write_bytes((spill / spill_name("s", "job-1")).read_bytes())

    # the restart (SIGTERM, then the same key on the same --audit-retention-dir): job 3 was only in memory
    store = RetentionStore(1 << 20, spill, 1 << 20)
    audits = _audits(store, key)

    async def main():
        stream = _Stream()
        for job, window in (("job-0", 1), ("job-1", 0), ("job-2", 0), ("job-x", 0), ("job-3", 0)):
            await audits.answer(stream, Audit("s", job, window))
        return [m for _, m in stream.sent]

    ok0, ok1, *gone = trio.run(main)
    assert ok0["type"] == "audit_ok" and openings.check_opening(receipts[0], ok0["opening"], 1).start == 4
    assert ok1["type"] == "audit_ok" and openings.check_opening(receipts[1], ok1["opening"], 0).start == 0
    for err in gone:  # altered, another key's, and the job that was in memory: the restart time, not a refusal
        assert err["code"] == "no_job" and err["since_ms"] == audits.started_ms, err
        assert "(re)started at" in err["reason"]
    assert sorted(p.name for p in spill.iterdir()) == sorted(spill_name("s", f"job-{n}") for n in (0, 1))
    assert store.adopted == 2 and len(store) == 2 and store.disk_bytes <= store.disk_max_bytes


def test_a_restarted_stage_keeps_its_own_files_within_the_disk_bound_oldest_dropped(tmp_path, key):
    spill = tmp_path / "spill"
    _store(tmp_path, key, in_memory=1, on_disk=4, jobs=5)  # jobs 0-3 on disk
    size = (spill / spill_name("s", "job-0")).stat().st_size
    store = RetentionStore(1 << 20, spill, 2 * size)  # restarted with a smaller --audit-retention-disk-mb
    _audits(store, key).adopt()
    assert store.adopted == 2 and store.disk_bytes <= 2 * size
    assert store.get("s", "job-3") is not None and store.get("s", "job-0") is None


class _Host:
    """An auditor's host whose streams reach ``audits.answer`` in this process."""

    peer_id = "12D3KooWauditor"

    def __init__(self, audits):
        self.audits = audits

    async def open_stream(self, addr, protocol, timeout_s=None):
        return _Pipe(self.audits)


class _Pipe:
    remote_peer_id = "12D3KooWauditor"

    def __init__(self, audits):
        self.audits, self.replies = audits, []

    async def send(self, msg, timeout_s=None):
        msg = msg.to_wire()  # as the wire carries it
        if msg.get("type") == "audit":
            await self.audits.answer(self, wire.validate(msg))
        else:
            self.replies.append(msg)

    async def recv(self, timeout_s=None):
        return self.replies.pop(0)

    async def aclose(self):
        pass


def test_the_auditor_counts_a_stage_restarted_since_the_job_unavailable_not_failed(tmp_path, key):
    from swarm.auditor.run import RESTART_SKEW_MS, Auditor
    from swarm.receipts import now_ms

    _, receipts = _store(tmp_path, key, in_memory=1, on_disk=4, jobs=2)
    receipt = receipts[1]  # job 1 was in memory: a restart loses it
    ended = receipt["ended_ms"]
    cases = {"restarted after the job": ended + 1, "restarted before the job ended": ended - 1,
             "a restart claimed ahead of the clock": now_ms() + 10 * RESTART_SKEW_MS}
    got = {}
    for case, started_ms in cases.items():
        store = RetentionStore(1 << 20, tmp_path / "spill", 1 << 20)
        auditor = Auditor(_Host(_audits(store, key, started_ms)), key, blocks=None)
        verdict = trio.run(auditor.audit_stage, receipt, "/ip4/127.0.0.1/tcp/1", 0, None)
        auditor._count(verdict)
        got[case] = (verdict.outcome, auditor.counts()[receipt["peer_id"]])
    outcome, counts = got["restarted after the job"]
    assert outcome == "unavailable"
    assert counts == {"audited": 0, "passed": 0, "failed": 0, "unavailable": 1}
    for case in ("restarted before the job ended", "a restart claimed ahead of the clock"):
        assert got[case] == ("refused", {"audited": 1, "passed": 0, "failed": 1}), case


def test_the_tally_file_sums_unavailable_apart_and_reads_old_files(tmp_path):
    import json

    from swarm.auditor.tally import add_tally, audit_column, read_tally
    from swarm.discovery.peers import _audit_text

    path = tmp_path / "tally.json"
    path.write_text(json.dumps({"A": {"audited": 2, "passed": 2, "failed": 0}}))  # written before the count existed
    add_tally(path, {"A": {"audited": 0, "passed": 0, "failed": 0, "unavailable": 1},
                     "B": {"audited": 1, "passed": 1, "failed": 0}})
    assert read_tally(path) == {"A": {"audited": 2, "passed": 2, "failed": 0, "unavailable": 1},
                                "B": {"audited": 1, "passed": 1, "failed": 0}}
    column = audit_column(path, {})  # what `swarm peers --audits` shows
    assert [_audit_text(column[p]) for p in "AB"] == ["2/2/0, 1 unavailable", "1/1/0"]


@pytest.mark.ring
@pytest.mark.slow
@pytest.mark.parametrize("stop", ["drained", "killed"])
def test_a_stage_restarted_under_its_key_passes_audits_of_spilled_jobs_and_is_unavailable_for_the_rest(tmp_path,
                                                                                                      stop):
    """The report, in process: one stage (layers [0, 4), --audit-retention-dir) runs two jobs, the older spilled
    to the directory; the stage stops (drained, as SIGTERM does, or killed) and starts again with the same
    key and directory; an auditor's audit of the spilled job passes; of the job that was in memory it passes
    after a drain (the drain spills it) and is ``unavailable`` after a kill; neither is failed."""
    from swarm.auditor.judge import Blocks
    from swarm.auditor.run import Auditor
    from swarm.errors import collapse
    from swarm.transport import load_or_create_key, open_host
    from tests.stage.test_audit_ring import _job
    from tests.support.models import make_synthetic
    from tests.support.ring import LOOPBACK, start_ring

    model_dir = make_synthetic("llama", tmp_path / "model", "float64")
    spill = tmp_path / "spill"
    got: dict = {}

    async def main():
        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, [(0, 4)], tmp_path, audit_retention_dir=spill,
                                                 audit_retention_disk_mb=64)
                _, (first,) = await _job(spec, model_dir, tmp_path, "job-a")
                store = servers[0].audits.store
                store.max_bytes = store.nbytes + 1  # room for one job of this size: the first goes to a file
                _, (second,) = await _job(spec, model_dir, tmp_path, "job-b")
                got["spilled"] = store.spilled
                if stop == "drained":
                    await servers[0].drain(1.0)
                nursery.cancel_scope.cancel()  # the stage stops (its memory is gone)
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, [(0, 4)], tmp_path, audit_retention_dir=spill,
                                                 audit_retention_disk_mb=64)
                assert servers[0].host.peer_id == first["peer_id"]  # the same key
                key = load_or_create_key(tmp_path / "auditor.key")
                async with open_host(key, [LOOPBACK]) as host:
                    auditor = Auditor(host, key, Blocks(model_dir), rate=1.0)
                    for name, receipt in (("spilled job", first), ("in-memory job", second)):
                        verdict = await auditor.audit_stage(receipt, spec.stages[0].addr, 1, None)
                        auditor._count(verdict)
                        got[name] = verdict
                got["counts"] = auditor.counts()[first["peer_id"]]
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    assert got["spilled"] == 1
    assert got["spilled job"].outcome == "passed", got["spilled job"].line()
    if stop == "drained":
        assert got["in-memory job"].outcome == "passed", got["in-memory job"].line()
        assert got["counts"] == {"audited": 2, "passed": 2, "failed": 0}
        return
    assert got["in-memory job"].outcome == "unavailable", got["in-memory job"].line()
    assert "(re)started" in got["in-memory job"].reason
    assert got["counts"] == {"audited": 1, "passed": 1, "failed": 0, "unavailable": 1}


@pytest.mark.ring
@pytest.mark.process
@pytest.mark.slow
def test_swarm_audit_of_a_job_before_a_restart_says_unavailable_and_exits_0(tmp_path):
    """The report as a user runs it: a stage serves a job, is stopped (killed: its memory is gone) and
    started again under the same key at the same address; ``swarm audit run`` prints UNAVAILABLE, not
    REFUSED, exits 0 and its tally counts the stage unavailable, not failed."""
    import json
    from pathlib import Path

    from swarm.config import StageConfig
    from swarm.errors import collapse
    from swarm.model.block import load_block
    from swarm.model.resolve import model_manifest_digest
    from swarm.ranges import LayerRange
    from swarm.stage.daemon import serve
    from swarm.stage.server import StageServer
    from swarm.transport import load_or_create_key
    from tests.support.cli import run_swarm
    from tests.support.models import make_synthetic
    from tests.support.ring import signed_job, start_ring

    model_dir = make_synthetic("llama", tmp_path / "model", "float64")
    got: dict = {}

    async def main():
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model_dir, [(0, 4)], tmp_path)
                res = await signed_job(spec, model_dir, tmp_path, [1 + i % 50 for i in range(20)], tmp_path / "r", 4)
                nursery.cancel_scope.cancel()
            listen = spec.stages[0].addr.split("/p2p/")[0]  # the same address: the receipt's ring names it
            async with trio.open_nursery() as nursery:
                r = LayerRange(0, 4)
                server = StageServer(StageConfig.of(model=str(model_dir), layers=r),
                                     load_block(model_dir, r, dtype="float64", device="cpu"), Path(model_dir).name,
                                     model_manifest_digest(model_dir))
                await nursery.start(serve, server, load_or_create_key(tmp_path / "s0-4.key"), listen)
                got["run"] = await trio.to_thread.run_sync(lambda: run_swarm(
                    "audit", "run", res["path"], "--model", str(model_dir), "--rate", "1", "--key",
                    str(tmp_path / "aud.key"), "--tally", str(tmp_path / "tally.json"), timeout=180))
                got["peer"] = server.host.peer_id
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    run = got["run"]
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert f"UNAVAILABLE stage {got['peer'][:16]}" in run.stdout and "REFUSED" not in run.stdout, run.stdout
    assert "0 stage(s) failed, 1 unavailable" in run.stderr
    assert json.loads((tmp_path / "tally.json").read_text())[got["peer"]] == {
        "audited": 0, "passed": 0, "failed": 0, "unavailable": 1}

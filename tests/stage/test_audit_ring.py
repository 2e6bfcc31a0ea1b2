"""Openable receipts on a real ring (in-process stages, libp2p loopback): after a job, window k of every
stage opens, checks against that stage's signed receipt, and stage i's opened output rows are stage
i + 1's opened input rows; an unknown, evicted or out-of-range job gets a clear error, and the stage
keeps serving."""

from __future__ import annotations

import pytest
import torch
import trio

from swarm import openings, receipts
from swarm.config import SpecConfig
from swarm.coordinator.drafters import NgramDrafter
from swarm.errors import AuditFailed, collapse
from swarm.stage.membership import record_fields
from swarm.transport import load_or_create_key, open_host
from tests.support.models import make_synthetic, reference_greedy
from tests.support.ring import LOOPBACK, ring_generate, start_ring

pytestmark = pytest.mark.ring

RANGES = [(0, 1), (1, 3), (3, 4)]
PROMPT = [1 + (i * 7) % 50 for i in range(70)]  # 70 positions of prompt: windows 0 and 1 of 64
NEW = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic("llama", tmp_path_factory.mktemp("audit-model"), "float64")


async def _job(spec, model_dir, key_dir, job_id: str, **kw) -> tuple[list[int], list[dict]]:
    job = {"id": job_id, "nonce": receipts.new_nonce()}
    info: dict = {}
    out = await ring_generate(spec, model_dir, 4, PROMPT, NEW, key_dir, info=info, job=job, **kw)
    return out, info["receipt_parts"]["stage_receipts"]


async def _refusal(host, addr, receipt, window) -> AuditFailed:
    with pytest.raises(AuditFailed) as err:
        await openings.open_window(host, addr, receipt, window, timeout_s=10)
    assert err.value.check == "refused"
    return err.value


def _run(main):
    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def test_windows_open_check_and_chain_between_stages(model_dir, tmp_path):
    """Speculation (n-gram, K=4, depth 2) rolls rows back mid-job; the opened rows are the last ones."""
    got: dict = {}

    async def main():
        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, RANGES, tmp_path)
                out, stage_receipts = await _job(spec, model_dir, tmp_path, "job-a",
                                                 spec_config=SpecConfig(draft="ngram", k=4, depth=2),
                                                 drafter=NgramDrafter())
                got["out"] = out
                addrs = [s.addr for s in spec.stages]
                async with open_host(load_or_create_key(tmp_path / "auditor.key"), [LOOPBACK]) as host:
                    got["windows"] = [r["windows"] for r in stage_receipts]
                    got["stage_receipts"] = stage_receipts
                    got["openings"] = [[await openings.open_window(host, a, r, k, timeout_s=10)
                                        for k in range(r["windows"]["leaves"])]
                                       for a, r in zip(addrs, stage_receipts)]
                    r0 = stage_receipts[0]
                    got["unknown"] = await _refusal(host, addrs[0], {**r0, "job_id": "no-such-job"}, 0)
                    got["past_end"] = await _refusal(host, addrs[0], r0, r0["windows"]["leaves"])
                    # the stage serves on: another job after the refusals
                    got["again"], _ = await _job(spec, model_dir, tmp_path, "job-b")
                got["answered"] = [s.audits.answered for s in servers]
                got["records"] = [_record_round_trip(s) for s in servers]
                nursery.cancel_scope.cancel()

    _run(main)
    assert got["out"] == reference_greedy(model_dir, PROMPT, NEW, "float64") == got["again"]
    positions = len(PROMPT) + NEW - 1  # the last token is never fed back
    for w in got["windows"]:
        assert w["size"] == 64 and w["positions"] >= positions and w["leaves"] == 2
    for i, stage in enumerate(got["openings"]):
        assert [o.window for o in stage] == [0, 1] and [o.start for o in stage] == [0, 64]
        ins = [x for o in stage for x in o.inputs()]
        outs = [x for o in stage for x in o.outputs()]
        assert all(x is not None for x in ins[:positions]), f"stage {i} lacks input rows"
        if i == 0:  # the head's input rows are the token ids it was fed
            assert ins[:positions] == openings.token_rows(PROMPT + got["out"][:-1])
        if i < len(RANGES) - 1:
            nxt = [x for o in got["openings"][i + 1] for x in o.inputs()]
            assert outs[:positions] == nxt[:positions], f"stage {i}'s outputs are not stage {i + 1}'s inputs"
        else:  # the tail's output rows are the token after each row it answered for
            assert outs[len(PROMPT) - 1:positions] == openings.token_rows(got["out"])  # row p: the token at p + 1
    assert "no_job" in str(got["unknown"]) and "is not known to this stage" in str(got["unknown"])
    assert got["unknown"].code == "no_job"
    assert got["past_end"].code == "bad_request" and "there is no window 2" in str(got["past_end"])
    assert got["answered"] == [2, 2, 2]
    # the class a stage announces on the DHT (its whole block, solo tile) is the one its receipts sign
    assert [r["repro"] for r in got["records"]] == [w["repro"] for w in got["stage_receipts"]]
    # what an audit does with the openings: re-run each stage's block on its opened inputs, here in the
    # same class (same process, machine and weights), and get the opened outputs bit for bit
    for (a, b), stage in zip(RANGES, got["openings"]):
        assert _recompute(model_dir, a, b, stage, positions) == [x for o in stage for x in o.outputs()][:positions]


def _recompute(model_dir, start: int, end: int, opened, positions: int) -> list:
    """The output rows of layers [start, end) on the opened input rows [0, positions), as the stage
    would send them (one chunk: row invariance makes the chunking irrelevant)."""
    from swarm import wire
    from swarm.model.block import load_block
    from swarm.ranges import LayerRange

    block = load_block(model_dir, LayerRange(start, end), dtype="float64", device="cpu")
    rows = [r for o in opened for r in o.rows][:positions]
    kind, ins = rows[0][0], [r[1] for r in rows]
    if kind == "tokens":
        x = torch.tensor([openings.token_ids(ins)], dtype=torch.long)
    else:
        x = wire.decode_tensor(openings.tensor_map(kind, ins, block.hidden_size))
    (y,) = block.forward_batch([(block.new_cache(positions), 0, x)])
    if end == 4:  # the tail: the greedy token after each row it answered for (from the prompt's last row)
        answered = positions - (len(PROMPT) - 1)
        return [None] * (len(PROMPT) - 1) + openings.token_rows(y[0, -answered:].argmax(dim=-1).tolist())
    return openings.hidden_rows(wire.encode_tensor(y))[1]


def _record_round_trip(server):
    """The stage's DHT record fields, signed and opened as a reader would."""
    from swarm.discovery.records import StageRecord, open_record, record_key, sign_record

    fields = record_fields(server, "ab" * 32, 1.0)
    rec = StageRecord(peer_id=server.host.peer_id, rtt_ms={}, seq=1, expires_at=1000.0, **fields)
    opened = open_record(record_key(rec.peer_id), sign_record(server.key, rec), now=999.0)
    return {"repro": opened.repro}


def test_an_evicted_job_is_refused_clearly(model_dir, tmp_path):
    """A stage whose retention holds one job evicts the older job for the newer: the older one's audit
    says so, the newer one still opens, and the stage goes on."""
    got: dict = {}

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, [(0, 1), (1, 4)], tmp_path)
                _, first = await _job(spec, model_dir, tmp_path, "job-e")
                store = servers[1].audits.store
                store.max_bytes = store.nbytes + 1  # room for one job of this size (--audit-retention-mb)
                _, second = await _job(spec, model_dir, tmp_path, "job-f")
                got["kept"] = len(store)
                async with open_host(load_or_create_key(tmp_path / "auditor.key"), [LOOPBACK]) as host:
                    got["evicted"] = await _refusal(host, spec.stages[1].addr, first[1], 0)
                    got["opened"] = await openings.open_window(host, spec.stages[1].addr, second[1], 1, timeout_s=10)
                got["again"], _ = await _job(spec, model_dir, tmp_path, "job-g")
                nursery.cancel_scope.cancel()

    _run(main)
    assert got["kept"] == 1
    assert got["evicted"].code == "no_job" and "evicted" in str(got["evicted"])
    assert "--audit-retention-mb" in str(got["evicted"])
    assert got["opened"].job_id == "job-f" and got["opened"].window == 1
    assert got["again"] == reference_greedy(model_dir, PROMPT, NEW, "float64")


def test_a_job_evicted_to_the_retention_dir_still_opens_and_the_dir_is_cleaned_at_start(model_dir, tmp_path):
    """--audit-retention-dir: the older job leaves memory for a file, an audit of it is answered from the
    file (the same signed rows), and a stage of another key started on the directory deletes the file."""
    spill = tmp_path / "spill"
    got: dict = {}

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, [(0, 1), (1, 4)], tmp_path,
                                                 audit_retention_dir=spill, audit_retention_disk_mb=64)
                _, first = await _job(spec, model_dir, tmp_path, "job-s")
                store = servers[1].audits.store
                store.max_bytes = store.nbytes + 1  # room for one job of this size in memory
                _, second = await _job(spec, model_dir, tmp_path, "job-t")
                got["files"] = sorted(p.name for p in spill.iterdir())
                got["in_memory"], got["spilled"] = len(store._jobs), store.spilled
                async with open_host(load_or_create_key(tmp_path / "auditor.key"), [LOOPBACK]) as host:
                    got["opened"] = [await openings.open_window(host, spec.stages[1].addr, first[1], k, timeout_s=10)
                                     for k in (0, 1)]
                got["reloaded"] = store.reloaded
                nursery.cancel_scope.cancel()

    _run(main)
    assert got["in_memory"] == 1 and got["spilled"] >= 1 and len(got["files"]) >= 1
    assert all(name.endswith(".ret") for name in got["files"])
    assert [o.job_id for o in got["opened"]] == ["job-s"] * 2 and got["opened"][1].window == 1
    assert got["reloaded"] == 1  # read once, both windows answered from it
    from swarm.stage.retention import RetentionStore

    RetentionStore(1 << 20, spill, 1 << 20).adopt(lambda receipt: False)  # another key's stage starting on it
    assert not any(p.name.endswith(".ret") for p in spill.iterdir())


def test_a_job_larger_than_the_retention_commits_to_no_windows(model_dir, tmp_path):
    """A job whose rows outgrow --audit-retention-mb is signed without a window root (an audit of it
    cannot be answered, and says the job is unknown), with its class, and generation is untouched."""
    got: dict = {}

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model_dir, [(0, 4)], tmp_path, audit_retention_mb=0.001)
                got["out"], (got["receipt"],) = await _job(spec, model_dir, tmp_path, "job-big")
                async with open_host(load_or_create_key(tmp_path / "auditor.key"), [LOOPBACK]) as host:
                    with_root = {**got["receipt"], "windows": {"size": 64, "positions": 1, "leaves": 1,
                                                               "root": "00" * 32}}
                    got["refused"] = await _refusal(host, spec.stages[0].addr, with_root, 0)
                nursery.cancel_scope.cancel()

    _run(main)
    assert "windows" not in got["receipt"] and got["receipt"]["repro"]["id"].startswith("rc1-")
    assert got["refused"].code == "no_job" and "not known" in str(got["refused"])
    assert got["out"] == reference_greedy(model_dir, PROMPT, NEW, "float64")


def test_the_tail_signs_the_ids_it_answered_and_a_lying_coordinator_is_caught(model_dir, tmp_path):
    """Speculation rolls rows back; the tail's signed answers are still the job's output ids, and a job
    receipt whose coordinator changed an output id (re-signed, digest fixed up) fails verification."""
    import json

    from swarm.transport.identity import sign
    from tests.support.ring import signed_job

    got: dict = {}

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model_dir, RANGES, tmp_path)
                got["res"] = await signed_job(spec, model_dir, tmp_path, PROMPT, tmp_path / "r", NEW,
                                              spec=SpecConfig(draft="ngram", k=4, depth=2), drafter=NgramDrafter())
                nursery.cancel_scope.cancel()

    _run(main)
    doc, out = got["res"]["doc"], got["res"]["output_ids"]
    assert got["res"]["verified"] and doc["ring"] and len(out) == NEW
    answers = doc["stage_receipts"][-1]["answers"]
    assert answers["from"] == len(PROMPT) - 1
    assert answers["ids"][:NEW] == out and "answers" not in doc["stage_receipts"][0]
    key = load_or_create_key(tmp_path / "coord.key")
    lie = json.loads(json.dumps(doc))
    lie["output_ids"][3] = (lie["output_ids"][3] + 1) % 97
    lie["output_digest"] = receipts.ids_digest(lie["output_ids"])
    lie = receipts.sign_receipt(lie, lambda data: sign(key, data))
    with pytest.raises(receipts.ReceiptInvalid) as err:
        receipts.verify_job(lie)
    assert err.value.check == "answers" and "output id 3" in str(err.value)
    assert "not what the ring answered" in str(err.value)

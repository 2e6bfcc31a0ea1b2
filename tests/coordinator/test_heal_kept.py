"""Heals that keep the survivors' KV caches (in-process stages, real libp2p on loopback).

A stage is stopped mid-generation (its host closes, as a killed process's connections end); the
coordinator swaps in the spare, the predecessor resends the hidden states it sent (the coordinator
the token ids, for a lost head), only the spare computes them, and one position goes round the ring
to check the driver token. The ids equal an uninterrupted run, the heal event says
``survivors_kept``, and the job receipt verifies with the neighbours' digests closed at the heal.
Real processes: tests/coordinator/test_heal_ring.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from swarm import receipts
from swarm.config import RingSpec, SpecConfig
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.jobs import write_job_receipt
from swarm.coordinator.ring import RingClient
from swarm.coordinator.drafters import NgramDrafter
from swarm.errors import ReceiptInvalid, collapse
from swarm.model.resolve import model_manifest_digest
from swarm.stage.session import SentLog
from swarm.transport import load_or_create_key, open_host
from tests.support.models import reference_greedy
from tests.support.ring import LOOPBACK, start_stages

pytestmark = pytest.mark.ring

RANGES = [(0, 1), (1, 3), (3, 4)]
PROMPT = [1, 5, 9, 3, 7, 2, 8, 4, 6, 11, 12, 13]
NEW = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.support.models import make_synthetic

    return make_synthetic("llama", tmp_path_factory.mktemp("llama-kept"))


def heal_inprocess(model_dir: Path, tmp_path: Path, victim: int, *, kill_at: int = 8, spec_config=None,
                   before_kill=None, sampling=None, block_dtype: str = "float64", quantize: str | None = None):
    """Generate on 3 stages + a spare for the victim's range (blocks in ``block_dtype``, held in ``quantize``),
    stop the victim after ``kill_at`` committed tokens (``before_kill(servers)`` first); return (ids, record,
    job receipt)."""

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                held = dict(block_dtype=block_dtype, quantize=quantize)
                ring = await start_stages(nursery, model_dir, RANGES, tmp_path, "s", **held)
                (spare,) = await start_stages(nursery, model_dir, [RANGES[victim]], tmp_path, "spare", **held)
                spec = RingSpec(model=str(model_dir), stages=tuple(s for s, _, _ in ring), spares=(spare[0],))
                servers = [srv for _, srv, _ in ring]
                fired = []

                def on_ids(out):
                    if len(out) >= kill_at and not fired:
                        if before_kill is not None:
                            before_kill(servers)
                        ring[victim][2].cancel()
                        fired.append(len(out))

                key = load_or_create_key(tmp_path / "c.key")
                async with open_host(key, [LOOPBACK]) as host, trio.open_nursery() as inner:
                    client = RingClient(host, spec, 30.0, 10.0, heartbeat_s=1.0)
                    digest = model_manifest_digest(model_dir)
                    await client.connect(4, digest, inner)
                    job = {"id": "kept-job", "nonce": receipts.new_nonce()}
                    options = DecodeOptions(NEW, spec=spec_config, drafter=NgramDrafter() if spec_config else None,
                                            sampling=sampling, job=job)
                    decoded = await decode(client, PROMPT, options, on_ids=on_ids)
                    out, rec = decoded.output_ids, decoded.as_record()
                    res = write_job_receipt(tmp_path / "receipts", key, job, rec.pop("receipt_parts"),
                                            model=model_dir.name, model_digest=digest, num_layers=4,
                                            prompt_ids=PROMPT, output_ids=out,
                                            ring=[i.entry() for i in client.infos], record=rec)
                    inner.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        assert fired, "the victim was never stopped"
        return out, rec, json.loads(open(res["path"]).read())

    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


@pytest.fixture(scope="module")
def reference(model):
    return reference_greedy(model, PROMPT, NEW, "float64")


@pytest.mark.parametrize("victim", [1, 0, 2], ids=["middle", "head", "tail"])
def test_kept_heal_is_token_identical_and_recomputes_one_position_at_survivors(model, tmp_path, reference, victim):
    out, rec, job = heal_inprocess(model, tmp_path, victim)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["stage"] == victim and event["replay"] == "survivors_kept", event
    committed = len(PROMPT) + event["replay_tokens"] - len(PROMPT)
    assert event["survivor_tokens"] == 1 and event["refill_tokens"] == event["replay_tokens"] - 1 >= len(PROMPT)
    assert committed >= len(PROMPT) + 7
    summary = receipts.verify_job(job)
    assert summary.healed == 1
    assert job["stage_receipts"][victim]["peer_id"] == event["spare"]
    # the neighbours' digests were closed at the heal, naming the lost stage
    lost = event["replaced"][0]
    if victim > 0:
        assert [s["side"] for s in job["stage_receipts"][victim - 1]["segments"]] == ["output"]
        assert job["stage_receipts"][victim - 1]["segments"][0]["peer"] == lost
    else:
        assert [s["side"] for s in job["coordinator_segments"]] == ["sent"]
    if victim < 2:
        assert [s["side"] for s in job["stage_receipts"][victim + 1]["segments"]] == ["input"]
    else:
        assert [s["side"] for s in job["coordinator_segments"]] == ["received"]


def test_kept_heal_with_speculation_depth(model, tmp_path, reference):
    out, rec, job = heal_inprocess(model, tmp_path, 1, spec_config=SpecConfig(draft="ngram", k=4, depth=3))
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "survivors_kept"
    receipts.verify_job(job)


def test_a_predecessor_without_its_sent_states_falls_back_to_full_replay(model, tmp_path, reference):
    def drop_log(servers):
        for sess in servers[0].sessions.values():
            sess.heal.sent_log._break("dropped by the test")

    out, rec, job = heal_inprocess(model, tmp_path, 1, before_kill=drop_log)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "full" and "dropped by the test" in event["fallback"], event
    assert event["survivor_tokens"] == event["replay_tokens"] and event["refill_tokens"] == 0
    receipts.verify_job(job)
    assert "coordinator_segments" not in job and not any("segments" in r for r in job["stage_receipts"])


def _kept_job(model, tmp_path):
    return heal_inprocess(model, tmp_path, 1)[2]


def test_receipt_segments_must_match_the_heal(model, tmp_path):
    from swarm.transport.identity import sign

    job = _kept_job(model, tmp_path)
    key = load_or_create_key(tmp_path / "c.key")

    def resign(doc):
        return receipts.sign_receipt(doc, lambda data: sign(key, data))

    receipts.verify_job(job)
    # the heal event is relabelled full: the closed digests are unexplained
    doc = json.loads(json.dumps(job))
    doc["heal_events"][0]["replay"] = "full"
    with pytest.raises(ReceiptInvalid, match="no heal that kept the survivors replaced"):
        receipts.verify_job(resign(doc))
    # the heal names another replaced stage
    doc = json.loads(json.dumps(job))
    doc["heal_events"][0]["replaced"] = [doc["ring"][0]["peer_id"]]
    with pytest.raises(ReceiptInvalid, match="no heal that kept the survivors replaced"):
        receipts.verify_job(resign(doc))
    # a kept heal without the neighbours' closed digests (a stage's receipt edited: its signature breaks)
    doc = json.loads(json.dumps(job))
    doc["stage_receipts"][0].pop("segments")
    with pytest.raises(ReceiptInvalid, match="signature"):
        receipts.verify_job(resign(doc))


def test_sent_log_keeps_the_last_frames_bytes_and_trims_on_rollback():
    import torch

    from swarm import wire

    log = SentLog(hidden_size=4, max_len=16)
    a = torch.arange(5 * 4, dtype=torch.float32).reshape(1, 5, 4)
    b = -torch.arange(3 * 4, dtype=torch.float32).reshape(1, 3, 4)
    log.record(0, wire.encode_tensor(a))
    assert log.length == 5
    log.record(3, wire.encode_tensor(b))  # a rollback to 3: rows 3.. replaced, the log ends at 6
    assert log.length == 6
    rows = torch.cat([wire.decode_tensor(m) for _, m in log.frames(6, 4)], dim=1)
    assert [p for p, _ in log.frames(6, 4)] == [0, 4]
    assert torch.equal(rows, torch.cat([a[:, :3], b], dim=1))
    log.record(7, wire.encode_tensor(b))  # a gap: the log cannot be trusted any more
    assert log.length == 0 and "do not continue" in log.broken
    fp8 = SentLog(hidden_size=4, max_len=16)
    fp8.record(0, wire.encode_tensor(a, dtype=torch.float8_e4m3fn))
    (_, m), = fp8.frames(5, 8)
    assert m == wire.encode_tensor(a, dtype=torch.float8_e4m3fn)


def test_repair_is_refused_without_the_state_it_needs(model, tmp_path):
    """A stage answers a repair it cannot serve with a reason and keeps the session as it was:
    an unknown session (no_session), a peer that did not open it (forbidden), a resend of more than
    it kept (no_state), and, with --heal-log-mb 0, any resend. The log is reserved with the KV."""
    from swarm import wire
    from swarm.wire import PROTOCOL_ID
    from tests.support.ring import start_ring

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model, [(0, 2), (2, 4)], tmp_path)
                spec0, (capped,) = await start_ring(nursery, model, [(0, 2)], tmp_path / "capped", heal_log_mb=0)
                block = servers[0].block
                async with open_host(load_or_create_key(tmp_path / "c.key"), [LOOPBACK]) as host, \
                        open_host(load_or_create_key(tmp_path / "other.key"), [LOOPBACK]) as other:
                    tail = spec.stages[1].addr
                    t = await host.open_stream(tail, PROTOCOL_ID, timeout_s=10)
                    heads = ((spec.stages[0].addr, servers[0]), (spec0.stages[0].addr, capped))
                    for k, (_, srv) in enumerate(heads):  # the tail answers the results on t
                        await t.send(wire.open_frame(host.key_pair, f"a{k}", None, 32, prev=srv.host.peer_id))
                        assert (await t.recv(timeout_s=10))["type"] == "open_ok"
                    for k, (addr, srv) in enumerate(heads):
                        sid = f"a{k}"
                        s = await host.open_stream(addr, PROTOCOL_ID, timeout_s=10)
                        await s.send(wire.open_frame(host.key_pair, sid, tail, 32))
                        assert (await s.recv(timeout_s=10))["type"] == "open_ok"
                        await s.send(wire.frame("forward", session=sid, epoch=0, pos=0, chunk=0, tokens=[1, 5, 9, 3]))
                        while srv.sessions[sid].cache.kv_len < 4:
                            await trio.sleep(0.01)
                        kv = 32 * block.kv_bytes_per_position()
                        log_rows = 0 if srv is capped else 32
                        assert srv.sessions[sid].reserved == kv + log_rows * block.hidden_size * 8
                        await s.send(wire.repair_frame(host.key_pair, "nope", 1))
                        assert (await s.recv(timeout_s=10))["code"] == "no_session"
                        o = await other.open_stream(addr, PROTOCOL_ID, timeout_s=10)
                        await o.send(wire.repair_frame(other.key_pair, sid, 1))
                        assert (await o.recv(timeout_s=10))["code"] == "forbidden"
                        await s.send(wire.repair_frame(host.key_pair, sid, 1, next_addr=tail, resend=5, until=2))
                        err = await s.recv(timeout_s=10)
                        assert err["code"] == "no_state", err
                        assert ("keeps none" in err["reason"]) == (srv is capped), err["reason"]
                        assert srv.sessions[sid].epoch == 0 and srv.sessions[sid].next_addr == tail
                        if srv is not capped:  # what it holds, it resends
                            await s.send(wire.repair_frame(host.key_pair, sid, 1, next_addr=tail, resend=4, until=2))
                            ok = await s.recv(timeout_s=10)
                            assert ok["type"] == "repair_ok" and ok["kv_len"] == 4 and ok["resent"] == 4, ok
                            assert srv.sessions[sid].epoch == 1
                nursery.cancel_scope.cancel()

    trio.run(main)

"""Receipts: digests, signatures, a real ring's job receipt, and one tamper test per field.

The ring is in-process (real StageServers on libp2p loopback) over a seeded synthetic Llama, with
speculation at depth 2 so that stale chunks are dropped mid-ring (the chain must still close).
Tampers that keep a valid signature are re-signed with the key of the party that would lie (the
stage's own key, or the coordinator's), so each test reaches the check it targets.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import msgpack
import nacl.signing
import pytest
import torch
import trio

from swarm import receipts, wire
from swarm.frames import Forward
from swarm.config import SpecConfig
from swarm.coordinator.jobs import write_job_receipt
from swarm.coordinator.drafters import NgramDrafter
from swarm.errors import ReceiptInvalid, collapse
from swarm.model.block import block_tensor_names
from swarm.model.resolve import model_manifest_digest, weights_digest
from swarm.ranges import LayerRange
from swarm.transport import load_or_create_key
from swarm.transport.framing import decode_body, encode_frame
from swarm.transport.identity import peer_id_of, public_key_of_peer, sign
from tests.support.models import make_synthetic, reference_greedy
from tests.support.ring import ring_generate, start_ring

PROMPT = [1, 5, 9, 3, 7, 2, 8, 11, 4, 5, 9, 3]
RANGES = [(0, 1), (1, 3), (3, 4)]
NEW = 20

# ---- pure pieces --------------------------------------------------------------------------------


def test_forward_item_is_identical_on_both_ends_of_a_hop():
    t = torch.randn(1, 3, 8, dtype=torch.float32)
    for dtype in (None, torch.bfloat16, torch.float8_e4m3fn):
        sent = Forward(session="s", epoch=2, pos=5, chunk=7, hidden=wire.encode_tensor(t, dtype))
        got = wire.validate(decode_body(encode_frame(sent)[4:]))
        a, b = receipts.RollingDigest(), receipts.RollingDigest()
        a.add(receipts.forward_item(sent))
        b.add(receipts.forward_item(got))
        assert a.hexdigest() == b.hexdigest() and a.frames == b.frames == 1
    tok = Forward(session="s", epoch=0, pos=0, chunk=0, tokens=[1, 2, 3])
    assert receipts.forward_item(wire.validate(decode_body(encode_frame(tok)[4:]))) == receipts.forward_item(tok)


def test_rolling_digest_depends_on_every_byte_and_the_order():
    items = [["forward", 0, 0, 0, "tokens", [1, 2]], ["forward", 0, 2, 1, "tokens", [3]]]
    d = {}
    for name, seq in {"ab": items, "ba": items[::-1], "a": items[:1],
                      "ab'": [items[0], ["forward", 0, 2, 1, "tokens", [4]]]}.items():
        r = receipts.RollingDigest()
        for it in seq:
            r.add(it)
        d[name] = r.hexdigest()
    assert len(set(d.values())) == 4


def test_signature_verifies_with_pynacl_from_the_peer_id_alone(tmp_path):
    key = load_or_create_key(tmp_path / "k.key")
    pid = peer_id_of(key)
    doc = receipts.sign_receipt({"schema": "x", "n": 1, "s": "é"}, lambda b: sign(key, b))
    # plain PyNaCl, no swarm code on the verifying side: the key is inlined in the PeerId
    nacl.signing.VerifyKey(public_key_of_peer(pid)).verify(receipts.canonical(doc), bytes.fromhex(doc["sig"]))
    assert receipts.signature_ok(doc, pid)
    other = peer_id_of(load_or_create_key(tmp_path / "other.key"))
    assert not receipts.signature_ok(doc, other)
    assert not receipts.signature_ok({**doc, "n": 2}, pid)
    assert not receipts.signature_ok({**doc, "sig": "zz"}, pid)
    assert not receipts.signature_ok({**doc, "sig": doc["sig"][:-2]}, pid)


@pytest.mark.process
def test_receipts_module_does_not_load_torch():
    code = "import sys, swarm.receipts, swarm.cli.watch; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("job,expect", [
    ("x", "must be a map"), ({"id": "j"}, "nonce must be"), ({"id": "", "nonce": "n"}, "id must be"),
    ({"id": "j", "nonce": "n" * 200}, "nonce must be"), ({"id": 3, "nonce": "n"}, "id must be"),
])
def test_open_frame_with_a_bad_job_is_refused(job, expect):
    with pytest.raises(Exception, match=expect):
        wire.validate(wire.frame("open", session="s", next=None, max_len=8, sig="00", job=job))


# ---- a real ring ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic("llama", tmp_path_factory.mktemp("receipt-model"), "float64")


@pytest.fixture(scope="module")
def jobs(model_dir, tmp_path_factory):
    """Two jobs on one in-process ring (ngram speculation, K=4, depth 2): (docs, outputs, key dir)."""
    key_dir = tmp_path_factory.mktemp("receipt-keys")
    out_dir = tmp_path_factory.mktemp("receipts")
    docs, outs = [], []

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model_dir, RANGES, key_dir)
                for n in range(2):
                    job = {"id": f"job-{n}", "nonce": receipts.new_nonce()}
                    info: dict = {}
                    out = await ring_generate(spec, model_dir, 4, PROMPT, NEW, key_dir, info=info, job=job,
                                              spec_config=SpecConfig(draft="ngram", k=4, depth=2),
                                              drafter=NgramDrafter())
                    res = write_job_receipt(out_dir, load_or_create_key(key_dir / "coord.key"), job,
                                            info.pop("receipt_parts"), model="synthetic",
                                            model_digest=model_manifest_digest(model_dir), num_layers=4,
                                            prompt_ids=PROMPT, output_ids=out, ring=info["ring"], record=info)
                    docs.append(json.loads(open(res["path"]).read()))
                    outs.append(out)
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    return docs, outs, key_dir


@pytest.mark.ring
def test_real_ring_receipt_verifies(jobs, model_dir):
    (doc, _), (out, _), _ = jobs
    assert out == reference_greedy(model_dir, PROMPT, NEW, "float64")  # receipts change nothing
    v = receipts.verify_job(doc)
    assert v.stages == 3 and v.new_tokens == NEW
    r = doc["stage_receipts"]
    assert [x["layers"] for x in r] == [list(a) for a in RANGES]
    assert [x["peer_id"] for x in r] == [s["peer_id"] for s in doc["ring"]]
    # speculation dropped stale chunks mid-ring, and the chain still closes
    assert r[0]["input"]["frames"] == doc["coordinator_sent"]["frames"] > 0
    assert r[2]["output"]["frames"] == doc["coordinator_received"]["frames"]
    assert all(x["positions"] >= len(PROMPT) + NEW - 1 for x in r)
    assert doc["output_digest"] == receipts.ids_digest(out)
    assert doc["prompt_digest"] == receipts.ids_digest(PROMPT)
    assert doc["spec"]["k"] == 4 and doc["tokens_per_s"] > 0
    assert r[0]["wire_dtype"] == "float64" and r[2]["wire_dtype"] == "token_ids"
    # openable: each receipt names its reproducibility class and commits to its windows of rows
    for x in r:
        assert x["repro"]["facts"]["weights"] == x["range_digest"] and x["repro"]["id"].startswith("rc1-")
        w = x["windows"]
        assert w["size"] == 64 and w["positions"] >= len(PROMPT) + NEW - 1 and w["leaves"] == 1
        assert len(w["root"]) == 64


@pytest.mark.ring
def test_receipts_from_before_openable_receipts_still_verify(jobs):
    """Stage receipts without ``repro`` and ``windows`` (signed by a stage that predates them) pass."""
    (doc, _), _, key_dir = jobs
    doc = copy.deepcopy(doc)
    for i, r in enumerate(doc["stage_receipts"]):
        del r["repro"], r["windows"]
        _resign_stage(doc, i, key_dir)
    _resign_job(doc, key_dir)
    assert receipts.verify_job(doc).stages == 3


@pytest.mark.ring
def test_the_tails_signed_answers_are_the_output_ids(jobs):
    """Output id k is the tail's answer after position prompt - 1 + k; positions it did not answer in the
    session that finished the job (a heal replayed them as input) are skipped."""
    (doc, _), (out, _), key_dir = jobs
    a = doc["stage_receipts"][2]["answers"]
    assert a["from"] == len(PROMPT) - 1 and a["ids"][:NEW] == out
    doc = copy.deepcopy(doc)
    doc["stage_receipts"][2]["answers"]["ids"][:3] = [None] * 3
    _resign_stage(doc, 2, key_dir)
    _resign_job(doc, key_dir)
    assert receipts.verify_job(doc).new_tokens == NEW


@pytest.mark.ring
def test_weight_digests_match_a_local_copy_and_not_another_model(jobs, model_dir, tmp_path):
    (doc, _), _, _ = jobs
    local = {tuple(a): weights_digest(model_dir, block_tensor_names(model_dir, LayerRange(*a))) for a in RANGES}
    receipts.verify_job(doc, expect_model_digest=model_manifest_digest(model_dir), expect_range_digests=local)
    other = make_synthetic("llama", tmp_path / "other", "float64", seed=1)  # same layout, other weights
    theirs = {tuple(a): weights_digest(other, block_tensor_names(other, LayerRange(*a))) for a in RANGES}
    assert model_manifest_digest(other) == doc["model_digest"]  # the manifest sees only the layout
    with pytest.raises(ReceiptInvalid, match="range digest: stage 0"):
        receipts.verify_job(doc, expect_range_digests=theirs)


def _resign_stage(doc, i, key_dir):
    a, b = RANGES[i]
    key = load_or_create_key(key_dir / f"s{a}-{b}.key")
    doc["stage_receipts"][i] = receipts.sign_receipt(doc["stage_receipts"][i], lambda d: sign(key, d))


def _resign_job(doc, key_dir):
    key = load_or_create_key(key_dir / "coord.key")
    doc.update(receipts.sign_receipt(doc, lambda d: sign(key, d)))


def _flip(hex_sig: str) -> str:
    return ("1" if hex_sig[0] != "1" else "2") + hex_sig[1:]


def t_stage_sig(doc, old, kd):
    doc["stage_receipts"][1]["sig"] = _flip(doc["stage_receipts"][1]["sig"])


def t_job_sig(doc, old, kd):
    doc["sig"] = _flip(doc["sig"])


def t_edit_without_resign(doc, old, kd):
    doc["stage_receipts"][1]["positions"] += 1


def t_stage_range(doc, old, kd):  # a stage claims layers it was not assigned
    doc["stage_receipts"][1]["layers"] = [1, 2]
    _resign_stage(doc, 1, kd)
    _resign_job(doc, kd)


def t_ring_range(doc, old, kd):  # the coordinator's ring no longer tiles [0, L)
    doc["ring"][1]["layers"] = [1, 2]
    _resign_job(doc, kd)


def t_stage_digest(doc, old, kd):  # stage 1 claims other output bytes than stage 2 received
    doc["stage_receipts"][1]["output"]["digest"] = "ab" * 32
    _resign_stage(doc, 1, kd)
    _resign_job(doc, kd)


def t_coordinator_digest(doc, old, kd):
    doc["coordinator_received"]["frames"] += 1
    _resign_job(doc, kd)


def t_reordered(doc, old, kd):
    r = doc["stage_receipts"]
    r[0], r[1] = r[1], r[0]
    _resign_job(doc, kd)


def t_swapped_peer(doc, old, kd):
    doc["ring"][1]["peer_id"] = doc["ring"][2]["peer_id"]
    _resign_job(doc, kd)


def t_missing_stage(doc, old, kd):
    doc["stage_receipts"].pop()
    _resign_job(doc, kd)


def t_missing_middle(doc, old, kd):
    doc["stage_receipts"][1] = None
    _resign_job(doc, kd)


def t_replayed_nonce(doc, old, kd):  # stage 1's honest receipt from an earlier job
    doc["stage_receipts"][1] = copy.deepcopy(old["stage_receipts"][1])
    _resign_job(doc, kd)


def t_output_id(doc, old, kd):
    doc["output_ids"][3] += 1
    _resign_job(doc, kd)


def t_output_id_rewritten(doc, old, kd):  # a coordinator that lies about the output, digest and all
    doc["output_ids"][3] += 1
    doc["output_digest"] = receipts.ids_digest(doc["output_ids"])
    _resign_job(doc, kd)


def t_answers_malformed(doc, old, kd):
    doc["stage_receipts"][2]["answers"]["from"] = -1
    _resign_stage(doc, 2, kd)
    _resign_job(doc, kd)


def t_last_answer_missing(doc, old, kd):  # the tail never sent the last output id
    a = doc["stage_receipts"][2]["answers"]
    a["ids"][len(doc["output_ids"]) - 1] = None
    _resign_stage(doc, 2, kd)
    _resign_job(doc, kd)


def t_output_id_unsigned(doc, old, kd):
    doc["output_ids"][3] += 1


def t_job_id(doc, old, kd):
    doc["stage_receipts"][2]["job_id"] = "another-job"
    _resign_stage(doc, 2, kd)
    _resign_job(doc, kd)


def t_model_digest(doc, old, kd):
    doc["stage_receipts"][0]["model_digest"] = "00" * 32
    _resign_stage(doc, 0, kd)
    _resign_job(doc, kd)


def t_heal_spare(doc, old, kd):
    doc["heal_events"] = [{"stage": 1, "layers": [1, 3], "spare": doc["ring"][0]["peer_id"], "reason": "x"}]
    _resign_job(doc, kd)


def t_coordinator_swapped(doc, old, kd):  # another key claims to be the coordinator
    doc["coordinator"] = doc["ring"][0]["peer_id"]


def t_claimed_by_another_coordinator(doc, old, kd):  # someone re-signs another's job as theirs
    key = load_or_create_key(kd / "mallory.key")
    doc["coordinator"] = peer_id_of(key)
    doc.update(receipts.sign_receipt(doc, lambda d: sign(key, d)))


def t_drop_middle(doc, old, kd):
    doc["stage_receipts"].pop(1)
    _resign_job(doc, kd)


def t_output_id_not_int(doc, old, kd):
    doc["output_ids"][0] = "abc"
    _resign_job(doc, kd)


def t_output_id_huge(doc, old, kd):
    doc["output_ids"][0] = 10**30
    _resign_job(doc, kd)


def t_float_layers(doc, old, kd):
    doc["ring"][0]["layers"] = [0.0, 1.0]
    _resign_job(doc, kd)


def t_repro_forged_id(doc, old, kd):
    doc["stage_receipts"][1]["repro"]["facts"]["torch"] = "0.0.1"  # the id no longer digests the facts
    _resign_stage(doc, 1, kd)
    _resign_job(doc, kd)


def t_repro_other_weights(doc, old, kd):
    from swarm import repro

    facts = {**doc["stage_receipts"][1]["repro"]["facts"], "weights": "00" * 32}
    doc["stage_receipts"][1]["repro"] = repro.make(facts).as_dict()  # a valid class, for other weights
    _resign_stage(doc, 1, kd)
    _resign_job(doc, kd)


def t_windows_leaf_count(doc, old, kd):
    doc["stage_receipts"][2]["windows"]["leaves"] += 1
    _resign_stage(doc, 2, kd)
    _resign_job(doc, kd)


def t_windows_root(doc, old, kd):
    doc["stage_receipts"][0]["windows"]["root"] = "zz"
    _resign_stage(doc, 0, kd)
    _resign_job(doc, kd)


@pytest.mark.ring
@pytest.mark.parametrize("tamper,check,stage", [
    (t_repro_forged_id, "repro", 1),
    (t_repro_other_weights, "repro", 1),
    (t_windows_leaf_count, "windows", 2),
    (t_windows_root, "windows", 0),
    (t_stage_sig, "signature", 1),
    (t_job_sig, "job signature", None),
    (t_edit_without_resign, "signature", 1),
    (t_stage_range, "layer range", 1),
    (t_ring_range, "ranges", None),
    (t_stage_digest, "chain", 2),
    (t_coordinator_digest, "chain", 2),
    (t_reordered, "peer id", 0),
    (t_swapped_peer, "peer id", 1),
    (t_missing_stage, "missing stage", 2),
    (t_missing_middle, "missing stage", 1),
    (t_replayed_nonce, "nonce", 1),
    (t_output_id, "output digest", None),
    (t_output_id_unsigned, "job signature", None),
    (t_output_id_rewritten, "answers", 2),
    (t_answers_malformed, "answers", 2),
    (t_last_answer_missing, "answers", 2),
    (t_job_id, "job id", 2),
    (t_model_digest, "model digest", 0),
    (t_heal_spare, "heal", None),
    (t_coordinator_swapped, "job signature", None),
    (t_claimed_by_another_coordinator, "coordinator", 0),
    (t_drop_middle, "missing stage", 1),
    (t_output_id_not_int, "schema", None),
    (t_output_id_huge, "schema", None),
    (t_float_layers, "ranges", None),
], ids=lambda x: x.__name__[2:] if callable(x) else None)
def test_tampering_fails_with_the_right_reason(jobs, tamper, check, stage):
    (doc, old), _, key_dir = jobs
    doc = copy.deepcopy(doc)
    receipts.verify_job(doc)  # intact
    tamper(doc, old, key_dir)
    with pytest.raises(ReceiptInvalid) as err:
        receipts.verify_job(doc)
    assert (err.value.check, err.value.stage) == (check, stage), str(err.value)


@pytest.mark.ring
@pytest.mark.parametrize("events, ok", [
    ([{"stage": 1, "spares": [1, 2]}], True),  # a chain of two stages took position 1
    ([{"stage": 0, "spares": [0, 1]}, {"stage": 2, "spare": 2}], True),
    ([{"stage": 0, "spares": ["x", 1]}, {"stage": 0, "spare": 0}], True),  # x was replaced again later
    ([{"stage": 1, "spares": [2, 1]}], False),  # the chain in the wrong order
    ([{"stage": 0, "spares": ["x", "y"]}, {"stage": 0, "spare": 0}], False),  # y is not in the final ring
    ([{"stage": 2, "spares": [2, 0]}], False),  # runs past the end of the ring
    ([{"stage": True, "spare": 1}], False),
    # a re-routed window: stage 0 took over positions 0 and 1 of a 4-stage ring, whose last position an
    # earlier heal had filled (without ``positions`` it would sit past the end of the ring)
    ([{"stage": 3, "spare": 2}, {"stage": 0, "spare": 0, "positions": 2}], True),
    ([{"stage": 3, "spare": 2}, {"stage": 0, "spare": 0}], False),
    ([{"stage": 0, "spare": 0, "positions": 0}], False),
], ids=["chain", "chain-then-single", "chain-replaced-later", "wrong-order", "lost-member", "past-end", "bool",
        "window", "window-uncounted", "positions-0"])
def test_heal_events_with_chains_match_the_final_ring(jobs, events, ok):
    """A heal event's replacement (one spare or a chain) must sit where the heal put it, walking back
    from the final ring; a number below stands for the PeerId at that position of the ring."""
    (doc, _), _, key_dir = jobs
    doc = copy.deepcopy(doc)
    peer = [s["peer_id"] for s in doc["ring"]]

    def named(x):
        return peer[x] if isinstance(x, int) and not isinstance(x, bool) else x

    doc["heal_events"] = [{**e, **({"spares": [named(x) for x in e["spares"]]} if "spares" in e else {}),
                           **({"spare": named(e["spare"])} if "spare" in e else {})} for e in events]
    _resign_job(doc, key_dir)
    if ok:
        assert receipts.verify_job(doc).healed == len(events)
    else:
        with pytest.raises(ReceiptInvalid) as err:
            receipts.verify_job(doc)
        assert err.value.check == "heal"


@pytest.mark.ring
def test_a_replayed_job_fails_in_a_batch(jobs, tmp_path):
    (doc, old), _, _ = jobs
    for name, d in (("a", doc), ("b", old), ("c", doc)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    res = receipts.verify_files([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"])
    assert isinstance(res[0][1], receipts.Verified) and isinstance(res[1][1], receipts.Verified)
    assert isinstance(res[2][1], ReceiptInvalid) and res[2][1].check == "nonce"


@pytest.mark.ring
def test_the_same_file_twice_is_not_a_replay(jobs, tmp_path):
    (doc, _), _, _ = jobs
    (tmp_path / "a.json").write_text(json.dumps(doc))
    res = receipts.verify_files([tmp_path / "a.json", tmp_path / "." / "a.json"])
    assert len(res) == 1 and isinstance(res[0][1], receipts.Verified)


def test_garbage_is_refused_not_crashed_on(tmp_path):
    for bad in (b"", b"  \n", b"[1, 2]", b'{"schema": "swarm/job-receipt/1"}', b"\xff\xfe",
                msgpack.packb({"a": 1}), b"[" * 100_000 + b"]" * 100_000):
        p = tmp_path / "x.json"
        p.write_bytes(bad)
        ((_, res),) = receipts.verify_files([p])
        assert isinstance(res, ReceiptInvalid) and res.check == "schema"


@pytest.mark.ring
def test_stage_refuses_a_receipt_for_a_session_without_a_job(model_dir, tmp_path):
    from swarm.transport import open_host
    from swarm.wire import PROTOCOL_ID

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, _ = await start_ring(nursery, model_dir, [(0, 4)], tmp_path)
                async with open_host(load_or_create_key(tmp_path / "c.key"), ["/ip4/127.0.0.1/tcp/0"]) as host:
                    s = await host.open_stream(spec.stages[0].addr, PROTOCOL_ID, timeout_s=10)
                    await s.send(wire.open_frame(host.key_pair, "s1", None, 16))
                    assert (await s.recv(timeout_s=10))["type"] == "open_ok"
                    await s.send(wire.frame("receipt", session="s1"))
                    err = await s.recv(timeout_s=10)
                    await s.send(wire.frame("receipt", session="nope"))
                    err2 = await s.recv(timeout_s=10)
                    await s.send(wire.frame("info"))  # the stream and the stage are still fine
                    ok = await s.recv(timeout_s=10)
                nursery.cancel_scope.cancel()
        return err, err2, ok

    err, err2, ok = trio.run(main)
    assert err["type"] == "error" and "without a job" in err["reason"]
    assert err2["type"] == "error" and err2["code"] == "no_session"
    assert ok["type"] == "info_ok"


# ---- the CLI (in-process main(); the subprocess paths are in test_cli.py) -------------------------


def test_keygen_id_prove_verify(tmp_path, capsys):
    from swarm.cli.main import main

    key = tmp_path / "keys" / "node.key"
    assert main(["keygen", "--out", str(key)]) == 0
    pid = capsys.readouterr().out.strip()
    assert pid.startswith("12D3KooW") and (key.stat().st_mode & 0o777) == 0o600
    assert main(["keygen", "--out", str(key)]) == 1  # never clobbers a key
    assert f"already exists (PeerId {pid})" in capsys.readouterr().err
    assert main(["id", "prove", "--key", str(key), "--nonce", "challenge-42"]) == 0
    sig = capsys.readouterr().out.strip()
    # the proof is a plain ed25519 signature under the key inlined in the PeerId
    nacl.signing.VerifyKey(public_key_of_peer(pid)).verify(receipts.id_proof_message("challenge-42"), bytes.fromhex(sig))
    assert main(["id", "verify", pid, "challenge-42", sig]) == 0
    assert main(["id", "verify", pid, "challenge-43", sig]) == 1
    flipped = sig[:-2] + ("01" if sig.endswith("00") else "00")  # always a different last byte
    assert main(["id", "verify", pid, "challenge-42", flipped]) == 1
    assert main(["id", "verify", "not-a-peer-id", "challenge-42", sig]) == 1
    assert main(["id", "verify", pid, "challenge-42", "xyz"]) == 1
    other = tmp_path / "other.key"
    assert main(["keygen", "--out", str(other)]) == 0
    assert main(["id", "verify", capsys.readouterr().out.strip(), "challenge-42", sig]) == 1
    assert main(["keygen", "--out", str(key), "--force"]) == 0  # replaced: a new PeerId
    assert capsys.readouterr().out.strip() != pid


def test_id_prove_refuses_a_readable_or_missing_key(tmp_path, capsys):
    from swarm.cli.main import main

    key = tmp_path / "k.key"
    assert main(["id", "prove", "--key", str(key), "--nonce", "n"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["keygen", "--out", str(key)]) == 0
    key.chmod(0o640)
    assert main(["id", "prove", "--key", str(key), "--nonce", "n"]) == 1
    assert "unsafe mode 0640" in capsys.readouterr().err


@pytest.mark.ring
def test_receipts_verify_and_watch_cli(jobs, tmp_path, capsys):
    from swarm.cli.main import main

    (doc, old), _, key_dir = jobs
    d = tmp_path / "r"
    d.mkdir()
    (d / "good.json").write_text(json.dumps(doc))
    assert main(["receipts", "verify", str(d / "good.json")]) == 0
    assert capsys.readouterr().out.startswith("OK job job-0")
    bad = copy.deepcopy(doc)
    t_stage_digest(bad, old, key_dir)
    (d / "bad.json").write_text(json.dumps(bad))
    assert main(["receipts", "verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "bad.json: chain: stage 2: stage 2 received" in out and "OK job" in out
    assert main(["receipts", "watch", str(d), "--once"]) == 1
    table = capsys.readouterr().out
    assert "2 jobs, 1 verified, 1 failed" in table and "synthetic" in table
    assert main(["receipts", "verify", str(tmp_path / "nothing.json")]) == 1
    assert main(["receipts", "watch", str(tmp_path / "nothing"), "--once"]) == 1
    assert "does not exist" in capsys.readouterr().err


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@pytest.mark.ring
def test_random_mutations_fail_closed(jobs):
    """Any value anywhere replaced by junk: always ReceiptInvalid, never a crash or a pass."""
    import random

    (doc, _), _, _ = jobs
    paths = [p for p in _paths(doc) if p]
    rng = random.Random(0)
    junk = [None, "x", -1, 0, [], {}, 1.5, True, "00" * 32, [0, 4], {"digest": "x", "frames": 1}]
    for _ in range(400):
        d = copy.deepcopy(doc)
        path = rng.choice(paths)
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        value = rng.choice(junk)
        if parent[path[-1]] == value:
            continue
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        with pytest.raises(ReceiptInvalid):
            receipts.verify_job(d)


@pytest.mark.ring
def test_watch_scanner_sees_new_changed_and_removed_receipts(jobs, tmp_path):
    from swarm.cli.watch import Scanner

    (doc, old), _, key_dir = jobs
    scanner = Scanner(tmp_path)
    assert scanner.rows() == []
    (tmp_path / "a.json").write_text(json.dumps(doc))
    (row,) = scanner.rows()
    assert row.verified and row.tokens == NEW and row.model == "synthetic" and "[1,3)" in row.stages
    bad = copy.deepcopy(doc)
    t_swapped_peer(bad, old, key_dir)
    (tmp_path / "a.json").write_text(json.dumps(bad, indent=2))  # rewritten in place: verified again
    (row,) = scanner.rows()
    assert not row.verified and row.reason.startswith("peer id: stage 1")
    (tmp_path / "b.json").write_text("{not json")
    rows = scanner.rows()
    assert len(rows) == 2 and any(r.reason.startswith("unreadable") for r in rows)
    (tmp_path / "a.json").unlink()
    assert [r.job_id for r in scanner.rows()] == ["b"]
    # a silly time does not crash the table (an unsigned edit: the row fails)
    (tmp_path / "silly.json").write_text(json.dumps({**doc, "created_ms": 10**20}))
    rows = {Path(r.path).name: r for r in Scanner(tmp_path).rows()}
    assert not rows["silly.json"].verified
    (tmp_path / "silly.json").unlink()
    # copies of one job under two names: one verifies, the other is a replay
    (tmp_path / "copy.json").write_text(json.dumps(doc))
    (tmp_path / "dup.json").write_text(json.dumps(doc, indent=3))
    rows = {Path(r.path).name: r for r in Scanner(tmp_path).rows()}
    replayed = [r for r in (rows["copy.json"], rows["dup.json"]) if not r.verified]
    assert len(replayed) == 1 and replayed[0].reason.startswith("nonce: already used by")

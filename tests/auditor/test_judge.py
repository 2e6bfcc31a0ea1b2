"""The auditor's judgement without a network: a proof whose signed rows do not decode (a stage that
signs junk to crash whoever re-checks a proof against it) is refused as malformed, and an auditor
judging such rows fails the stage without crashing."""

from __future__ import annotations

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm import openings, proofs, receipts
from swarm.auditor.judge import Blocks, judge, verify_proof
from swarm.errors import ProofRefused
from swarm.kernels.facts import stage_class
from swarm.ranges import LayerRange
from swarm.transport.identity import peer_id_of, sign
from tests.support.models import make_synthetic


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic("llama", tmp_path_factory.mktemp("judge-model"), "float64")


def _junk_head_job(model_dir):
    """A head's signed receipt and opening whose input rows are 3 bytes (token rows are 4)."""
    blocks = Blocks(model_dir)
    block = blocks.get([0, 1], "float64")
    key = create_new_key_pair()
    log = openings.WindowLog()
    log.record(0, "tokens", [b"\x01\x02\x03"] * 4, "float64", [b"\x00" * 8 * block.hidden_size] * 4)
    c = openings.Commitment(log.snapshot())
    body = receipts.StageLedger("job", "n" * 32).body(
        session="s", coordinator="c", peer_id=peer_id_of(key), model="m", model_digest="d",
        range_digest=block.digest_of(), layers=[0, 1], num_layers=4, dtype="float64", wire_dtype="float64",
        positions=len(log), repro=stage_class(block, LayerRange(0, 1)).as_dict(), windows=c.field())
    r = receipts.sign_receipt(body, lambda d: sign(key, d))
    raw = [openings.sign_opening(openings.opening_body(r, c, 0), lambda d: sign(key, d))]
    return blocks, block, r, raw


def test_a_proof_over_rows_that_do_not_decode_is_refused_not_a_crash(model_dir):
    blocks, block, r, raw = _junk_head_job(model_dir)
    auditor = create_new_key_pair()
    proof = proofs.build_proof(receipt=r, openings=raw, pred_receipt=None, pred_openings=None, position=2,
                              recomputed=b"\x01" * 8 * block.hidden_size, auditor_class=r["repro"],
                              auditor=peer_id_of(auditor), sign=lambda d: sign(auditor, d), created_ms=1)
    assert proofs.check_proof(proof).position == 2  # it checks without weights: DHT nodes would store it
    with pytest.raises(ProofRefused) as err:
        verify_proof(proof, blocks)
    assert err.value.reason == "malformed" and "cannot be re-run" in str(err.value)


def test_an_auditor_fails_a_stage_whose_signed_rows_do_not_decode(model_dir):
    _, block, r, raw = _junk_head_job(model_dir)
    opened = [openings.check_opening(r, o, k) for k, o in enumerate(raw)]
    auditor = create_new_key_pair()
    v = judge(block, r, opened, raw, None, sampled=False, auditor=peer_id_of(auditor),
              sign=lambda d: sign(auditor, d), now_ms=1)
    assert v.outcome == "failed" and v.proof is None and "do not decode" in v.reason


def test_an_auditor_on_other_threads_re_runs_a_rows_stage_at_its_thread_count(model_dir):
    """In the rows mode torch's thread count is a fact of the class (the BLAS's bits follow it). Before:
    an auditor on 2 threads said "not comparable: kernel.threads 1 vs 2" about every 1-thread stage."""
    import torch

    from swarm.auditor.judge import class_for

    block = Blocks(model_dir).get([0, 1], "float64")
    block.set_kernel_mode("rows")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        stage = {"repro": stage_class(block, LayerRange(0, 1)).as_dict(), "layers": [0, 1]}
        assert stage["repro"]["facts"]["kernel"]["threads"] == 1
        torch.set_num_threads(2)
        mine, _, why = class_for(block, stage)
        assert why == "" and mine.id == stage["repro"]["id"] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

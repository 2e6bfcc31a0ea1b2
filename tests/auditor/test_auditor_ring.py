"""Auditors on a real ring (in-process stages, libp2p loopback): every cheat of tests/support/cheats.py is
caught by auditing its session, the fraud proof re-checks with the weights, forged proofs are refused with
the reason, honest stages pass, and a class the auditor cannot run is "not comparable", never "cheated"."""

from __future__ import annotations

import pytest
import trio

from swarm import proofs
from swarm.auditor.judge import Blocks, verify_proof
from swarm.auditor.run import Auditor
from swarm.errors import ProofRefused, collapse
from swarm.transport import load_or_create_key, open_host
from tests.support.cheats import cheat
from tests.support.models import make_synthetic
from tests.support.ring import LOOPBACK, signed_job, start_ring

pytestmark = pytest.mark.ring

RANGES = [(0, 1), (1, 3), (3, 4)]
PROMPTS = [[1 + (i * 7 + s) % 50 for i in range(70)] for s in range(3)]  # 70 positions: windows 0 and 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic("llama", tmp_path_factory.mktemp("auditor-model"), "float64")


def _run(main):
    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def _audit(model_dir, tmp_path, kind: str | None, jobs: int = 1, stage: int = 1, auditor_dtype=None, limit=None,
           decode_kw=None, **cheat_kw):
    """Run ``jobs`` jobs on a ring whose stage ``stage`` cheats (``kind``; None: honest), audit every stage
    of every job at rate 1 over all windows; returns {verdicts: [[Verdict per stage] per job], outputs}."""
    got: dict = {"verdicts": [], "outputs": []}

    async def main():
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, RANGES, tmp_path)
                if kind is not None:
                    got["double"] = cheat(servers[stage].block, kind, **cheat_kw)
                for s in servers if limit is not None else ():
                    s.audits.limit = limit
                blocks = _Blocks(model_dir, auditor_dtype)
                key = load_or_create_key(tmp_path / "auditor.key")
                async with open_host(key, [LOOPBACK]) as host:
                    auditor = Auditor(host, key, blocks, rate=1.0, all_windows=True, timeout_s=20)
                    for j in range(jobs):
                        res = await signed_job(spec, model_dir, tmp_path, PROMPTS[j % len(PROMPTS)], tmp_path / "r", 8,
                                               **(decode_kw or {}))
                        assert res["verified"], res
                        got["outputs"].append(res["output_ids"])
                        got["verdicts"].append(await auditor.audit_job(res["doc"]))
                    got["tally"] = auditor.tally
                got["blocks"] = blocks
                nursery.cancel_scope.cancel()

    _run(main)
    return got


class _Blocks(Blocks):
    """The auditor's blocks, optionally in another dtype than the stages' (another class)."""

    def __init__(self, model_dir, dtype=None):
        super().__init__(model_dir)
        self.dtype = dtype

    def get(self, layers, dtype):
        return super().get(layers, self.dtype or dtype)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["garbage", "bf16", "skip", "ulp"])
def test_a_cheating_stage_is_caught_and_its_proof_rechecks(model_dir, tmp_path, kind):
    got = _audit(model_dir, tmp_path, kind, layer=1, position=66)
    (verdicts,) = got["verdicts"]
    assert [v.outcome for v in verdicts] == ["passed", "failed", "passed"], [v.line() for v in verdicts]
    bad = verdicts[1]
    assert bad.proof is not None and "output row is not what layers [1, 3) compute" in bad.reason
    if kind == "ulp":  # the one changed value, at the one position
        assert bad.proof["position"] == 66 and len(bad.proof["openings"]) == 2
    checked = verify_proof(proofs.decode(proofs.encode(bad.proof)), Blocks(model_dir))
    assert checked.accused == bad.peer_id and checked.layers == (1, 3) and checked.note == ""
    assert got["tally"][bad.peer_id] == {"audited": 1, "passed": 0, "failed": 1}
    assert all(got["tally"][v.peer_id] == {"audited": 1, "passed": 1, "failed": 0} for v in (verdicts[0], verdicts[2]))


@pytest.mark.slow
def test_replay_and_intermittent_cheats_are_caught_in_the_sessions_they_cheat(model_dir, tmp_path):
    got = _audit(model_dir, tmp_path, "replay", jobs=2)
    assert [v.outcome for v in got["verdicts"][0]] == ["passed"] * 3  # the first session is honest
    assert [v.outcome for v in got["verdicts"][1]] == ["passed", "failed", "passed"]
    got = _audit(model_dir, tmp_path, "intermittent", jobs=3, honest_first=1, one_in=1)
    assert [v[1].outcome for v in got["verdicts"]] == ["passed", "failed", "failed"]
    assert got["double"].cheated == {1, 2}


@pytest.mark.slow
def test_honest_ring_passes_and_forged_proofs_are_refused_with_the_reason(model_dir, tmp_path):
    from swarm.stage.openings import RateLimit

    from swarm.config import SpecConfig
    from swarm.coordinator.drafters import NgramDrafter

    # speculation rolls rows back mid-job; stages answer one audit request at a time (burst 1, 2/s): the
    # auditor waits, it never fails them
    got = _audit(model_dir, tmp_path, None, jobs=1, limit=RateLimit(rate_per_s=2.0, burst=1),
                 decode_kw={"spec": SpecConfig(draft="ngram", k=4, depth=2), "drafter": NgramDrafter()})
    assert [v.outcome for v in got["verdicts"][0]] == ["passed"] * 3
    # every position's row re-run; the tail answered only from the prompt's last row on (8 new tokens)
    # (speculation may leave rows of a last verify chunk past the output: those are re-run too)
    (a, b, tail) = got["verdicts"][0]
    assert a.positions >= 77 and b.positions >= 77 and tail.positions >= 8 and a.windows == b.windows == 2
    real = _audit(model_dir, tmp_path / "c", "ulp", position=66)["verdicts"][0][1].proof
    blocks = Blocks(model_dir)

    def refused(proof) -> ProofRefused:
        with pytest.raises(ProofRefused) as err:
            verify_proof(proof, blocks)
        return err.value

    key = load_or_create_key(tmp_path / "auditor.key")
    from swarm.transport.identity import peer_id_of, sign

    def resign(proof):  # a forger signs its own claim: the signature is fine, the claim is not
        return proofs.sign_claim({**proof, "auditor": peer_id_of(key)}, lambda d: sign(key, d))

    wrong = resign({**real, "position": 3})  # a position in window 0, but windows 0 and 1 are opened
    assert refused(wrong).reason == "wrong window" and "not in the last opened window" in str(refused(wrong))
    # an honest row framed: the forger claims the stage's own row is not what the layers compute
    rows = {o["start"] + i: r for o in real["openings"] for i, r in enumerate(o["rows"])}
    p = real["position"] - 1
    framed = resign({**real, "position": p, "recomputed": bytes(rows[p][3][:-1]) + b"\x00"})
    err = refused(framed)
    assert err.reason == "honest stage framed" and err.against == peer_id_of(key) and "evidence against" in str(err)
    facts = dict(real["auditor_class"]["facts"], dtype="bfloat16")
    other = resign({**real, "auditor_class": {"id": proofs.repro.make(facts).id, "facts": facts}})
    assert refused(other).reason == "another class" and "dtype" in str(refused(other))
    tampered = {**real, "openings": [dict(real["openings"][0], rows=real["openings"][0]["rows"][::-1]),
                                     real["openings"][1]]}
    assert refused(tampered).reason == "opening"
    assert refused(resign({**real, "pred_receipt": None})).reason == "input not bound"
    # the predecessor's openings of another job cannot bind this one's input
    assert refused(resign({**real, "pred_openings": real["openings"]})).reason == "opening"
    unsigned = {**real, "sig": "00" * 64}
    assert refused(unsigned).reason == "signature"
    with pytest.raises(ProofRefused, match="not a map") as err:
        proofs.decode(b"\x93\x01\x02\x03")
    assert err.value.reason == "malformed"
    assert refused({**real, "schema": "swarm/fraud-proof/0"}).reason == "malformed"


@pytest.mark.slow
def test_an_auditor_in_another_class_says_not_comparable_never_cheated(model_dir, tmp_path):
    got = _audit(model_dir, tmp_path, "garbage", auditor_dtype="float32")
    outcomes = {v.outcome for v in got["verdicts"][0]}
    assert outcomes == {"not comparable"}, [v.line() for v in got["verdicts"][0]]
    assert all("not comparable: " in v.reason and "dtype" in v.reason for v in got["verdicts"][0])
    assert all(t["audited"] == 0 for t in got["tally"].values()) if got["tally"] else True


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_a_cheating_head_or_tail_is_caught_too(model_dir, tmp_path, stage):
    """The head's inputs are the token ids it committed to (no predecessor binds them); the tail's outputs
    are the greedy ids it sent, re-derived from its re-run."""
    got = _audit(model_dir, tmp_path, "garbage", stage=stage)
    (verdicts,) = got["verdicts"]
    want = ["passed"] * 3
    want[stage] = "failed"
    assert [v.outcome for v in verdicts] == want, [v.line() for v in verdicts]
    proof = verdicts[stage].proof
    assert (proof["pred_receipt"] is None) == (stage == 0)
    assert verify_proof(proof, Blocks(model_dir)).layers == RANGES[stage]

"""Fraud proofs leave the auditor: ``swarm audit run`` writes them, ``swarm audit verify`` re-checks them
(refusing forgeries with the reason), DHT nodes store only proofs that check, and a reader excludes an
identity only after re-running the proof against it on its own weights."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm import proofs
from swarm.auditor.exclusions import Exclusions
from swarm.auditor.judge import Blocks
from swarm.auditor.run import Auditor
from swarm.discovery.dht import open_dht, proof_key
from swarm.errors import ProofRefused, collapse
from swarm.transport import load_or_create_key, open_host
from swarm.transport.identity import peer_id_of, sign
from tests.support.cheats import cheat
from tests.support.cli import run_cli, run_swarm
from tests.support.models import make_synthetic
from tests.support.ring import LOOPBACK, signed_job, start_ring

pytestmark = [pytest.mark.ring, pytest.mark.slow]

RANGES = [(0, 1), (1, 3), (3, 4)]
PROMPT = [1 + (i * 5) % 60 for i in range(20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic("llama", tmp_path_factory.mktemp("proof-model"), "float64")


def _run(main):
    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def _framed(proof: dict, key) -> dict:
    """A forger's proof against an honest row: the stage's own output row at position 1, claimed wrong."""
    rows = proof["openings"][0]["rows"]
    return proofs.sign_claim({**proof, "position": 1, "recomputed": bytes(rows[1][3][:-1]) + b"\x01",
                             "auditor": peer_id_of(key)}, lambda d: sign(key, d))


class _LyingBlocks(Blocks):
    """An auditor's blocks whose tail block computes garbage: its 'proofs' against the tail frame it."""

    def get(self, layers, dtype):
        block = super().get(layers, dtype)
        if tuple(layers) == (3, 4) and not hasattr(block, "_lies"):
            block._lies = cheat(block, "garbage")
        return block


@pytest.fixture(scope="module")
def proof_set(model_dir, tmp_path_factory):
    """A real proof against a stage that changed one value by one ulp (in-process ring and auditor), and
    a lying auditor's proof against the honest tail (its own tail block computes garbage)."""
    tmp = tmp_path_factory.mktemp("proofs")

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, RANGES, tmp)
                cheat(servers[1].block, "ulp", position=5)
                res = await signed_job(spec, model_dir, tmp, PROMPT, tmp / "r", 4)
                key = load_or_create_key(tmp / "auditor.key")
                async with open_host(key, [LOOPBACK]) as host:
                    verdicts = await Auditor(host, key, Blocks(model_dir), rate=1.0).audit_job(res["doc"])
                    liar = await Auditor(host, key, _LyingBlocks(model_dir), rate=1.0).audit_job(res["doc"])
                nursery.cancel_scope.cancel()
        return verdicts, liar

    verdicts, liar = _run(main)
    assert [v.outcome for v in verdicts] == ["passed", "failed", "passed"]
    assert [v.outcome for v in liar] == ["passed", "failed", "failed"]
    return {"real": verdicts[1].proof, "framed": liar[2].proof, "honest": verdicts[2].peer_id,
            "liar": peer_id_of(load_or_create_key(tmp / "auditor.key"))}


@pytest.mark.process
def test_audit_run_writes_a_proof_that_audit_verify_accepts_and_forgeries_are_refused(model_dir, tmp_path):
    got: dict = {}

    async def main():
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, RANGES, tmp_path)
                cheat(servers[1].block, "ulp", position=5)
                res = await signed_job(spec, model_dir, tmp_path, PROMPT, tmp_path / "r", 4)
                got["accused"] = res["doc"]["stage_receipts"][1]["peer_id"]
                got["run"] = await trio.to_thread.run_sync(lambda: run_swarm(
                    "audit", "run", res["path"], "--model", str(model_dir), "--rate", "1", "--proofs",
                    str(tmp_path / "proofs"), "--key", str(tmp_path / "aud.key"), timeout=180))
                nursery.cancel_scope.cancel()

    _run(main)
    run = got["run"]
    assert run.returncode == 1, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert [ln.split()[0] for ln in lines if ln.split()[0] in ("PASSED", "FAILED")] == ["PASSED", "FAILED", "PASSED"]
    (path,) = list((tmp_path / "proofs").glob("*.proof"))
    ok = run_cli("audit", "verify", str(path), "--model", str(model_dir))
    assert ok.returncode == 0 and ok.stdout.startswith("VALID proof: stage " + got["accused"]), ok.stdout
    forged = tmp_path / "framed.proof"
    forger = create_new_key_pair()
    forged.write_bytes(proofs.encode(_framed(proofs.decode(path.read_bytes()), forger)))
    bad = run_cli("audit", "verify", str(forged), str(path), "--model", str(model_dir))
    assert bad.returncode == 1
    assert "REFUSED (honest stage framed)" in bad.stdout
    assert f"evidence against auditor {peer_id_of(forger)}" in bad.stdout
    assert "VALID proof" in bad.stdout  # the other file still checks


def test_dht_nodes_store_only_proofs_that_check_and_readers_exclude_only_after_re_running(model_dir, proof_set):
    real, framed = proof_set["real"], proof_set["framed"]  # framed: the lying auditor's proof against the honest tail
    accused = real["accused"]
    got: dict = {}

    async def main():
        with trio.fail_after(90):
            async with AsyncExitStack() as stack:
                boot_host = await stack.enter_async_context(open_host(create_new_key_pair()))
                boot = await stack.enter_async_context(open_dht(boot_host, server=True))
                addr = boot_host.addrs()[0]
                nodes = []
                for _ in range(2):
                    host = await stack.enter_async_context(open_host(create_new_key_pair()))
                    nodes.append(await stack.enter_async_context(open_dht(host, server=False, bootstrap=[addr])))
                auditor, reader = nodes
                got["stored"] = await auditor.proofs.publish(proofs.encode(real), accused)
                with pytest.raises(ProofRefused) as err:  # a proof filed under another PeerId than it accuses
                    await auditor.proofs.publish(proofs.encode(real), proof_set["honest"])
                got["misfiled"] = err.value
                # a forger bypassing its own check: the DHT node's validator refuses the value
                kb = proof_key(proof_set["honest"]).encode()
                got["raw_put"] = await auditor.dht.value_store._store_at_peer(
                    boot_host.libp2p_host.get_id(), kb, proofs.encode({**real, "sig": "00" * 64}))
                got["boot_has"] = boot.dht.value_store.store.get(kb)
                # a framing checks without weights (signed, openings fine): stored, and refused by readers
                got["framed_stored"] = await auditor.proofs.publish(proofs.encode(framed), proof_set["honest"])
                shut_out = Exclusions(Blocks(model_dir))
                got["excluded"] = await shut_out.excluded(reader, [accused, proof_set["honest"], "12D3KooWnobody"])
                got["refused"] = dict(shut_out.refused)
                got["blind"] = await Exclusions(None).excluded(reader, [accused])

    _run(main)
    assert got["stored"] >= 1
    assert got["misfiled"].reason == "malformed" and "stored under" in str(got["misfiled"])
    assert not got["raw_put"] and got["boot_has"] is None
    assert got["framed_stored"] >= 1
    assert got["excluded"] == frozenset({accused})  # the honest tail, framed, is not excluded
    why = got["refused"][proof_set["honest"]]
    assert "honest stage framed" in why and f"evidence against auditor {proof_set['liar']}" in why
    assert got["blind"] == frozenset()  # no local weights: no proof is re-run, nobody is excluded


def test_framing_proofs_stored_first_do_not_hide_the_real_proof(model_dir, proof_set):
    """Issue 45 item 15: framings of the cheater (signed, checking without weights, re-runs refuse them)
    published before the real proof: one (the report), and PROOF_SLOTS - 1 by as many keys; each node
    keeps several proofs per accused, the first stored never replaced (a flood after the real proof leaves
    it in place), and a reader judges each. Only a flood filling every slot of a node before the real
    proof arrives keeps it out there (the stated bound)."""
    from swarm.discovery.dht import PROOF_SLOTS

    real = proof_set["real"]
    accused = real["accused"]
    floods = {"one framing first": 1, "PROOF_SLOTS - 1 framings first": PROOF_SLOTS - 1,
              "every slot framed first": PROOF_SLOTS, "the real proof, then a flood": PROOF_SLOTS + 2}
    got: dict = {}

    async def one_swarm(case: str, framings: int) -> None:
        async with AsyncExitStack() as stack:
            boot_host = await stack.enter_async_context(open_host(create_new_key_pair()))
            await stack.enter_async_context(open_dht(boot_host, server=True))
            addr = boot_host.addrs()[0]
            nodes = []
            for _ in range(3):
                host = await stack.enter_async_context(open_host(create_new_key_pair()))
                nodes.append(await stack.enter_async_context(open_dht(host, server=False, bootstrap=[addr])))
            framer, auditor, reader = nodes
            framed = [proofs.encode(_framed(real, create_new_key_pair())) for _ in range(framings)]
            if case == "the real proof, then a flood":
                stored = [await auditor.proofs.publish(proofs.encode(real), accused)]
                stored += [await framer.proofs.publish(v, accused) for v in framed]
            else:
                stored = [await framer.proofs.publish(v, accused) for v in framed]
                stored.append(await auditor.proofs.publish(proofs.encode(real), accused))
            stored.append(await framer.proofs.publish(framed[0], accused))  # once more: held already, no new slot
            shut_out = Exclusions(Blocks(model_dir))
            excluded = await shut_out.excluded(reader, [accused])
            got[case] = (stored, excluded, len(await reader.proofs.read_all(accused)), shut_out.judged(accused))

    async def main():
        with trio.fail_after(120):
            for case, framings in floods.items():
                await one_swarm(case, framings)

    _run(main)
    for case in ("one framing first", "PROOF_SLOTS - 1 framings first"):
        stored, excluded, read, judged = got[case]
        assert all(n >= 1 for n in stored), (case, stored)
        assert excluded == frozenset({accused}), (case, judged)
        assert read == floods[case] + 1 and judged["proof"] == "excluded", case
    stored, excluded, read, judged = got["the real proof, then a flood"]  # a flood cannot push a stored one out
    assert stored[0] >= 1 and stored[PROOF_SLOTS - 1] >= 1 and stored[PROOF_SLOTS:PROOF_SLOTS + 3] == [0, 0, 0]
    assert excluded == frozenset({accused}) and read == PROOF_SLOTS
    stored, excluded, read, judged = got["every slot framed first"]
    assert stored[-2] == 0 and read == PROOF_SLOTS  # the bound: the real proof found every slot taken
    assert excluded == frozenset() and "honest stage framed" in judged["why"]

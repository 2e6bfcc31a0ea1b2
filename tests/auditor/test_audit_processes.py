"""Issue 29's acceptance on real processes (loopback): a bootstrap node, stages found over the DHT, one
stage process that skips a layer of [2, 4) (tests/support/cheat_stage.py runs the real daemon with a cheating
block). A coordinator's job goes through it; ``swarm audit run`` catches it and publishes the proof on
the DHT; within 60 s a stage placing itself re-runs the proof and takes the cheater's layers, and the
next client routes around the cheater onto honest stages with the output of an all-honest ring."""

from __future__ import annotations

import json
import sys
import time

import pytest

from swarm.cli.launch import BootstrapNode, LocalRing
from swarm.ranges import LayerRange
from tests.support.cli import run_swarm
from tests.support.models import reference_greedy

# serial: the acceptance times the exclusion (within 60 s of the audit), so it runs alone in `make test`
pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.serial]

NEW = 12


def _coordinate(stories_dir, boot: str, receipts) -> dict:
    proc = run_swarm("coordinate", "--model", str(stories_dir), "--bootstrap", boot, "--prompt", "Once upon a time",
                     "--max-new-tokens", str(NEW), "--json", "--receipt-dir", str(receipts))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_a_cheating_stage_is_caught_published_and_shut_out_by_clients_and_placement(stories_dir, tmp_path):
    common = ["--dtype", "float32"]
    cheat = [sys.executable, "-m", "tests.support.cheat_stage", "skip", "--"]
    with BootstrapNode(tmp_path / "keys" / "boot.key") as boot:
        common += ["--bootstrap", boot.addr]
        with LocalRing(str(stories_dir), [LayerRange(0, 2), LayerRange(4, 5)], tmp_path / "honest", threads=1,
                       extra_args=common), \
                LocalRing(str(stories_dir), [LayerRange(2, 4)], tmp_path / "cheat", threads=1, extra_args=common,
                          per_stage_prefix={0: cheat}) as bad:
            cheater = bad.stages[0].ready["peer_id"]
            first = _coordinate(stories_dir, boot.addr, tmp_path / "receipts")
            assert cheater in {e["peer_id"] for e in first["ring"]}  # the only holder of [2, 4)
            assert first["receipt"]["verified"], first["receipt"]  # receipts alone cannot see the cheat
            t0 = time.monotonic()
            run = run_swarm("audit", "run", first["receipt"]["path"], "--model", str(stories_dir), "--bootstrap",
                            boot.addr, "--proofs", str(tmp_path / "proofs"), "--key", str(tmp_path / "aud.key"),
                            "--rate", "1", "--tally", str(tmp_path / "tally.json"))
            assert run.returncode == 1, run.stderr[-2000:]
            assert f"FAILED stage {cheater[:16]}" in run.stdout and "proof published on the DHT" in run.stdout
            # a stage that places itself counts only honest coverage: the cheater's layers are uncovered
            with LocalRing(str(stories_dir), [None], tmp_path / "placed", threads=1,
                           extra_args=common + ["--num-layers", "2"]) as placed:
                assert placed.stages[0].layers == LayerRange(2, 4)
                assert any("audit.excluded" in ln and cheater in ln for ln in placed.stages[0].stderr_tail)
                second = _coordinate(stories_dir, boot.addr, tmp_path / "receipts")
                took_s = time.monotonic() - t0
                peers = run_swarm("peers", "--bootstrap", boot.addr, "--model", str(stories_dir), "--audits",
                                  str(tmp_path / "tally.json"))
    assert peers.returncode == 0, peers.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in peers.stdout.splitlines() if ln.strip().startswith("..")}
    assert rows[".." + cheater[-12:]].endswith("1/0/1, proof verified"), peers.stdout
    assert sum(ln.endswith("1/1/0") for ln in rows.values()) == 2, peers.stdout  # the honest stages it audited
    used = {e["peer_id"] for e in second["ring"]}
    assert cheater not in used and [e["layers"] for e in second["ring"]] == [[0, 2], [2, 4], [4, 5]]
    assert second["output_ids"] == reference_greedy(stories_dir, second["prompt_ids"], NEW, "float32")
    assert second["receipt"]["verified"]
    assert took_s < 60, f"exclusion took {took_s:.1f} s"

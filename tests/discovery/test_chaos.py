"""A short chaos soak with real processes (``bench/chaos.py``, issue 31): 7 stages of stories260k
announcing on a bootstrap node, 2 clients (one runs ``swarm coordinate --model --bootstrap``, one posts to
``swarm serve --model --bootstrap``) back to
back, and 5 faults (SIGKILL and a comeback under the same key, SIGSTOP then SIGCONT, SIGTERM and a
restart) on random stages. Nothing may be lost, every output equals its solo transformers run, and
every stage is back to 0 open sessions and 0 KV bytes once the clients are done."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.process]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


def _chaos():
    spec = importlib.util.spec_from_file_location("bench_chaos", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_short_chaos_soak_loses_nothing_and_changes_no_output(stories_dir, tmp_path):
    chaos = _chaos()
    # every layer keeps >= 3 holders, so a lost stage has a replacement outside the ring even when another
    # holder of its layers is in the ring already (a heal takes no stage of the ring); one faulted at a time
    result = chaos.main(["--model", str(stories_dir), "--blocks", "0:3,0:3,0:2,2:5,2:5,3:5,1:4", "--clients", "2",
                         "--minutes", "0.9", "--fault-every-s", "6", "--max-faults", "5", "--max-faulted", "1",
                         "--warmup-s", "3", "--new-tokens", "16", "--seed", "7", "--idle-wait-s", "30",
                         "--out", str(tmp_path / "chaos.json")])
    faults, requests = result["faults"], result["requests"]
    assert faults["total"] == 5, faults
    assert requests["lost"] == 0, result["lost_examples"]
    assert requests["different_from_solo"] == 0, result["different_examples"]
    assert requests["completed"] >= 2, requests
    assert result["idle"]["all_zero"], result["stages_end"]
    assert all(s["sessions_open"] == 0 for s in result["stages_end"]), result["stages_end"]

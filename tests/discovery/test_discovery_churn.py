"""Issue 27 with real processes: a bootstrap node that 20 stages joined and left, then stage
processes whose clocks are minutes off (``SWARM_CLOCK_SKEW_S``, the test hook of
``swarm.discovery.clock``): every live one is listed by ``swarm peers`` and routed by
``swarm coordinate``, and a skewed stage says on its console that its clock is off."""

from __future__ import annotations

import json

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm.discovery.dht import open_dht
from swarm.discovery.records import StageRecord, sign_record
from swarm.cli.launch import BootstrapNode, LocalRing
from swarm.ranges import LayerRange
from swarm.transport.host import open_host
from swarm.transport.identity import peer_id_of
from swarm.weights.identify import model_id
from tests.support.cli import run_swarm
from tests.support.models import reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.ring, pytest.mark.process]


def _leave(boot_addr: str, mid: str, n: int) -> list[str]:
    """n stages of the model that announce [0, 5) as DHT servers and leave after draining (their
    last record says ``draining``, as a stage of the previous version left it), one after another."""

    async def main() -> list[str]:
        gone = []
        for _ in range(n):
            key = create_new_key_pair()
            pid = peer_id_of(key)
            async with open_host(key) as host, open_dht(host, server=True, bootstrap=[boot_addr]) as dht:
                rec = StageRecord(peer_id=pid, model_id=mid, model_name="stories260k", num_layers=5, layers=(0, 5),
                                  addrs=tuple(host.addrs()), state="draining", seq=1,
                                  expires_at=dht.clock() + 120)
                await dht.announce(sign_record(key, rec), mid)
            gone.append(pid)
        return gone

    return trio.run(main)


def test_live_stages_are_found_after_20_left_whatever_their_clocks(stories_dir, tmp_path):
    mid = model_id(stories_dir)
    with BootstrapNode(tmp_path / "keys" / "boot.key") as boot:
        gone = _leave(boot.addr, mid, 20)
        common = ["--dtype", "float32", "--bootstrap", boot.addr]
        # behind by 3 minutes in client mode (--dht-client), and 15 minutes ahead serving the DHT
        with LocalRing(str(stories_dir), [LayerRange(0, 5)], tmp_path / "behind", threads=1,
                       extra_args=[*common, "--dht-client"], env={**_env(), "SWARM_CLOCK_SKEW_S": "-180"}) as behind, \
                LocalRing(str(stories_dir), [LayerRange(0, 5)], tmp_path / "ahead", threads=1, extra_args=common,
                          env={**_env(), "SWARM_CLOCK_SKEW_S": "900"}) as ahead:
            stages = [behind.stages[0], ahead.stages[0]]
            assert all(st.ready["announced"] is True for st in stages), [st.ready for st in stages]
            live = {st.ready["peer_id"] for st in stages}
            # -v after the subcommand is accepted (it used to be "unrecognized arguments")
            proc = run_swarm("peers", "--bootstrap", boot.addr, "--model", str(stories_dir), "--json", "-v")
            assert proc.returncode == 0, proc.stderr[-2000:]
            (m,) = json.loads(proc.stdout)["models"]
            listed = {s["peer_id"]: s for s in m["stages"]}
            assert live <= set(listed), (live, listed.keys())
            assert all(listed[p]["state"] == "online" and listed[p]["answered"] for p in live)
            assert set(listed) <= live | set(gone)
            assert m["coverage"] == [2] * 5  # the two live ones; drained records do not count
            proc = run_swarm("coordinate", "--model", str(stories_dir), "--bootstrap", boot.addr,
                             "--prompt", "Once upon a time", "--max-new-tokens", "8", "--json")
            assert proc.returncode == 0, proc.stderr[-2000:]
            result = json.loads(proc.stdout)
            assert result["output_ids"] == reference_greedy(stories_dir, result["prompt_ids"], 8, "float32")
            assert {e["peer_id"] for e in result["ring"]} <= live
            for st in stages:  # each said on its console that its clock is off (a warning, no -v needed)
                assert any("clock.offset" in line for line in st.stderr_tail), st.stderr_tail


def _env() -> dict:
    import os

    return dict(os.environ)

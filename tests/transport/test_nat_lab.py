"""Stages behind home routers (issue 15's acceptance), in a NAT lab of network namespaces.

``tests/support/natlab.py`` builds two NAT routers in front of two hosts, and a public segment with a
``swarm relay``, one public stage and the client. The ring is A (behind NAT 1) -> B (behind NAT
2, the middle) -> C (public): A and B are reachable only through their circuits on the relay,
so every hop that touches them starts relayed, and A -> B has a NAT on both ends.

- Port-preserving NATs: the ring answers exactly; DCUtR punches direct connections and the hops
  move onto them (the client's within ``moved_s`` of connecting); then the relay is SIGKILLed
  and the ring still answers exactly without a heal: A -> B went direct through both NATs.
- Random-port NATs: no punch between A and B can work; the hop A -> B stays on the relay and
  the ring answers exactly; killing the relay mid-answer breaks that hop, and (no spare listed)
  the answer fails within seconds naming the stage instead of stalling.

Traffic never leaves the lab's namespaces. Skips with one line where namespaces, root or
iptables are missing (``.ci/run`` installs iptables where it can).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from swarm.config import RingSpec, StageSpec
from swarm.cli.launch import BootstrapNode, LocalRing
from swarm.ranges import LayerRange
from tests.support.models import reference_greedy
from tests.support.natlab import NatLab

pytestmark = [pytest.mark.slow, pytest.mark.process]

RANGES = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
PROMPT = [1, 403, 407, 261, 378]
NEW = 24
SETTLE_S = 5.0  # after the client's own streams moved, the stages' hop (A -> B) gets this long before the relay dies
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab_ok():
    why = NatLab.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def expected(stories_dir):
    return reference_greedy(stories_dir, PROMPT, NEW, "float32")


def _run_lab(stories_dir, tmp_path, random_ports: bool) -> dict:
    with NatLab(random_ports=random_ports) as lab:
        relay = BootstrapNode(tmp_path / "relay.key", role="relay", listen=f"/ip4/{lab.PUB_IP}/tcp/4001",
                              prefix=lab.ns_exec("pub"))
        with relay:
            per_args = {0: ["--listen", f"/ip4/{lab.host_ip(1)}/tcp/0", "--relay", relay.addr],
                        1: ["--listen", f"/ip4/{lab.host_ip(2)}/tcp/0", "--relay", relay.addr],
                        2: ["--listen", f"/ip4/{lab.PUB_IP}/tcp/0"]}
            prefix = {0: lab.ns_exec("h1"), 1: lab.ns_exec("h2"), 2: lab.ns_exec("pub")}
            with LocalRing(str(stories_dir), RANGES, tmp_path / "keys", threads=1, extra_args=["--dtype", "float32"],
                           per_stage_args=per_args, per_stage_prefix=prefix, startup_timeout_s=240) as ring:
                a, b, c = ring.stages
                stages = (StageSpec(a.ready["relay_addrs"][0], RANGES[0]), StageSpec(b.ready["relay_addrs"][0], RANGES[1]),
                          StageSpec(c.addr, RANGES[2]))
                ring_file = tmp_path / "ring.yaml"
                ring_file.write_text(yaml.safe_dump(RingSpec(str(stories_dir), stages).to_dict(), sort_keys=False))
                config = tmp_path / "client.json"
                config.write_text(json.dumps({
                    "ring": str(ring_file), "model": str(stories_dir), "prompt": PROMPT, "new": NEW,
                    "mode": "relayed" if random_ports else "punch", "relay_pid": relay.proc.pid,
                    "key": str(tmp_path / "client.key"), "ip": lab.PUB_IP, "settle_s": SETTLE_S}))
                proc = subprocess.run([*lab.ns_exec("pub"), sys.executable, "-m", "tests.support.nat_client", str(config)],
                                      cwd=ROOT, capture_output=True, text=True, timeout=300)
                assert proc.returncode == 0, proc.stderr[-3000:]
                return json.loads(proc.stdout.strip().splitlines()[-1])


def test_behind_two_port_preserving_nats_the_ring_punches_through_and_stays_exact(lab_ok, stories_dir, expected,
                                                                                    tmp_path):
    got = _run_lab(stories_dir, tmp_path, random_ports=False)
    assert got["first"] == expected  # relayed
    assert got["moves"] >= 4, got  # the client's data + control streams to A and B moved
    # the relay died moved_s + SETTLE_S after the client started connecting (measured on a quiet
    # machine: 2.1 s, then 5 s); the bound here leaves room for a loaded CI machine
    assert got["moved_s"] + SETTLE_S < 20, got
    # the stages' own hop A -> B, NATs on both ends: relayed at the first session, direct within
    # 5 s of opening it (issue 15's bound), measured by stage A itself
    (hop,) = got["stage_hops"]
    assert hop["moves"] == 1 and not hop["relayed"] and hop["moved_after_s"] < 5, got
    assert got["again"] == expected and got["heal_events"] == []  # the relay is dead: every hop is direct


def test_behind_random_port_nats_the_ring_stays_relayed_and_exact(lab_ok, stories_dir, expected, tmp_path):
    got = _run_lab(stories_dir, tmp_path, random_ports=True)
    assert got["first"] == expected and got["again"] == expected and got["heal_events"] == []
    # the client is public: A and B reach it directly by themselves (DCUtR's unilateral upgrade),
    # so the client's streams move; the hop A -> B has a random-port NAT on both ends and stays
    # on the relay: when the relay dies mid-answer, that hop is gone, and (no spare is listed) the
    # answer fails at once naming the stage (stage A reports its lost successor; the heal blames
    # the stage cut off), where in the port-preserving lab it went on
    assert got["moves"] >= 4, got
    (hop,) = got["stage_hops"]
    assert hop["relayed"] and hop["moves"] == 0, got  # A -> B: no punch through random-port NATs
    assert got["after_relay_died"].startswith("NoSpare") and "[2, 4)" in got["after_relay_died"], got
    # stage A finds its hop's stream gone and says so at once (measured here: 1.0 s, where finding the
    # gap by probing took 8 s, and a send that failed mid-chunk waited out the hop timeout)
    assert got["failed_after_s"] < 6, got  # the gap probe alone needs >= 5 s (GAP_S) plus probes

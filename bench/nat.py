"""Stages behind NAT: a relayed ring against the same ring after hole punching, in a NAT lab.

Builds the lab of ``tests/support/natlab.py`` (network namespaces: two home routers that keep source ports
and drop unsolicited inbound, a public segment with a ``swarm relay``; needs root, ``ip`` and
``iptables``) and a ring of stories260k: A [0, 2) behind router 1, B [2, 4) behind router 2,
C [4, 5) public; the client runs in the public segment and names A and B only by their circuit
addresses. Two rings side by side in one run, the same positions and weights:

- relayed: A and B started with ``--no-hole-punch`` (and the client too): client -> A and A -> B
  cross the relay on every token;
- punched: A' and B' with hole punching: DCUtR punches direct connections and the hops move.

Prints one JSON object: ``relayed_tokens_per_s`` and ``direct_tokens_per_s`` (greedy decode of
``--new-tokens`` after a warm-up request, median of ``--trials``), ``relayed_decode_ms_per_hop``
((ms per token relayed - ms per token direct) / 2 relayed hops on the token's path),
``direct_after_punch_s`` (from the client starting to connect until its streams to A' and B' have
moved onto direct connections), and whether every output equals the relayed ring's.
Usage: sudo python bench/nat.py [--new-tokens 48] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = [1, 403, 407, 261, 378, 300, 265]


async def _client(cfg: dict) -> dict:
    """Runs inside the lab's public namespace (``--client CONFIG``)."""
    import trio

    from swarm.config import RingSpec, SpecConfig
    from swarm.coordinator.decoding import DecodeOptions, decode
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest
    from swarm.coordinator.ring import RingClient
    from swarm.transport import load_or_create_key, open_host
    from swarm.transport.circuit import is_circuit

    spec = RingSpec.load(cfg["ring"])
    out: dict = {}
    async with open_host(load_or_create_key(cfg["key"]), [f"/ip4/{cfg['ip']}/tcp/0"],
                         hole_punch=cfg["punch"]) as host, trio.open_nursery() as nursery:
        client = RingClient(host, spec, hop_timeout_s=60.0, connect_timeout_s=20.0, heartbeat_s=1.0)
        start = time.monotonic()
        await client.connect(model_num_layers(cfg["model"]), model_manifest_digest(cfg["model"]), nursery)
        outputs, rates = [], []
        await decode(client, PROMPT, DecodeOptions(8, spec=SpecConfig()))  # warm-up
        if cfg["punch"]:
            relayed = [link for link in client.links if is_circuit(link.spec.addr)]
            with trio.fail_after(60):
                while any(s.moves == 0 for link in relayed for s in (link.data, link.control)):
                    await trio.sleep(0.05)
            out["direct_after_punch_s"] = round(time.monotonic() - start, 2)
            await trio.sleep(2.0)  # the stages' own hop A' -> B' moves on the same schedule
        for _ in range(cfg["trials"]):
            t0 = time.monotonic()
            ids = (await decode(client, PROMPT, DecodeOptions(cfg["new"], spec=SpecConfig()))).output_ids
            rates.append(cfg["new"] / (time.monotonic() - t0))
            outputs.append(ids)
        out["tokens_per_s"] = round(statistics.median(rates), 2)
        out["each"] = [round(r, 2) for r in rates]
        out["outputs"] = outputs
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/stories260k"))
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        import trio

        print(json.dumps(trio.run(_client, json.loads(Path(args.client).read_text()))), flush=True)
        return

    import yaml

    from swarm.config import RingSpec, StageSpec
    from swarm.cli.launch import BootstrapNode, LocalRing
    from swarm.ranges import LayerRange
    from tests.support.natlab import NatLab

    why = NatLab.unavailable()
    if why:
        sys.exit(f"bench/nat.py: {why}")
    ranges = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
    results = {}
    with tempfile.TemporaryDirectory() as d, NatLab() as lab:
        tmp = Path(d)
        with BootstrapNode(tmp / "relay.key", role="relay", listen=f"/ip4/{lab.PUB_IP}/tcp/4001",
                           prefix=lab.ns_exec("pub")) as relay:
            h = [None, lab.host_ip(1), lab.host_ip(2)]
            per_args = {0: ["--listen", f"/ip4/{h[1]}/tcp/0", "--relay", relay.addr, "--no-hole-punch"],
                        1: ["--listen", f"/ip4/{h[2]}/tcp/0", "--relay", relay.addr, "--no-hole-punch"],
                        2: ["--listen", f"/ip4/{h[1]}/tcp/0", "--relay", relay.addr],
                        3: ["--listen", f"/ip4/{h[2]}/tcp/0", "--relay", relay.addr],
                        4: ["--listen", f"/ip4/{lab.PUB_IP}/tcp/0"]}
            prefix = {0: lab.ns_exec("h1"), 1: lab.ns_exec("h2"), 2: lab.ns_exec("h1"), 3: lab.ns_exec("h2"),
                      4: lab.ns_exec("pub")}
            with LocalRing(args.model, ranges, tmp / "keys", threads=1, extra_args=["--dtype", "float32"],
                           per_stage_args=per_args, per_stage_prefix=prefix, startup_timeout_s=300) as ring:
                st = ring.stages
                for name, (a, b), punch in (("relayed", (0, 1), False), ("punched", (2, 3), True)):
                    stages = (StageSpec(st[a].ready["relay_addrs"][0], ranges[a]),
                              StageSpec(st[b].ready["relay_addrs"][0], ranges[b]), StageSpec(st[4].addr, ranges[4]))
                    ring_file = tmp / f"{name}.yaml"
                    ring_file.write_text(yaml.safe_dump(RingSpec(args.model, stages).to_dict(), sort_keys=False))
                    cfg = tmp / f"{name}.json"
                    cfg.write_text(json.dumps({"ring": str(ring_file), "model": args.model, "new": args.new_tokens,
                                               "trials": args.trials, "punch": punch, "ip": lab.PUB_IP,
                                               "key": str(tmp / f"{name}-client.key")}))
                    proc = subprocess.run([*lab.ns_exec("pub"), sys.executable, str(Path(__file__).resolve()),
                                           "--client", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                                          timeout=600)
                    if proc.returncode != 0:
                        sys.exit(f"bench/nat.py: the {name} client failed: {proc.stderr[-2000:]}")
                    results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    relayed, punched = results["relayed"], results["punched"]
    reference = relayed["outputs"][0]
    ms = {k: 1000.0 / results[k]["tokens_per_s"] for k in results}
    print(json.dumps({
        "model": Path(args.model).name, "new_tokens": args.new_tokens, "trials": args.trials,
        "relayed_tokens_per_s": relayed["tokens_per_s"], "relayed_each": relayed["each"],
        "direct_tokens_per_s": punched["tokens_per_s"], "direct_each": punched["each"],
        "relayed_decode_ms_per_hop": round((ms["relayed"] - ms["punched"]) / 2, 2),
        "direct_after_punch_s": punched["direct_after_punch_s"],
        "identical": all(o == reference for r in results.values() for o in r["outputs"]),
        "lab": "two port-preserving NATs (iptables MASQUERADE, inbound dropped), relay on the public segment",
    }))


if __name__ == "__main__":
    main()

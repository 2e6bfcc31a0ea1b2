"""Soak: a flood of throw-away PeerIds announcing stages that never answer, against one honest stage.

Issue 45, item 3: 300 fake providers announced in 49 s made ``swarm peers`` list "256 not answering,
uncovered [0, 5)" and pushed the honest stage out of the DHT's provider lists for ~10 minutes. This
bench runs, on 127.0.0.1 (port 0): a bootstrap node and one honest stage holding every layer of the
model (``swarm bootstrap`` and ``swarm stage --bootstrap`` processes), up ``--settle-s`` (default 70 s: it
has announced twice, as a stage that has served a while has), then ``--fakes`` fresh PeerIds,
``--rate`` a second, each joining the DHT and announcing a validly signed record of the same model
and layers whose address accepts nothing (the product's own ``SwarmDHT.announce``). Every
``--check-every-s`` during the flood, once after it and once more an announce interval later (65 s),
``swarm peers --json`` (the command, as a user runs it) must list the honest stage as answering and the
model's layers all covered by answering stages; after the flood ``swarm coordinate`` through the bootstrap node must route to the honest stage
and answer.

Prints one JSON object: fakes announced (and failed), each check's time, stages listed, how many did
not answer, whether the honest stage answered, the uncovered ranges and the command's wall seconds;
the generation's route and tokens; ``ok``. Bounded by ``--deadline-s``.
Usage: python bench/provider_flood.py [--model PATH] [--fakes 300] [--rate 6] [--check-every-s 15] [--settle-s 70]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from swarm.cli.launch import BootstrapNode, LocalRing  # noqa: E402
from swarm.discovery.dht import open_dht  # noqa: E402
from swarm.discovery.records import StageRecord, sign_record  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from swarm.transport import open_host  # noqa: E402
from swarm.transport.identity import peer_id_of  # noqa: E402

DEAD_PORT = 9  # discard: nothing listens there on a test machine, so a dial is refused at once


async def _fake(boot: str, honest: StageRecord, failures: list) -> None:
    """One throw-away PeerId: join the DHT, announce a copy of the honest record under its own key, leave."""
    key = create_new_key_pair()
    peer = peer_id_of(key)
    try:
        async with open_host(key) as host, \
                open_dht(host, server=False, bootstrap=[boot], sync_clock=False, join_attempts=1, timeout_s=10) as dht:
            now = dht.clock()
            record = StageRecord(**{**honest.__dict__, "peer_id": peer, "addrs": (f"/ip4/127.0.0.1/tcp/{DEAD_PORT}/p2p/{peer}",),
                                    "relay_addrs": (), "seq": int(now * 1000), "expires_at": now + 600, "rtt_ms": {}})
            await dht.announce(sign_record(key, record), honest.model_id)
    except Exception as exc:  # a fake's own failure is counted, not fatal
        failures.append(repr(exc)[:200])


async def _honest_record(boot: str, peer_id: str) -> StageRecord:
    """The honest stage's record as the DHT serves it (the fakes copy its model, layers and claims)."""
    async with open_host(create_new_key_pair()) as host, open_dht(host, server=False, bootstrap=[boot]) as dht:
        for _ in range(60):
            records, _ = await dht.read_records(None, timeout_s=10, quorum=1.0)
            mine = [r for r in records if r.peer_id == peer_id]
            if mine:
                return mine[0]
            await trio.sleep(1)
    raise RuntimeError(f"the honest stage {peer_id} never appeared on the DHT")


def _peers(boot: str, env: dict, timeout_s: float) -> dict:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "swarm", "peers", "--bootstrap", boot, "--json",
                          "--timeout-s", str(timeout_s)], capture_output=True, text=True, env=env, timeout=300)
    took = time.monotonic() - t0
    if out.returncode != 0:
        return {"ok": False, "error": out.stderr[-500:], "wall_s": round(took, 1)}
    doc = json.loads(out.stdout)
    return {"doc": doc, "wall_s": round(took, 1)}


def _check(boot: str, env: dict, honest_peer: str, t0: float, timeout_s: float) -> dict:
    got = _peers(boot, env, timeout_s)
    if "doc" not in got:
        return {"t_s": round(time.monotonic() - t0, 1), **got}
    models = got["doc"]["models"]
    stages = [s for m in models for s in m["stages"]]
    mine = [s for s in stages if s["peer_id"] == honest_peer]
    uncovered = [u for m in models for u in m["uncovered"]]
    return {"t_s": round(time.monotonic() - t0, 1), "listed": len(stages),
            "not_answering": sum(1 for s in stages if s["answered"] is False),
            "honest_answered": bool(mine and mine[0]["answered"]), "uncovered": uncovered,
            "wall_s": got["wall_s"], "ok": bool(mine and mine[0]["answered"]) and not uncovered}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "stories260k"))
    ap.add_argument("--fakes", type=int, default=300)
    ap.add_argument("--rate", type=float, default=6.0, help="fake announces per second")
    ap.add_argument("--check-every-s", type=float, default=15.0)
    ap.add_argument("--settle-s", type=float, default=70.0, help="the honest stage's time up before the flood")
    ap.add_argument("--peers-timeout-s", type=float, default=10.0, help="swarm peers --timeout-s")
    ap.add_argument("--deadline-s", type=float, default=900.0)
    args = ap.parse_args(argv)
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import resolve_model

    model_dir = resolve_model(args.model).path
    layers = model_num_layers(model_dir)
    out: dict = {"bench": "provider_flood", "model": Path(args.model).name, "fakes": args.fakes, "rate": args.rate,
                 "checks": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "SWARM_CACHE": str(Path(tmp) / "cache"), "PYTHONUNBUFFERED": "1"}
        with BootstrapNode(Path(tmp) / "boot.key", env=env) as boot, \
                LocalRing(args.model, [LayerRange(0, layers)], Path(tmp), threads=1, env=env,
                          extra_args=["--bootstrap", boot.addr, "--dtype", "float32"]) as ring:
            honest_peer = ring.stages[0].ready["peer_id"]
            honest = trio.run(_honest_record, boot.addr, honest_peer)
            time.sleep(max(0.0, args.settle_s - (time.monotonic() - started)))
            out["before"] = _check(boot.addr, env, honest_peer, started, args.peers_timeout_s)
            failures: list[str] = []
            t_flood = time.monotonic()

            async def flood():
                async with trio.open_nursery() as nursery:
                    for i in range(args.fakes):
                        nursery.start_soon(_fake, boot.addr, honest, failures)
                        await trio.sleep(1 / args.rate)

            worker = threading.Thread(target=trio.run, args=(flood,), daemon=True)
            worker.start()
            while worker.is_alive() and time.monotonic() - started < args.deadline_s:
                worker.join(args.check_every_s)
                if worker.is_alive():
                    out["checks"].append(_check(boot.addr, env, honest_peer, started, args.peers_timeout_s))
            out["flood_s"] = round(time.monotonic() - t_flood, 1)
            out["fakes_failed"] = len(failures)
            out["fake_failures"] = sorted(set(failures))[:5]
            out["after"] = _check(boot.addr, env, honest_peer, started, args.peers_timeout_s)
            time.sleep(65)  # the stage announces again meanwhile; the fakes never do
            out["later"] = _check(boot.addr, env, honest_peer, started, args.peers_timeout_s)
            gen = subprocess.run([sys.executable, "-m", "swarm", "coordinate", "--model", args.model, "--bootstrap",
                                  boot.addr, "--prompt", "Once upon a time", "--max-new-tokens", "12", "--json"],
                                 capture_output=True, text=True, env=env, timeout=300)
            if gen.returncode == 0:
                doc = json.loads(gen.stdout.strip().splitlines()[-1])
                route = [e["peer_id"] for e in doc.get("ring", [])]
                out["generate"] = {"ok": route == [honest_peer], "route_is_honest": route == [honest_peer],
                                   "tokens": len(doc.get("output_ids", []))}
            else:
                out["generate"] = {"ok": False, "error": gen.stderr[-500:]}
    out["wall_s"] = round(time.monotonic() - started, 1)
    out["ok"] = bool(out["before"].get("ok") and all(c.get("ok") for c in out["checks"]) and out["after"].get("ok")
                     and out["later"].get("ok") and out["generate"].get("ok"))
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Discovery on loopback: how fast a swarm with a DHT becomes usable, routes and heals without spares.

Starts a bootstrap node and ``--stages`` (default 10) real ``swarm stage`` processes of stories260k
(1 torch thread each) holding overlapping blocks, every one announcing on the DHT; nothing is
listed by hand. Then, in one run, side by side:

- ``routable_after_ready_s``: the swarm has a gap at the last layer; a stage holding it is started,
  and from its READY line a client retries routing until a route exists (through that stage):
  the median over ``--trials`` fresh stages;
- ``route_build_s``: what ``swarm coordinate --model`` spends on routing: join the DHT as a client,
  read and check every record, probe RTTs, plan (median of ``--trials`` fresh clients);
- ``heal_without_spare_s``: a routed stage is SIGKILLed after ``--kill-at`` committed tokens, no
  spare listed anywhere: the heal's total (detect + replacement from the DHT + reset + replay,
  ``HealEvent.total_s``), and the ids are checked against an uninterrupted run.

Targets (issue 14): routable within 5 s of READY, route built within 2 s, heal without spare
within 3 s. Prints one JSON object.
Usage: python bench/discovery.py [--stages 10] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.coordinator.decoding import DecodeOptions, decode  # noqa: E402
from swarm.discovery.client import discover_ring  # noqa: E402
from swarm.discovery.dht import open_dht  # noqa: E402
from swarm.errors import ConfigError, collapse  # noqa: E402
from swarm.cli.launch import BootstrapNode, LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import model_manifest_digest, resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.coordinator.routing import RouteContext  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402
from swarm.weights.identify import model_id  # noqa: E402

PROMPT = [1, 403, 407, 261, 378, 300, 265]


def blocks(num_layers: int, count: int, seed: int, avoid_last: bool) -> list[LayerRange]:
    """``count`` overlapping blocks of 2-3 layers covering [0, L) (or [0, L-1) with avoid_last)."""
    rng = random.Random(seed)
    top = num_layers - 1 if avoid_last else num_layers
    out = [LayerRange(0, 2), LayerRange(max(0, top - 2), top)]
    while len(out) < count:
        size = rng.choice((2, 3))
        start = rng.randrange(0, max(1, top - size + 1))
        out.append(LayerRange(start, min(top, start + size)))
    return out


async def _route_once(boot: str, tmp: Path, model_dir: Path, mid: str, n: int, name: str):
    async with open_host(load_or_create_key(tmp / f"{name}.key")) as host:
        start = time.monotonic()
        async with open_dht(host, server=False, bootstrap=[boot]) as dht:
            found = await discover_ring(dht, str(model_dir), mid, n, context_tokens=64)
        return time.monotonic() - start, found


def route_build(boot: str, tmp: Path, model_dir: Path, mid: str, n: int, trials: int) -> tuple[list[float], list]:
    times, routes = [], []
    for i in range(trials):
        seconds, found = trio.run(_route_once, boot, tmp, model_dir, mid, n, f"route-{i}")
        times.append(seconds)
        routes.append([(h.peer_id[-8:], h.layers) for h in found.route.hops])
    return times, routes


def routable_after_ready(boot: str, tmp: Path, model: str, model_dir: Path, mid: str, n: int, trial: int) -> float:
    """Start the only holder of the last layer; seconds from its READY until a client routes."""
    with LocalRing(model, [LayerRange(n - 1, n)], tmp / f"late-{trial}", threads=1,
                   extra_args=["--dtype", "float32", "--bootstrap", boot]) as late:
        ready_at = time.monotonic()
        while True:
            try:
                _, found = trio.run(_route_once, boot, tmp, model_dir, mid, n, f"late-client-{trial}")
                assert found.route.hops[-1].peer_id == late.stages[0].ready["peer_id"]
                return time.monotonic() - ready_at
            except ConfigError:
                if time.monotonic() - ready_at > 60:
                    raise
                time.sleep(0.1)


async def _heal(boot: str, tmp: Path, model_dir: Path, mid: str, n: int, pids: dict, kill_at: int, new: int):
    async with open_host(load_or_create_key(tmp / "heal.key")) as host, trio.open_nursery() as nursery:
        async with open_dht(host, server=False, bootstrap=[boot]) as dht:
            found = await discover_ring(dht, str(model_dir), mid, n, context_tokens=len(PROMPT) + new)
            ring = RingClient(host, found.ring, 30.0, 10.0, heartbeat_s=0.5, model_id=mid)
            ring.discovery = RouteContext(dht, mid, tuple(found.records))
            await ring.connect(n, model_manifest_digest(model_dir), nursery)
            victim = found.route.hops[0].peer_id

            def on_ids(out):
                if len(out) >= kill_at and victim in pids:
                    os.kill(pids.pop(victim), signal.SIGKILL)

            decoded = await decode(ring, PROMPT, DecodeOptions(new, heal=True), on_ids=on_ids)
            out, rec = decoded.output_ids, decoded.as_record()
            nursery.cancel_scope.cancel()
    return out, rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared/models/stories260k"))
    ap.add_argument("--stages", type=int, default=10)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()

    resolved = resolve_model(args.model)
    n = model_num_layers(resolved.path)
    mid = model_id(resolved.path)
    import torch
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=torch.float32).eval()
    ref = ref_model.generate(torch.tensor([PROMPT]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False)[0, len(PROMPT):].tolist()  # the uninterrupted single-process run
    del ref_model
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        os.environ.setdefault("SWARM_CACHE", str(tmp / "cache"))
        with BootstrapNode(tmp / "boot.key") as boot:
            common = ["--dtype", "float32", "--bootstrap", boot.addr]
            t0 = time.monotonic()
            gap = blocks(n, args.stages, seed=1, avoid_last=True)
            with LocalRing(args.model, gap, tmp / "keys", threads=1, extra_args=common, startup_timeout_s=600):
                started_s = time.monotonic() - t0
                routable = [routable_after_ready(boot.addr, tmp, args.model, resolved.path, mid, n, i)
                            for i in range(args.trials)]
            full = blocks(n, args.stages, seed=2, avoid_last=False)
            with LocalRing(args.model, full, tmp / "keys-full", threads=1, extra_args=common,
                           startup_timeout_s=600) as swarm:
                build, routes = route_build(boot.addr, tmp, resolved.path, mid, n, args.trials)
                pids = {s.ready["peer_id"]: s.proc.pid for s in swarm.stages}
                try:
                    out, rec = trio.run(_heal, boot.addr, tmp, resolved.path, mid, n, pids, args.kill_at,
                                        args.new_tokens)
                except BaseExceptionGroup as group:
                    raise collapse(group) from None
    (event,) = rec["heal_events"]
    print(json.dumps({
        "model": resolved.name, "stages": args.stages, "trials": args.trials,
        "swarm_start_s": round(started_s, 2),
        "routable_after_ready_s": round(statistics.median(routable), 3),
        "routable_after_ready_each_s": [round(x, 3) for x in routable],
        "route_build_s": round(statistics.median(build), 3), "route_build_each_s": [round(x, 3) for x in build],
        "route_example": routes[0],
        "heal_without_spare_s": round(event["total_s"], 3),
        "heal": {k: event[k] for k in ("detect_s", "swap_s", "replay_s", "replay_tokens", "spare", "layers")},
        "heal_identical": out == ref,
        "targets": {"routable_after_ready_s": 5.0, "route_build_s": 2.0, "heal_without_spare_s": 3.0},
    }))


if __name__ == "__main__":
    main()

"""Weights from peers on loopback: how fast a stage's shards move, and how soon a fresh stage serves.

Starts one real ``swarm stage`` holding SmolLM2-135M (converted once into the user's cache, as
``make demo`` does), then, side by side:

- ``peer_fetch_mb_per_s``: this process fetches the shards of layers ``--layers`` (default 10:20:
  two shards, ~205 MB) from that stage over ``/swarm/weights/1.0.0`` into a fresh directory, every
  tensor hashed while it arrives and checked against the manifest: fetched bytes / wall time of the
  whole fetch (dial, manifest, config, shards, renames), median of ``--trials`` (runs listed);
- ``join_seconds``: a fresh ``swarm stage --model smollm2-135m --layers 10:20 --fetch-from ADDR``
  (empty ``SWARM_CACHE``, 1 thread) from spawn until its ``SWARM_STAGE_READY`` line: interpreter
  and torch start-up, the fetch, loading the block, the kernel proof; ``join_warm_seconds`` is the
  same stage restarted on what it fetched (re-verified, nothing fetched), so the difference is
  what fetching costs.

Target (issue 15): ``peer_fetch_mb_per_s`` >= 120 on loopback. Prints one JSON object.
Usage: python bench/weights.py [--layers 10:20] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.resolve import resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from swarm.transport import encode_frame, load_or_create_key, open_host  # noqa: E402
from swarm.weights.peer import PROTOCOL_ID, fetch_weights  # noqa: E402

MODEL = "smollm2-135m"


async def _warm_manifest(addr: str, key_path: Path) -> float:
    """Ask the holder for its manifest once (it hashes its model on the first request; cached on disk)."""
    async with open_host(load_or_create_key(key_path)) as host:
        t0 = time.monotonic()
        raw = await host.open_raw_stream(addr, PROTOCOL_ID, 60.0)
        await raw.write(encode_frame({"t": "manifest"}))
        await raw.read(4)
        await raw.reset()
        return time.monotonic() - t0


async def _fetch(addr: str, root: Path, layers: LayerRange, key_path: Path):
    async with open_host(load_or_create_key(key_path)) as host:
        return await fetch_weights(host, [addr], name=MODEL, layers=layers, root=root, timeout_s=60.0)


def _join(addr: str, layers: LayerRange, cache: Path, keys: Path) -> float:
    env = dict(os.environ, SWARM_CACHE=str(cache))
    t0 = time.monotonic()
    with LocalRing(MODEL, [layers], keys, threads=1, env=env, extra_args=["--fetch-from", addr]):
        return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="10:20", help="the joining stage's range (default 10:20)")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    layers = LayerRange.parse(args.layers)
    source = resolve_model(MODEL).path  # converts once into the user's cache
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        with LocalRing(MODEL, [LayerRange(20, 30)], tmp / "keys-holder", threads=1) as holder:
            addr = holder.stages[0].addr
            manifest_s = trio.run(_warm_manifest, addr, tmp / "client.key")
            runs, cpu = [], []
            for i in range(args.trials):
                c0 = time.process_time()
                got = trio.run(_fetch, addr, tmp / f"fetch-{i}", layers, tmp / "client.key")
                cpu.append(time.process_time() - c0)
                if got.path is None:
                    raise SystemExit(f"fetch failed: {got.failures}")
                runs.append(got.fetched_bytes / got.seconds / 1e6)
                shards = sorted(p.name for p in got.path.glob("*.safetensors"))
            join_s = _join(addr, layers, tmp / "join-cache", tmp / "keys-join")
            warm_s = _join(addr, layers, tmp / "join-cache", tmp / "keys-join")
    print(json.dumps({
        "peer_fetch_mb_per_s": round(statistics.median(runs), 1),
        "peer_fetch_runs_mb_per_s": [round(r, 1) for r in runs],
        "fetcher_cpu_s_per_gb": round(statistics.median(cpu) / (got.fetched_bytes / 1e9), 2),
        "fetched_bytes": got.fetched_bytes, "fetched_shards": shards,
        "join_seconds": round(join_s, 2), "join_warm_seconds": round(warm_s, 2),
        "holder_first_manifest_s": round(manifest_s, 2),
        "model": MODEL, "source": str(source), "layers": [layers.start, layers.end],
        "target_peer_fetch_mb_per_s": 120, "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()

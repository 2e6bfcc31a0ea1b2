"""Resident memory of a stage holding 10 of 30 layers vs one holding the whole model.

Runs a real 3-stage ring and then a 1-stage ring (whole model), generates a few tokens through
each so every weight page a stage holds is touched (weights are mmapped from safetensors), then
reads each stage's VmRSS / RssAnon / RssFile and the resident pages of its mmapped .safetensors
files from /proc. Prints one JSON object with the figures
and the ratios. Linux only (reads /proc). Usage: python bench/stage_memory.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.errors import collapse  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.resolve import model_manifest_digest  # noqa: E402
from swarm.ranges import even_split  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402


def memory_mb(pid: int) -> dict:
    """VmRSS, and its split into anonymous memory and file-backed (mmapped weight) pages, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(rest.split()[0]) / 1024, 1)
    weights_kb, path = 0, ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5:  # a mapping header line
            path = parts[5] if len(parts) > 5 else ""
        elif parts and parts[0] == "Rss:" and path.endswith(".safetensors"):
            weights_kb += int(parts[1])
    out["weights_mmapped_resident"] = round(weights_kb / 1024, 1)
    return out


async def _generate(spec, model_dir, prompt_ids, key):
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, spec, 120.0, 30.0)
        await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
        await decode(ring, prompt_ids, DecodeOptions(8))
        nursery.cancel_scope.cancel()


def measure(model: str, model_dir: Path, ranges: list[LayerRange], key_dir: Path) -> list[dict]:
    """Run a ring of ``ranges``, generate 8 tokens (so every weight page is touched), read each stage's memory."""
    with LocalRing(model, ranges, key_dir, threads=1, extra_args=["--dtype", "float32"]) as ring:
        key = load_or_create_key(key_dir / "coord.key")
        try:
            trio.run(_generate, ring.ring_spec(), model_dir, list(range(1, 33)), key)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
        time.sleep(0.5)
        return [{"layers": str(sp.layers), **memory_mb(sp.proc.pid)} for sp in ring.stages]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    resolved = resolve_model(args.model)
    n = model_num_layers(resolved.path)
    with tempfile.TemporaryDirectory() as tmp:
        head, middle, tail = measure(args.model, resolved.path, even_split(n, 3), Path(tmp))
        (full,) = measure(args.model, resolved.path, [LayerRange(0, n)], Path(tmp))
    print(json.dumps({
        "model": resolved.name, "num_layers": n, "unit": "MiB",
        "head_stage": head, "middle_stage": middle, "tail_stage": tail, "full_model_stage": full,
        "middle_over_full_rss": round(middle["VmRSS"] / full["VmRSS"], 3),
        "middle_over_full_weights": round(middle["weights_mmapped_resident"] / full["weights_mmapped_resident"], 3),
    }))


if __name__ == "__main__":
    main()

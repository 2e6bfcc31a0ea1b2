"""Load on `swarm serve`: 1, 4 and 16 concurrent streaming clients on a 3-stage loopback ring.

Each client sends streaming completions (greedy, fixed length) one after another; every level runs
for the same number of requests per client. Reports, per level: aggregate tokens/s (all clients'
completion tokens over the level's wall time), p50/p95 time to first token and p50/p95
inter-token latency, and the ratio of aggregate tokens/s at 16 clients to 1 client (the issue's
target is >= 4x).

Three stage set-ups run side by side in one invocation (this machine is shared and noisy):
"batched" (the defaults: continuous batching in fixed 2-row GEMM tiles, exact, a step waits up to
10 ms for other batching sessions' rows), "nowait" (the same with ``--batch-wait-ms 0``) and
"unbatched" (``--max-batch-rows 1 --batch-tile 1 --batch-wait-ms 0``: one session per forward,
plain GEMMs, as before batching).
Each reports the stages' batching counters from ``/health`` after its levels.

Prints one JSON object. Usage: python bench/serve_load.py [--model smollm2-135m] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.config import RingSpec  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import resolve_model  # noqa: E402
from swarm.ranges import even_split  # noqa: E402
from swarm.serve.app import serve_api  # noqa: E402
from swarm.serve.config import ServeConfig  # noqa: E402

PROMPTS = ["Write a haiku about the sea.", "Name three uses of copper.", "Why do cats purr?",
           "Describe a sunrise in one sentence.", "What is a prime number?", "Give me a tip for studying.",
           "Explain rain to a child.", "What does a bee do all day?"]


def stream_one(url: str, model: str, prompt: str, tokens: int) -> dict:
    """One streaming chat completion; returns ttft_s, inter-token gaps and the token count."""
    t0 = time.perf_counter()
    stamps = []
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    used = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as res:
        for line in res.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft_s": (stamps[0] - t0) if stamps else None, "gaps": gaps, "tokens": used}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def level(url: str, model: str, clients: int, per_client: int, tokens: int) -> dict:
    jobs = [PROMPTS[(c + r) % len(PROMPTS)] for c in range(clients) for r in range(per_client)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: stream_one(url, model, p, tokens), jobs))
    wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {"clients": clients, "requests": len(jobs), "completion_tokens": total, "wall_s": round(wall, 2),
            "aggregate_tokens_per_s": round(total / wall, 2), "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p95_s": pct(ttft, 0.95), "itl_p50_s": pct(gaps, 0.5), "itl_p95_s": pct(gaps, 0.95)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends in a level")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--setups", default="batched,nowait,unbatched", help="comma list of: batched, nowait, unbatched")
    args = ap.parse_args()

    resolved = resolve_model(args.model)
    ranges = even_split(model_num_layers(resolved.path), args.stages)
    setups = {"batched": [], "nowait": ["--batch-wait-ms", "0"],
              "unbatched": ["--max-batch-rows", "1", "--batch-tile", "1", "--batch-wait-ms", "0"]}
    report = {"model": resolved.name, "stages": args.stages, "tokens_per_request": args.tokens,
              "per_client": args.per_client, "target_16_clients": 4.0}
    for name in args.setups.split(","):
        report[name] = run_setup(args, ranges, setups[name])
    print(json.dumps(report))


def run_setup(args, ranges, flags: list[str]) -> dict:
    box: dict = {}
    with tempfile.TemporaryDirectory() as tmp, LocalRing(args.model, ranges, Path(tmp), threads=1,
                                                          extra_args=["--dtype", "float32", *flags]) as ring:
        spec = RingSpec(model=args.model, stages=ring.ring_spec().stages)

        def run():
            async def server():
                async with trio.open_nursery() as nursery:
                    box["token"], box["scope"] = trio.lowlevel.current_trio_token(), nursery.cancel_scope
                    config = ServeConfig.of(host="127.0.0.1", port=0, key_path=Path(tmp) / "c.key", max_concurrency=16)
                    box["info"] = await nursery.start(lambda task_status: serve_api(spec, config,
                                                                                    task_status=task_status))
            trio.run(server)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while "info" not in box:
            time.sleep(0.1)
        url, model = box["info"]["url"], box["info"]["model"]
        stream_one(url, model, "warm up", 4)
        levels = [level(url, model, int(n), args.per_client, args.tokens) for n in args.levels.split(",")]
        stages = httpx.get(url + "/health", timeout=30).json()["stages"]
        trio.from_thread.run_sync(box["scope"].cancel, trio_token=box["token"])
        thread.join(20)
    base = levels[0]["aggregate_tokens_per_s"]
    return {"flags": flags, "levels": levels,
            "scaling_vs_1_client": {str(x["clients"]): round(x["aggregate_tokens_per_s"] / base, 2) for x in levels},
            "stage_batching": [s.get("batching") for s in stages]}


if __name__ == "__main__":
    main()

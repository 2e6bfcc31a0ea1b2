"""Does a stage keep answering while torch computes? Latency of `info` requests during a long prefill.

Starts a real stage process holding the whole model (1 torch thread), sends one long prefill
(default 1024 tokens) from one stream, and meanwhile sends `info` every 50 ms on a second stream.
Prints one JSON object: prefill_s, and the median / max `info` round-trip in ms measured while the
prefill was computing (the forward runs in a worker thread; were it inline in the trio loop, the
max would be about prefill_s). Usage: python bench/responsiveness.py [--model smollm2-135m] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm import wire  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402
from swarm.wire import PROTOCOL_ID  # noqa: E402


async def probe(addr: str, tokens: int, key) -> dict:
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host:
        data = await host.open_stream(addr, PROTOCOL_ID, timeout_s=30)
        ctl = await host.open_stream(addr, PROTOCOL_ID, timeout_s=30)
        await data.send(wire.open_frame(host.key_pair, "bench", None, tokens))
        assert (await data.recv(timeout_s=30))["type"] == "open_ok"
        latencies: list[float] = []
        done = trio.Event()

        async def ping() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await ctl.send(wire.frame("info"))
                await ctl.recv(timeout_s=60)
                latencies.append((time.perf_counter() - t) * 1000)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            await data.send(wire.frame("forward", session="bench", epoch=0, pos=0, chunk=0,
                                       tokens=[(i * 7919) % 30000 + 100 for i in range(tokens)]))
            nursery.start_soon(ping)
            msg = await data.recv(timeout_s=600)
            prefill_s = time.perf_counter() - t0
            done.set()
        assert msg["type"] == "result", msg
    return {"prefill_tokens": tokens, "prefill_s": round(prefill_s, 3), "info_requests": len(latencies),
            "info_median_ms": round(statistics.median(latencies), 2), "info_max_ms": round(max(latencies), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    resolved = resolve_model(args.model)
    n = model_num_layers(resolved.path)
    with tempfile.TemporaryDirectory() as tmp, LocalRing(args.model, [LayerRange(0, n)], Path(tmp), threads=1,
                                                          extra_args=["--dtype", "float32"]) as ring:
        result = trio.run(probe, ring.stages[0].addr, args.tokens, load_or_create_key(Path(tmp) / "c.key"))
    print(json.dumps({"model": resolved.name, **result}))


if __name__ == "__main__":
    main()

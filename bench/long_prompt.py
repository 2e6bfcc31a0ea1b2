"""A short chat request beside a long prompt on `swarm serve`: how much slower the short one gets.

SmolLM2 on a 3-stage loopback ring (one torch thread per stage), `swarm serve` in this process.
First the short request alone ("Hi", 16 new tokens, greedy, streamed) a few times; then a long
prompt (default 4032 tokens, streamed, 16 new tokens) and, once its prefill is under way, the same
short request beside it, each request ``--pause-s`` after the one before (so each arrives cold: a
stage no longer expects its rows). Prints one JSON object: short_alone_s (median wall time from request to
the last event), short_beside_long_s, ratio, long_prompt_tokens, long_ttft_s, long_total_s, and the
stages' scheduler counters; then, in this process, one transformers forward over the long prompt's
chat-templated ids with 2 torch threads (the 3 stages' 1 thread each share this machine's cores), its
seconds beside the ring's time to first token, and the CPU's name.
Usage: python bench/long_prompt.py [--long-tokens 4032] [--rounds 3] [--pause-s 1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefill import cpu_name, reference_ttft  # noqa: E402
from swarm.config import RingSpec  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from swarm.serve.app import serve_api  # noqa: E402
from swarm.serve.config import ServeConfig  # noqa: E402

PARAGRAPH = ("The river ran past the old mill, where the miller's daughter kept a ledger of every sack of grain "
             "and every traveller who crossed the bridge. ")


async def stream_chat(client: httpx.AsyncClient, url: str, content: str, max_tokens: int) -> dict:
    """One streamed chat request; returns wall time to the first content event and to [DONE]."""
    t0 = time.perf_counter()
    first = None
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as res:
        res.raise_for_status()
        async for line in res.aiter_lines():
            if line.startswith("data: {") and first is None:
                delta = json.loads(line[6:])["choices"][0].get("delta", {}) if '"choices"' in line else {}
                if delta.get("content"):
                    first = time.perf_counter() - t0
            if line == "data: [DONE]":
                break
    return {"ttft_s": first, "total_s": time.perf_counter() - t0}


def long_text(tokenizer, tokens: int) -> str:
    text = PARAGRAPH * (tokens // 20 + 10)
    ids = tokenizer(text)["input_ids"][: max(1, tokens - 40)]  # the chat template adds about 40 tokens
    return tokenizer.decode(ids)


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from swarm.model.resolve import resolve_model

    resolved = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    long_content = long_text(tokenizer, args.long_tokens)
    ranges = [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]
    with tempfile.TemporaryDirectory() as tmp, \
            LocalRing("smollm2-135m", ranges, Path(tmp) / "keys", threads=1,
                      extra_args=["--dtype", "float32", *args.stage_args]) as ring:
        spec = RingSpec(model="smollm2-135m", stages=ring.ring_spec().stages)
        async with trio.open_nursery() as nursery:
            config = ServeConfig.of(host="127.0.0.1", port=0, key_path=Path(tmp) / "coord.key")
            info = await nursery.start(lambda task_status: serve_api(spec, config, task_status=task_status))
            url = info["url"]
            async with httpx.AsyncClient() as client:
                await stream_chat(client, url, "Hi", args.short_tokens)  # warm-up (and the batch tile proof)
                alone = []
                for _ in range(args.rounds):
                    await trio.sleep(args.pause_s)
                    alone.append((await stream_chat(client, url, "Hi", args.short_tokens))["total_s"])
                beside, long_result = [], {}

                async def long_request():
                    long_result.update(await stream_chat(client, url, long_content, args.short_tokens))

                async with trio.open_nursery() as inner:
                    t_long = time.perf_counter()
                    inner.start_soon(long_request)
                    await trio.sleep(args.start_after_s)  # the long prefill is under way
                    for i in range(args.rounds):
                        if i:
                            await trio.sleep(args.pause_s)
                        if long_result:
                            break  # the long prompt finished: nothing to stand beside any more
                        beside.append((await stream_chat(client, url, "Hi", args.short_tokens))["total_s"])
                long_total = time.perf_counter() - t_long
                health = (await client.get(url + "/health", timeout=60)).json()
            nursery.cancel_scope.cancel()
    a, b = statistics.median(alone), statistics.median(beside) if beside else None
    reference_s, reference_tokens = await trio.to_thread.run_sync(reference_long, resolved.path, tokenizer, long_content)
    return {
        "model": "smollm2-135m", "stages": 3, "threads_per_stage": 1, "stage_args": args.stage_args,
        "pause_s": args.pause_s,
        "short_new_tokens": args.short_tokens, "long_prompt_tokens": args.long_tokens,
        "short_alone_s": round(a, 3), "short_beside_long_s": round(b, 3) if b else None,
        "ratio": round(b / a, 2) if b else None, "target_ratio": 2.0,
        "alone_runs": [round(x, 3) for x in alone], "beside_runs": [round(x, 3) for x in beside],
        "long_ttft_s": round(long_result.get("ttft_s") or 0, 2), "long_total_s": round(long_total, 2),
        "long_chat_tokens": reference_tokens, "transformers_2_thread_long_s": round(reference_s, 2),
        "long_ttft_vs_transformers": round(reference_s / (long_result.get("ttft_s") or float("inf")), 3),
        "cpu": cpu_name(),
        "stage_batching": [s.get("batching") for s in health["stages"]],
    }


def reference_long(model_dir: Path, tokenizer, content: str) -> tuple[float, int]:
    """One transformers forward over the long request's chat-templated ids, 2 threads: (seconds, tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seconds, _ = reference_ttft(model, ids, threads=2)
    return seconds, len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-tokens", type=int, default=4032)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--start-after-s", type=float, default=2.0)
    ap.add_argument("--pause-s", type=float, default=1.0,
                    help="seconds between one short request and the next (default 1.0, past a stage's wait for "
                         "a decoder's next row: each request arrives cold)")
    ap.add_argument("--stage-arg", dest="stage_args", action="append", default=[],
                    help="extra `swarm stage` flag (repeat), e.g. --stage-arg=--prefill-slice-shared --stage-arg=8")
    print(json.dumps(trio.run(run, ap.parse_args())))


if __name__ == "__main__":
    main()

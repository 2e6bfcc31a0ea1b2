"""Decode tokens/s of a 3-stage loopback ring vs the same model in one process, side by side.

Both sides use one torch thread per process (in greedy decode the stages compute one at a time).
Rounds alternate single / ring so machine noise hits both alike; medians are reported.

Prints one JSON object: ring_tokens_per_s, single_tokens_per_s, ratio, per_hop_overhead_ms (the
ring's extra time per token spread over its hops: coordinator -> stage 0 -> ... -> tail -> coordinator),
wire_bytes_per_token (frame bytes on every hop for one decode step, before Noise/Yamux framing),
and the settings. ``--compare-thread`` runs a second ring whose stages compute every step in the
worker thread (``--inline-step-ms 0``) in the same rounds. ``--floor`` adds, in the same rounds, the
ring's layer blocks in this process (``blocks_tokens_per_s``: swarm's arithmetic against
transformers) and in one process each chained by plain pipes (``pipe_ring_tokens_per_s``: what
process boundaries alone cost here), and a ``decomposition`` of the ratio into those two and the
rest (transport, framing, the stages' scheduling; ``bench/floor.py``). ``--compare-metrics`` adds a
ring whose stages export Prometheus metrics, scraped every second (issue 18: within 2%). Usage:
python bench/ring_overhead.py [--model smollm2-135m] [--tokens 64] [--rounds 3] [--compare-thread]
[--floor] [--compare-metrics]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm import wire  # noqa: E402
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.errors import collapse  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import model_manifest_digest, resolve_model  # noqa: E402
from swarm.ranges import even_split  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402
from swarm.transport.framing import encode_frame  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def single_decode(model, prompt_ids: list[int], tokens: int) -> float:
    """Greedy decode tokens/s of transformers in this process (DynamicCache, one token per forward)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([prompt_ids]), cache=cache, use_cache=True).logits
        nxt = int(logits[0, -1].argmax())
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            logits = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits
            nxt = int(logits[0, -1].argmax())
        return (tokens - 1) / (time.perf_counter() - t0)


async def ring_decode(spec, model_dir, prompt_ids, tokens, key) -> tuple[float, list[int]]:
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, spec, 120.0, 30.0)
        await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
        decoded = await decode(ring, prompt_ids, DecodeOptions(tokens))
        out, timing = decoded.output_ids, decoded.as_record()
        nursery.cancel_scope.cancel()
    return timing["tokens_per_s"], out


def _scrape_every_second(urls: list[str], stop) -> None:
    """What a Prometheus server does (at a high rate): GET every stage's /metrics once a second."""
    import urllib.request

    while not stop.wait(1.0):
        for url in urls:
            try:
                urllib.request.urlopen(url, timeout=5).read()
            except OSError:
                pass


def wire_bytes_per_token(hidden_size: int, num_stages: int, dtype: torch.dtype) -> dict:
    meta = dict(session="0" * 32, epoch=0, pos=1000, chunk=1000)
    head = len(encode_frame(wire.frame("forward", tokens=[12345], **meta)))
    hidden = len(encode_frame(wire.frame("forward", hidden=wire.encode_tensor(torch.zeros(1, 1, hidden_size, dtype=dtype)), **meta)))
    result = len(encode_frame(wire.frame("result", token_ids=[12345], **meta)))
    return {"coordinator_to_head": head, "stage_to_stage": hidden, "tail_to_coordinator": result,
            "total": head + hidden * (num_stages - 1) + result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare-thread", action="store_true",
                    help="also run a second ring whose stages compute every step in the worker thread "
                         "(--inline-step-ms 0), alternating with the first: ring_thread_tokens_per_s")
    ap.add_argument("--compare-metrics", action="store_true",
                    help="also run a ring whose stages export Prometheus metrics (--metrics-listen), scraped every "
                         "second, in the same rounds: ring_metrics_tokens_per_s, ratio_metrics_vs_ring")
    ap.add_argument("--floor", action="store_true",
                    help="also time the ring's blocks in this process and in a ring of plain pipes (bench/floor.py)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    resolved = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(resolved.path))
    prompt_ids = list(tok(PROMPT)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=torch.float32).eval()
    num_layers = model_num_layers(resolved.path)
    single, ring_rates, thread_rates, outputs = [], [], [], []
    block_rates, pipe_rates = [], []
    ranges = even_split(num_layers, args.stages)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        blocks, pipe_ring = [], None
        if args.floor:
            from floor import PipeRing, blocks_in_process
            from swarm.model.block import load_block

            blocks = [load_block(resolved.path, r, dtype="float32", device="cpu") for r in ranges]
            pipe_ring = stack.enter_context(PipeRing(resolved.path, [(r.start, r.end) for r in ranges]))
        rings = [stack.enter_context(LocalRing(args.model, ranges, tmp / "a", threads=1,
                                               extra_args=["--dtype", "float32"]))]
        if args.compare_thread:
            rings.append(stack.enter_context(LocalRing(args.model, ranges, tmp / "b", threads=1,
                                                       extra_args=["--dtype", "float32", "--inline-step-ms", "0"])))
        metric_rates: list[float] = []
        if args.compare_metrics:
            metered = stack.enter_context(LocalRing(args.model, ranges, tmp / "m", threads=1, extra_args=[
                "--dtype", "float32", "--metrics-listen", "127.0.0.1:0"]))
            stop = threading.Event()
            scraper = threading.Thread(target=_scrape_every_second, daemon=True,
                                       args=([sp.ready["metrics_url"] for sp in metered.stages], stop))
            scraper.start()
            stack.callback(stop.set)
        key = load_or_create_key(tmp / "coord.key")
        for _ in range(args.rounds):
            single.append(single_decode(model, prompt_ids, args.tokens))
            if args.floor:
                for fn, rates in ((lambda: blocks_in_process(blocks, prompt_ids, args.tokens), block_rates),
                                  (lambda: pipe_ring.decode(prompt_ids, args.tokens), pipe_rates)):
                    rate, out = fn()
                    rates.append(rate)
                    outputs.append(out)
            pairs = list(zip(rings, (ring_rates, thread_rates)))
            if args.compare_metrics:
                pairs.append((metered, metric_rates))
            for ring, rates in pairs:
                try:
                    rate, out = trio.run(ring_decode, ring.ring_spec(), resolved.path, prompt_ids, args.tokens, key)
                except BaseExceptionGroup as group:
                    raise collapse(group) from None
                rates.append(rate)
                outputs.append(out)
    s, r = statistics.median(single), statistics.median(ring_rates)
    hops = args.stages + 1
    extra = {}
    if thread_rates:
        t = statistics.median(thread_rates)
        extra = {"ring_thread_tokens_per_s": round(t, 2), "ratio_thread": round(t / s, 3),
                 "per_hop_overhead_thread_ms": round((1 / t - 1 / s) * 1000 / hops, 3),
                 "ring_thread_runs": [round(x, 2) for x in thread_rates]}
    if metric_rates:
        mr = statistics.median(metric_rates)
        extra.update({"ring_metrics_tokens_per_s": round(mr, 2), "ratio_metrics_vs_ring": round(mr / r, 3),
                      "ring_metrics_runs": [round(x, 2) for x in metric_rates]})
    if block_rates:
        b, p = statistics.median(block_rates), statistics.median(pipe_rates)
        extra.update({
            "blocks_tokens_per_s": round(b, 2), "pipe_ring_tokens_per_s": round(p, 2),
            "ratio_pipe_ring": round(p / s, 3),
            "decomposition": {"arithmetic": round(b / s, 3), "process_boundaries": round(p / b, 3),
                              "transport_and_scheduling": round(r / p, 3)},
            "blocks_runs": [round(x, 2) for x in block_rates], "pipe_ring_runs": [round(x, 2) for x in pipe_rates]})
    print(json.dumps({
        "model": resolved.name, "stages": args.stages, "tokens": args.tokens, "rounds": args.rounds,
        "threads_per_process": 1,
        "ring_tokens_per_s": round(r, 2), "single_tokens_per_s": round(s, 2), "ratio": round(r / s, 3),
        "per_hop_overhead_ms": round((1 / r - 1 / s) * 1000 / hops, 3),
        "wire_bytes_per_token": wire_bytes_per_token(model.config.hidden_size, args.stages, torch.float32),
        "ring_runs": [round(x, 2) for x in ring_rates], "single_runs": [round(x, 2) for x in single],
        "identical_outputs": all(o == outputs[0] for o in outputs), **extra,
    }))


if __name__ == "__main__":
    main()

"""The cost of receipts: decode tokens/s with and without digests on one real 3-stage ring.

The same loopback ring (``swarm stage`` processes, one torch thread each) serves both kinds of
run, interleaved A B B A per round so machine noise hits both alike; medians are reported. "On"
opens the session with a job (every stage digests every frame it receives and sends, and signs a
receipt at the end); "off" opens it without one. Separately, end-of-job costs (collecting the
signed stage receipts; building, signing, writing and verifying the job receipt) and a noise-free
microbenchmark of the digest work per token (all hops) are reported.

Prints one JSON object: tokens_per_s_on/off, overhead_pct (target < 2), end_of_job_ms,
digest_us_per_token, and the runs. Usage: python bench/receipts.py [--tokens 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm import receipts, wire  # noqa: E402
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.jobs import write_job_receipt
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.errors import collapse  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import model_manifest_digest, resolve_model  # noqa: E402
from swarm.ranges import even_split  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def run(spec, model_dir, prompt_ids, tokens, key, with_receipt: bool, receipt_dir: Path) -> tuple[float, float]:
    """One generation; returns (decode tokens/s, end-of-job receipt ms or 0)."""
    digest = model_manifest_digest(model_dir)
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, spec, 120.0, 30.0)
        num_layers = model_num_layers(model_dir)
        await ring.connect(num_layers, digest, nursery)
        job = {"id": receipts.new_nonce(), "nonce": receipts.new_nonce()} if with_receipt else None
        decoded = await decode(ring, prompt_ids, DecodeOptions(tokens, job=job))
        out, rec = decoded.output_ids, decoded.as_record()
        end_ms = 0.0
        if job:
            ring_entries = [i.entry() for i in ring.infos]
            parts = rec.pop("receipt_parts")
            t1 = time.perf_counter()
            res = write_job_receipt(receipt_dir, key, job, parts, model="bench",
                                    model_digest=digest, num_layers=num_layers, prompt_ids=prompt_ids,
                                    output_ids=out, ring=ring_entries, record=rec)
            assert res["verified"], res
            end_ms = (parts["collect_s"] + time.perf_counter() - t1) * 1000
        nursery.cancel_scope.cancel()
    return rec["tokens_per_s"], end_ms


def digest_us_per_token(hidden_size: int, stages: int, reps: int = 2000) -> float:
    """Microseconds of digest work for one decode token summed over every party: the coordinator
    (sent + received), each stage (input + output)."""
    meta = dict(session="0" * 32, epoch=0, chunk=1000)
    hidden = wire.frame("forward", hidden=wire.encode_tensor(torch.randn(1, 1, hidden_size)), pos=1000, **meta)
    tokens = wire.frame("forward", tokens=[12345], pos=1000, **meta)
    result = wire.frame("result", token_ids=[12345], pos=1000, **meta)
    d = receipts.RollingDigest()
    t0 = time.perf_counter()
    for _ in range(reps):
        for _ in range(2):  # coordinator sends, head receives
            d.add(receipts.forward_item(tokens))
        for _ in range(2 * (stages - 1)):  # each inner hop: sender and receiver
            d.add(receipts.forward_item(hidden))
        for _ in range(2):  # tail sends, coordinator receives
            d.add(receipts.result_item(result))
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    resolved = resolve_model(args.model)
    prompt_ids = list(AutoTokenizer.from_pretrained(str(resolved.path))(PROMPT)["input_ids"])
    hidden = AutoConfig.from_pretrained(str(resolved.path)).hidden_size
    on, off, end = [], [], []
    with tempfile.TemporaryDirectory() as tmp, LocalRing(args.model, even_split(model_num_layers(resolved.path),
                                                                                args.stages),
                                                          Path(tmp), threads=1, extra_args=["--dtype", "float32"]) as ring:
        spec = ring.ring_spec()
        key = load_or_create_key(Path(tmp) / "coord.key")
        for _ in range(args.rounds):
            for with_receipt in (True, False, False, True):
                try:
                    rate, end_ms = trio.run(run, spec, resolved.path, prompt_ids, args.tokens, key, with_receipt,
                                            Path(tmp) / "receipts")
                except BaseExceptionGroup as group:
                    raise collapse(group) from None
                (on if with_receipt else off).append(rate)
                if with_receipt:
                    end.append(end_ms)
    a, b = statistics.median(on), statistics.median(off)
    per_token_us = digest_us_per_token(hidden, args.stages)
    print(json.dumps({
        "model": resolved.name, "stages": args.stages, "tokens": args.tokens, "rounds": args.rounds,
        "tokens_per_s_on": round(a, 2), "tokens_per_s_off": round(b, 2),
        "overhead_pct": round((1 - a / b) * 100, 2), "target_pct": 2.0,
        "digest_us_per_token": round(per_token_us, 1),
        "digest_share_of_token_pct": round(per_token_us / (1e6 / b) * 100, 3),
        "end_of_job_ms": round(statistics.median(end), 1),
        "on_runs": [round(x, 2) for x in on], "off_runs": [round(x, 2) for x in off],
    }))


if __name__ == "__main__":
    main()

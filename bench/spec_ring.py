"""Speculative decoding around a 3-stage SmolLM2 ring with emulated WAN hops.

Real ``swarm stage`` processes (1 torch thread each) on loopback; every hop (coordinator -> stage 0,
stage i -> stage i+1, tail -> coordinator) goes through a delaying TCP relay adding ``hop_ms``
one way (``swarm.transport.relay``). For each cell of the grid it generates ``--tokens`` new tokens
for every prompt of a set and prints one JSON line:

  hop_ms, depth, k, draft, prompt_set (draftable | novel), tokens_per_s (decode, summed tokens /
  summed decode time over the set), tokens_per_round_trip (decode tokens committed per chunk
  result), accept_rate, mean_accepted (accepted drafts per round), speedup_vs_greedy (same hop_ms
  and prompt set), identical_to_greedy (the ids equal the plain greedy run's).

Usage: python bench/spec_ring.py [--hops 0,10,30] [--depths 1,2,4] [--ks 2,4,8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.config import RingSpec, SpecConfig, StageSpec  # noqa: E402
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.generation import encode_prompt, eos_ids
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.coordinator.drafters import make_drafter  # noqa: E402
from swarm.errors import collapse  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import model_manifest_digest, resolve_model  # noqa: E402
from swarm.ranges import even_split  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402
from swarm.transport.relay import open_relay, relay_addr, target_of  # noqa: E402

PASSAGE = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind. "
           "Every evening the keeper climbed the narrow spiral stairs, lit the great lamp, and watched the "
           "ships pass safely through the dark and dangerous strait below.")
PROMPTS = {
    "draftable": [f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
                  f"Copy this text without changing anything:\n\n{PASSAGE}"],
    "novel": ["Write a short poem about autumn leaves.", "Give three tips for staying focused while studying."],
}


async def run_set(host, spec: RingSpec, model_dir, prompts, tokens, stop, config: SpecConfig):
    ids_all, tok, secs, rounds, committed, drafted, accepted = [], 0, 0.0, 0, 0, 0, 0
    for prompt_ids in prompts:
        async with trio.open_nursery() as nursery:
            ring = RingClient(host, spec, 300.0, 60.0)
            await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
            drafter = make_drafter(config.draft)
            decoded = await decode(ring, prompt_ids, DecodeOptions(tokens, stop_ids=stop, spec=config, drafter=drafter))
            out, rec = decoded.output_ids, decoded.as_record()
            nursery.cancel_scope.cancel()
        ids_all.append(out)
        s = rec["spec"]
        tok += len(out) - 1
        secs += rec["total_s"] - rec["ttft_s"]
        rounds, committed = rounds + s["rounds"], committed + s["decode_committed"]
        drafted, accepted = drafted + s["drafted"], accepted + s["accepted"]
    return ids_all, {
        "tokens_per_s": round(tok / secs, 2) if secs else None,
        "tokens_per_round_trip": round(committed / rounds, 3) if rounds else None,
        "accept_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mean_accepted": round(accepted / rounds, 3) if rounds else 0.0,
    }


async def bench(stage_specs, model_dir, prompt_sets, stop, args, key) -> None:
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host:
        for hop_ms in args.hops:
            async with AsyncExitStack() as stack:
                stages = []
                for s in stage_specs:
                    relay = await stack.enter_async_context(open_relay(*target_of(s.addr), delay_ms=hop_ms))
                    stages.append(StageSpec(relay_addr(s.addr, relay.port), s.layers))
                spec = RingSpec(model=str(model_dir), stages=tuple(stages))
                for set_name, prompts in prompt_sets.items():
                    base_ids, base = await run_set(host, spec, model_dir, prompts, args.tokens, stop, SpecConfig())
                    emit(hop_ms, 1, 0, "none", set_name, base, base, True)
                    for depth in args.depths:
                        for k in args.ks:
                            config = SpecConfig(draft="ngram", k=k, depth=depth, prefill_chunk=512)
                            ids, rec = await run_set(host, spec, model_dir, prompts, args.tokens, stop, config)
                            emit(hop_ms, depth, k, "ngram", set_name, rec, base, ids == base_ids)


def emit(hop_ms, depth, k, draft, prompt_set, rec, base, identical) -> None:
    speedup = rec["tokens_per_s"] / base["tokens_per_s"] if rec["tokens_per_s"] and base["tokens_per_s"] else None
    print(json.dumps({"hop_ms": hop_ms, "depth": depth, "k": k, "draft": draft, "prompt_set": prompt_set, **rec,
                      "speedup_vs_greedy": round(speedup, 3) if speedup else None,
                      "identical_to_greedy": identical}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--hops", default="0,10,30", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--depths", default="1,2,4", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--ks", default="2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--sets", default="draftable,novel")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    resolved = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(resolved.path))
    prompt_sets = {name: [encode_prompt(tok, p, chat=True) for p in PROMPTS[name]] for name in args.sets.split(",")}
    stop = eos_ids(resolved.path, tok)
    n = model_num_layers(resolved.path)
    with tempfile.TemporaryDirectory() as tmp, LocalRing(args.model, even_split(n, 3), Path(tmp), threads=1,
                                                          extra_args=["--dtype", "float32"]) as ring:
        try:
            trio.run(bench, ring.ring_spec().stages, resolved.path, prompt_sets, stop, args,
                     load_or_create_key(Path(tmp) / "c.key"))
        except BaseExceptionGroup as group:
            raise collapse(group) from None


if __name__ == "__main__":
    main()

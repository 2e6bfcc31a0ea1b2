"""Prefix KV reuse at the stages (issue 17): a long chat's fifth turn, and clients sharing a system prompt.

Time to first token of the fifth turn, and the throughput of clients that share a system prompt,
with and without reuse, on one loopback ring.

One 3-stage ring of real ``swarm stage`` processes (SmolLM2-135M by default, float32, one torch thread
each); one coordinator identity, so the stages' caches serve it. Prints one JSON object:

- ``ttft_fresh_s`` / ``ttft_reused_s``: turn 5 of a chat whose history (a long document in the first
  user message, then four answered turns) is about ``--history-tokens`` tokens: the same request
  without the prefix cache (the whole prompt prefilled) and after turns 1-4 ran with it (only what
  follows the cached blocks prefilled). ``ttft_speedup`` = fresh / reused. The two answers must be
  the same ids (``identical_outputs``).
- ``shared_prompt_speedup``: aggregate new tokens/s of ``--clients`` concurrent requests (packed
  sessions, as ``swarm serve`` opens them) that share a system prompt of about
  ``--system-tokens`` tokens, with reuse over without; a single request with the system prompt ran
  first (a server that has been up a while has it cached).

Targets (the issue): ttft_speedup >= 5, shared_prompt_speedup >= 1.5. Usage:
python bench/prefix_cache.py [--model smollm2-135m] [--history-tokens 2000] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.coordinator.chat import encode_chat  # noqa: E402
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.generation import eos_ids
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.errors import collapse  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import model_manifest_digest, resolve_model  # noqa: E402
from swarm.ranges import even_split  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402

SENTENCES = [
    "The lighthouse stood on a rock at the mouth of the bay, and its keeper climbed the stairs every evening.",
    "Ships passed in the night, and the keeper wrote their names in a book that nobody else ever read.",
    "In winter the storms came from the north, and the waves broke over the lamp room windows.",
    "The village below had a bakery, a church with a crooked tower, and a harbour full of small boats.",
    "Every spring the keeper painted the door blue, because his mother had always said blue keeps luck in.",
]
QUESTIONS = ["Who lives in the lighthouse?", "What does the keeper write down?", "When do the storms come?",
             "What colour is the door?", "Summarize the story in one sentence."]


def text_of(tokenizer, tokens: int, salt: int = 0) -> str:
    """Prose of about ``tokens`` tokens (sentences repeated, numbered so no two are alike)."""
    out, i = [], salt
    while len(tokenizer(" ".join(out))["input_ids"]) < tokens:
        out.append(f"({i}) {SENTENCES[i % len(SENTENCES)]}")
        i += 1
    return " ".join(out)


async def bench(args, spec, model_dir, tokenizer, key) -> dict:
    stop = eos_ids(model_dir, tokenizer)
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, spec, 600.0, 30.0)
        await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
        # ---- a long chat: turns 1-4 with reuse build the history; turn 5 fresh vs reused
        doc = text_of(tokenizer, args.history_tokens - 4 * (args.new_tokens + 40))
        messages = [{"role": "user", "content": f"Read this story.\n\n{doc}\n\n{QUESTIONS[0]}"}]
        turns = []
        for t in range(5):
            if t:
                messages.append({"role": "user", "content": QUESTIONS[t]})
            prompt = encode_chat(tokenizer, messages)
            if t == 4:  # the same request without the prefix cache first (no blocks kept: the cache is as before)
                decoded = await decode(ring, prompt, DecodeOptions(args.new_tokens, stop_ids=stop, prefix_cache=False))
                fresh_out, fresh = decoded.output_ids, decoded.as_record()
            decoded = await decode(ring, prompt, DecodeOptions(args.new_tokens, stop_ids=stop, prefix_cache=True))
            out, rec = decoded.output_ids, decoded.as_record()
            turns.append({"prompt_tokens": len(prompt), "cached_tokens": rec["cached_tokens"],
                          "ttft_s": round(rec["ttft_s"], 3)})
            messages.append({"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)})
        # ---- clients sharing a system prompt
        system = text_of(tokenizer, args.system_tokens, salt=1000)
        prompts = [encode_chat(tokenizer, [{"role": "system", "content": system},
                                           {"role": "user", "content": f"Question {i}: {QUESTIONS[i % 5]}"}])
                   for i in range(args.clients + 1)]
        clients = []
        for _ in range(args.clients):
            c = RingClient(host, spec, 600.0, 30.0, batch=True)
            await c.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
            clients.append(c)
        # the server has seen the system prompt
        await decode(clients[0], prompts[-1], DecodeOptions(4, stop_ids=stop, prefix_cache=True))
        shared = {}
        for mode in (False, True):
            counts, t0 = [], time.perf_counter()

            async def one(c, p):
                decoded = await decode(c, p, DecodeOptions(args.new_tokens, stop_ids=stop, prefix_cache=mode))
                out, rec = decoded.output_ids, decoded.as_record()
                counts.append((len(out), rec["cached_tokens"]))

            async with trio.open_nursery() as inner:
                for c, p in zip(clients, prompts):
                    inner.start_soon(one, c, p)
            wall = time.perf_counter() - t0
            shared["with" if mode else "without"] = {
                "tokens_per_s": round(sum(n for n, _ in counts) / wall, 3), "wall_s": round(wall, 2),
                "cached_tokens": [c for _, c in counts]}
        for c in [ring, *clients]:
            await c.aclose()
        nursery.cancel_scope.cancel()
    info = {"turns": turns, "fresh_ttft_s": fresh["ttft_s"], "identical_outputs": fresh_out == out, "shared": shared}
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--history-tokens", type=int, default=2000, help="tokens of chat history before turn 5")
    ap.add_argument("--system-tokens", type=int, default=500, help="tokens of the shared system prompt")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16, help="new tokens per request")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    resolved = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    if not getattr(tokenizer, "chat_template", None):
        sys.exit(f"bench/prefix_cache.py: {resolved.name} has no chat template; this benchmark replays chats "
                 "(use an instruct model, e.g. the default smollm2-135m)")
    ranges = even_split(model_num_layers(resolved.path), 3)
    with tempfile.TemporaryDirectory() as tmp:
        with LocalRing(args.model, ranges, Path(tmp), threads=1, extra_args=["--dtype", "float32"]) as ring:
            try:
                info = trio.run(bench, args, ring.ring_spec(), resolved.path, tokenizer,
                                load_or_create_key(Path(tmp) / "coord.key"))
            except BaseExceptionGroup as group:
                raise collapse(group) from None
    sh = info.pop("shared")
    reused = info["turns"][-1]["ttft_s"]
    result = {
        "model": resolved.name, "stages": 3, "threads_per_stage": 1,
        "history_tokens": info["turns"][-1]["prompt_tokens"],
        "ttft_fresh_s": round(info["fresh_ttft_s"], 3), "ttft_reused_s": reused,
        "ttft_speedup": round(info["fresh_ttft_s"] / reused, 2) if reused else None,
        "shared_prompt_speedup": round(sh["with"]["tokens_per_s"] / sh["without"]["tokens_per_s"], 2),
        "targets": {"ttft_speedup": 5.0, "shared_prompt_speedup": 1.5},
        "identical_outputs": info["identical_outputs"], "turns": info["turns"], "shared": sh,
        "clients": args.clients, "system_tokens": args.system_tokens, "new_tokens": args.new_tokens,
    }
    text = json.dumps(result)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

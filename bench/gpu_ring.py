"""A stage ring on a GPU vs transformers in one process, and speculative == greedy, in one run.

Builds a seeded random Llama on the spot (default ~1B parameters: hidden 2048, 22 layers, vocab
512, bf16; no download, so it runs on a bare GPU machine), then measures side by side:

- single_tokens_per_s: transformers' own greedy decode loop in this process (DynamicCache);
- ring1_tokens_per_s, ring3_tokens_per_s: ``swarm stage`` processes on loopback (1 and 3 stages),
  greedy, driven by the real coordinator; ratio1 / ratio3 against single;
- stage_step_ms: one decode step of the middle third of the layers as a stage computes it
  (``LayerBlock.forward_batch``), and hf_layers_step_ms: the same layers inside transformers' decode
  step (timed between hooks on the first and the last of them);
- spec_exact: speculative (n-gram drafts) == greedy, bit for bit in ids, over the prompts x K in
  {2, 4, 8} x depth in {1, 2} on the 3-stage ring; spec_tokens_per_s: the best of those runs;
- hf_agreement: per prompt, the first new-token position where the ring's greedy ids differ from
  transformers' (null: none differ), as the issue asks rather than a claim of bit-identity.

Prints one JSON object (and writes it to --out if given). Rounds alternate so noise hits all sides.
Usage: python bench/gpu_ring.py [--device auto] [--layers 22] [--hidden 2048] [--tokens 96] [--prompts 20]
A CPU smoke run: python bench/gpu_ring.py --device cpu --dtype float32 --hidden 64 --layers 4 --tokens 8 --prompts 2
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

from swarm.config import SpecConfig  # noqa: E402
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.coordinator.drafters import NgramDrafter  # noqa: E402
from swarm.errors import collapse  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import load_block, pick_device, pick_dtype  # noqa: E402
from swarm.model.resolve import model_manifest_digest  # noqa: E402
from swarm.ranges import LayerRange, even_split  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402


def build_model(out: Path, args, device: torch.device, dtype: torch.dtype) -> Path:
    """Write a seeded random Llama of the requested size to ``out`` (safetensors, HF layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
                         vocab_size=args.vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(out)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def single_decode(model, prompt: list[int], tokens: int, device) -> tuple[float, list[int]]:
    """Greedy tokens/s (decode steps only) and ids of transformers in this process."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([prompt], device=device), cache=cache, use_cache=True).logits
        ids = [int(logits[0, -1].argmax())]
        sync(device)
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            logits = model(torch.tensor([[ids[-1]]], device=device), cache=cache, use_cache=True).logits
            ids.append(int(logits[0, -1].argmax()))
        sync(device)
        return (tokens - 1) / (time.perf_counter() - t0), ids


def hf_layers_step_ms(model, prompt: list[int], layers: LayerRange, steps: int, device) -> float:
    """Median wall time of layers [start, end) inside transformers' decode step (hooks on both ends)."""
    from transformers import DynamicCache

    marks: list[float] = []
    first, last = model.model.layers[layers.start], model.model.layers[layers.end - 1]

    def stamp(*_):
        sync(device)
        marks.append(time.perf_counter())

    hooks = [first.register_forward_pre_hook(stamp), last.register_forward_hook(stamp)]
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            logits = model(torch.tensor([prompt], device=device), cache=cache, use_cache=True).logits
            nxt = int(logits[0, -1].argmax())
            marks.clear()
            for _ in range(steps):
                logits = model(torch.tensor([[nxt]], device=device), cache=cache, use_cache=True).logits
                nxt = int(logits[0, -1].argmax())
    finally:
        for h in hooks:
            h.remove()
    return statistics.median((b - a) * 1000 for a, b in zip(marks[0::2], marks[1::2]))


def stage_step_ms(model_dir: Path, prompt: list[int], layers: LayerRange, steps: int, dtype: str, device: str) -> float:
    """Median wall time of one decode step of a stage holding ``layers`` (as the daemon computes it)."""
    block = load_block(model_dir, layers, dtype=dtype, device=device)
    cache = block.new_cache(len(prompt) + steps + 1)
    gen = torch.Generator().manual_seed(0)

    def rows(t):
        if block.is_head:
            return torch.randint(0, block.vocab_size, (1, t), generator=gen)
        return torch.randn(1, t, block.hidden_size, generator=gen).to(block.dtype)

    block.forward_batch([(cache, 0, rows(len(prompt)))])
    times = []
    for i in range(steps):
        x = rows(1)
        sync(block.device)
        t0 = time.perf_counter()
        block.forward_batch([(cache, len(prompt) + i, x)])
        sync(block.device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def ring_run(spec, model_dir: Path, num_layers: int, prompt: list[int], tokens: int, key,
                   k: int = 0, depth: int = 1) -> tuple[float, list[int]]:
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, spec, 120.0, 30.0)
        await ring.connect(num_layers, model_manifest_digest(model_dir), nursery)
        drafter = NgramDrafter() if k else None
        decoded = await decode(ring, prompt, DecodeOptions(tokens, spec=SpecConfig(draft="ngram" if k else "none", k=k,
                                                                                   depth=depth), drafter=drafter))
        out, record = decoded.output_ids, decoded.as_record()
        nursery.cancel_scope.cancel()
    return record["tokens_per_s"] or 0.0, out


def run(coro_fn, *args, **kwargs):
    try:
        return trio.run(lambda: coro_fn(*args, **kwargs))
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per timed generation")
    ap.add_argument("--prompts", type=int, default=20, help="prompts for the speculative == greedy sweep")
    ap.add_argument("--spec-tokens", type=int, default=48, help="new tokens per run of the sweep")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, args.vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 48, (args.prompts,), generator=gen)]
    timed_prompt = prompts[0]
    stage_flags = ["--device", device.type, "--dtype", dtype_name]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model", args, device, dtype)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        params = sum(p.numel() for p in model.parameters())
        key = load_or_create_key(tmp / "coord.key")
        third = even_split(args.layers, 3)[1]
        result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({device})",
                  "model": f"seeded random Llama, {params / 1e9:.2f} B params, hidden {args.hidden}, "
                           f"{args.layers} layers, vocab {args.vocab}, {dtype_name}",
                  "tokens": args.tokens, "torch": torch.__version__}
        single, ring1, ring3 = [], [], []
        hf_ids = {}
        with LocalRing(str(model_dir), even_split(args.layers, 1), tmp / "k1", extra_args=stage_flags) as r1, \
                LocalRing(str(model_dir), even_split(args.layers, 3), tmp / "k3", extra_args=stage_flags) as r3:
            spec1, spec3 = r1.ring_spec(), r3.ring_spec()
            for _ in range(args.rounds):
                rate, hf_ids[0] = single_decode(model, timed_prompt, args.tokens, device)
                single.append(rate)
                ring1.append(run(ring_run, spec1, model_dir, args.layers, timed_prompt, args.tokens, key)[0])
                ring3.append(run(ring_run, spec3, model_dir, args.layers, timed_prompt, args.tokens, key)[0])
            result["stage_step_ms"] = round(stage_step_ms(model_dir, timed_prompt, third, 32, dtype_name, device.type), 3)
            result["hf_layers_step_ms"] = round(hf_layers_step_ms(model, timed_prompt, third, 32, device), 3)
            result["step_layers"] = third.as_list()
            exact, spec_rates, agreement = True, [], []
            for i, prompt in enumerate(prompts):
                greedy = run(ring_run, spec3, model_dir, args.layers, prompt, args.spec_tokens, key)[1]
                ref = single_decode(model, prompt, args.spec_tokens, device)[1]
                agreement.append(next((j for j, (a, b) in enumerate(zip(greedy, ref)) if a != b), None))
                for k in (2, 4, 8):
                    for depth in (1, 2):
                        rate, out = run(ring_run, spec3, model_dir, args.layers, prompt, args.spec_tokens, key, k, depth)
                        spec_rates.append(rate)
                        if out != greedy:
                            exact = False
                            print(f"spec != greedy: prompt {i} k {k} depth {depth}", file=sys.stderr)
        s, r1m, r3m = statistics.median(single), statistics.median(ring1), statistics.median(ring3)
        result.update({
            "single_tokens_per_s": round(s, 2), "ring1_tokens_per_s": round(r1m, 2), "ring3_tokens_per_s": round(r3m, 2),
            "ratio1": round(r1m / s, 3), "ratio3": round(r3m / s, 3),
            "spec_exact": exact, "spec_runs": len(spec_rates), "spec_tokens_per_s": round(max(spec_rates), 2),
            "hf_agreement": {"prompts": len(prompts), "identical": sum(a is None for a in agreement),
                             "first_divergence": agreement},
            "runs": {"single": [round(x, 2) for x in single], "ring1": [round(x, 2) for x in ring1],
                     "ring3": [round(x, 2) for x in ring3]},
        })
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()

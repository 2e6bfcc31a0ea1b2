"""FP8 weights held as published against the same weights held in floats: bytes, decode and prefill speed,
and the bits, side by side in one run.

The model's decoder Linears are written as an FP8 checkpoint in the published layout (float8 e4m3 weights,
one float32 ``weight_scale_inv`` per 128x128 block: DeepSeek-V3's quantizer rule, amax / 448 per block) and
beside it as the floats those bytes and scales decode to. For float32 and bfloat16, one block holding every
layer is loaded from each (``load_block``, what ``swarm stage`` runs) in this process, with ``--threads``
kernel threads:

- ``weights_bytes``: ``LayerBlock.loaded_bytes`` (FP8: a byte a weight plus the scales);
- ``decode_tok_s``: greedy decode steps per second after a 16-token prompt (``--tokens`` steps, the median of
  ``--rounds`` runs, the two checkpoints interleaved round by round); ``prefill_tok_s``: a
  ``--prompt-tokens`` prompt in one ``forward_batch``;
- ``same_bits``: every decode step's logits equal, bit for bit, between the two;
- ``mxfp4_expert_matrix``: one gpt-oss-20b expert matrix held in MXFP4 against its floats, one row and 8 rows.

The model: SmolLM2-135M-Instruct by default. Prints one JSON object.
Usage: python bench/fp8.py [--model smollm2-135m] [--tokens 32] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prefill import cpu_name, vector_unit  # noqa: E402
from swarm.model.block import load_block, model_num_layers  # noqa: E402
from swarm.model.resolve import resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402

BLOCK = 128
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def to_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (float8 e4m3 weight, float32 scales per 128x128 block, the floats they decode to)."""
    n, k = weight.shape
    grid = (-(-n // BLOCK), -(-k // BLOCK))
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:n, :k] = weight.float()
    blocks = padded.reshape(grid[0], BLOCK, grid[1], BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    floats = (q.float() * scale[:, None, :, None]).reshape(padded.shape)[:n, :k].contiguous()
    return q.reshape(padded.shape)[:n, :k].contiguous(), scale, floats


def write_pair(src: Path, out: Path) -> tuple[Path, Path]:
    """``src`` as an FP8 checkpoint and as its dequantized floats, under ``out``."""
    from safetensors.torch import load_file, save_file

    published, floats = {}, {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(shard)).items():
            if name.endswith(".weight") and t.dim() == 2 and any(f".{p}." in name for p in LINEARS):
                published[name], published[name + "_scale_inv"], floats[name] = to_fp8(t)
            else:
                published[name] = floats[name] = t
    dirs = (out / "fp8", out / "floats")
    for d, tensors in zip(dirs, (published, floats)):
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix not in (".safetensors",) and f.name != "model.safetensors.index.json" and f.is_file():
                shutil.copy(f, d / f.name)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dirs[0] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (dirs[0] / "config.json").write_text(json.dumps(config))
    return dirs


def decode(block, prompt: list[int], tokens: int) -> tuple[float, list[torch.Tensor]]:
    """(decode steps per second, each step's logits) of greedy decoding through ``block``."""
    cache, logits = block.new_cache(), []
    with torch.no_grad():
        out = block.forward_batch([(cache, 0, torch.tensor([prompt]))], tile=1)[0]
        pos, tok = len(prompt), int(out[0, -1].argmax())
        start = time.perf_counter()
        for _ in range(tokens):
            out = block.forward_batch([(cache, pos, torch.tensor([[tok]]))], tile=1)[0]
            logits.append(out[0, -1])
            pos, tok = pos + 1, int(out[0, -1].argmax())
    return tokens / (time.perf_counter() - start), logits


def prefill(block, n: int) -> float:
    ids = torch.arange(n).remainder(1000).add(100).unsqueeze(0)
    with torch.no_grad():
        start = time.perf_counter()
        block.forward_batch([(block.new_cache(), 0, ids)], tile=1)
    return n / (time.perf_counter() - start)


def mxfp4_matrix(rounds: int) -> dict:
    """One gpt-oss-20b expert's gate_up matrix (5,760 x 2,880) with random MXFP4 bytes: a decode step's GEMV
    (one row) and an 8-row chunk, MXFP4 held / its floats in float32 and bfloat16 (median of ``rounds`` x 20
    calls, four matrices in turn so they do not sit in cache), bytes and bits."""
    from swarm.kernels import fma, fp8

    g = torch.Generator().manual_seed(0)
    n, k = 5760, 2880
    held = [fp8.Mxfp4Weight(torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8),
                            torch.randint(118, 128, (n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8))
            for _ in range(4)]
    floats = {"float32": [w.dequantize() for w in held], "bfloat16": [w.dequantize(torch.bfloat16) for w in held]}
    out: dict = {"shape": [n, k], "bytes_mxfp4": held[0].nbytes, "bytes_float32": n * k * 4}
    for rows in (1, 8):
        x = torch.randn(rows, k, generator=g)
        for dtype, mats in floats.items():
            bf16 = dtype == "bfloat16"
            runs = {"mxfp4": lambda i: fp8.mxfp4_linear(x, held[i], bf16=bf16), "floats": lambda i: fma.linear(x, mats[i])}
            ms = {name: [] for name in runs}
            for _ in range(rounds):
                for name, f in runs.items():
                    start = time.perf_counter()
                    for r in range(20):
                        f(r % 4)
                    ms[name].append((time.perf_counter() - start) / 20 * 1e3)
            same = torch.equal(runs["mxfp4"](0), runs["floats"](0))
            out[f"{dtype}_rows{rows}"] = {"mxfp4_ms": round(statistics.median(ms["mxfp4"]), 3),
                                          "floats_ms": round(statistics.median(ms["floats"]), 3), "same_bits": same}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from swarm.kernels import fma

    torch.set_num_threads(args.threads)
    fma.set_threads(args.threads)
    src = resolve_model(args.model).path
    layers = LayerRange(0, model_num_layers(src))
    prompt = [1, 504, 2, 17, 99, 3, 250, 8, 41, 7, 600, 12, 5, 77, 31, 9]
    result = {"bench": "fp8", "model": args.model, "layers": len(layers), "block": [BLOCK, BLOCK],
              "threads": args.threads, "cpu": cpu_name(), "vector_unit": vector_unit(), "kernels": fma.describe().isa,
              "date": time.strftime("%Y-%m-%d"), "dtypes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        fp8_dir, float_dir = write_pair(src, Path(tmp))
        for dtype in ("float32", "bfloat16"):
            blocks = {name: load_block(d, layers, dtype=dtype, device="cpu")
                      for name, d in (("fp8", fp8_dir), ("floats", float_dir))}
            speeds = {name: [] for name in blocks}
            logits = {}
            for _ in range(args.rounds):
                for name, block in blocks.items():
                    tok_s, logits[name] = decode(block, prompt, args.tokens)
                    speeds[name].append(tok_s)
            pre = {name: statistics.median(prefill(b, args.prompt_tokens) for _ in range(args.rounds))
                   for name, b in blocks.items()}
            row = {name: {"weights_bytes": b.loaded_bytes, "kernel_mode": b.kernel_mode,
                          "decode_tok_s": round(statistics.median(speeds[name]), 2),
                          "prefill_tok_s": round(pre[name], 1)} for name, b in blocks.items()}
            row["fp8_over_floats"] = {
                "weights_bytes": round(blocks["fp8"].loaded_bytes / blocks["floats"].loaded_bytes, 3),
                "decode": round(row["fp8"]["decode_tok_s"] / row["floats"]["decode_tok_s"], 3),
                "prefill": round(row["fp8"]["prefill_tok_s"] / row["floats"]["prefill_tok_s"], 3)}
            row["same_bits"] = all(torch.equal(a, b) for a, b in zip(logits["fp8"], logits["floats"]))
            result["dtypes"][dtype] = row
            del blocks
    result["mxfp4_expert_matrix"] = mxfp4_matrix(args.rounds)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

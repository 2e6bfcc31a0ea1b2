"""Time to first token of a long prompt: swarm rings against one transformers forward, side by side.

SmolLM2-135M in float32 on loopback. For each prompt length (default about 1,700 and 4,000 tokens):
one transformers forward (``logits_to_keep=1``, as ``generate`` runs a prefill) with 1 torch thread
and with 2; a ring of 1 stage holding all 30 layers (``--threads 1``) and a ring of 3 stages
[0, 10) [10, 20) [20, 30) (``--threads 1`` each), each asked for 1 new token. Ratios are
transformers' seconds over the ring's (1-stage ring vs 1 thread, 3-stage ring vs 2 threads), and
the ring's first token must equal transformers' argmax. Then, in this process at 1 thread, the
stage's blocks (all 30 layers) against transformers: a decode step's seconds, and a verify chunk of
5 rows over a decode step. Prints one JSON object.

``--dtype bfloat16`` runs the model, the stages and transformers in bfloat16 (the stages' fma kernels
take bfloat16 weights and caches, float32 sums); ``--isa avx2`` makes the stages and the in-process
blocks run that instruction set of the kernels (``SWARM_ISA``; the same bits as any other). The JSON
names the CPU, its widest vector unit and the kernel path the blocks ran.

Usage: python bench/prefill.py [--lengths 1700 4000] [--rounds 1] [--skip-three] [--dtype bfloat16] [--isa avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.config import RingSpec, SpecConfig  # noqa: E402
from swarm.coordinator.decoding import DecodeOptions, decode  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import load_block, model_num_layers  # noqa: E402
from swarm.model.resolve import model_manifest_digest, resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402

PARAGRAPH = ("The river ran past the old mill, where the miller's daughter kept a ledger of every sack of grain "
             "and every traveller who crossed the bridge. ")


def prompt_ids(tokenizer, tokens: int) -> list[int]:
    return tokenizer(PARAGRAPH * (tokens // 20 + 10))["input_ids"][:tokens]


def reference_ttft(model, ids: list[int], threads: int) -> tuple[float, int]:
    torch.set_num_threads(threads)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        return time.perf_counter() - t0, token


async def ring_ttft(spec: RingSpec, model_dir: Path, ids: list[int], key: Path, chunk: int) -> tuple[float, int]:
    async with open_host(load_or_create_key(key), ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, spec, 600.0, 60.0)
        await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
        decoded = await decode(ring, ids, DecodeOptions(1, spec=SpecConfig(prefill_chunk=chunk)))
        out, timing = decoded.output_ids, decoded.as_record()
        nursery.cancel_scope.cancel()
    return timing["ttft_s"], out[0]


def in_process(model, model_dir: Path, dtype: str = "float32", context: int = 128, reps: int = 10) -> dict:
    """Decode step and 5-row verify chunk of the stage's blocks vs transformers' decode step, 1 thread."""
    from transformers import DynamicCache

    from swarm.kernels import fma

    torch.set_num_threads(1)
    fma.set_threads(1)
    block = load_block(model_dir, LayerRange(0, model_num_layers(model_dir)), dtype=dtype, device="cpu")
    ids = torch.randint(0, block.vocab_size, (1, context + 5), generator=torch.Generator().manual_seed(0))
    cache = block.new_cache(context + 8)
    block.forward_batch([(cache, 0, ids[:, :context])], logits_rows=[1])

    def step(rows: int) -> float:
        t0 = time.perf_counter()
        block.forward_batch([(cache, context, ids[:, context:context + rows])], logits_rows=[rows])
        return time.perf_counter() - t0

    def ref_step() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(ids[:, context:context + 1], past_key_values=kv, use_cache=True)
        kv.crop(-1)  # back to the context, for the next step
        return time.perf_counter() - t0

    with torch.inference_mode():
        kv = DynamicCache(config=model.config)
        model(ids[:, :context], past_key_values=kv, use_cache=True)
    decode_s, verify_s, ref_s = [], [], []
    for _ in range(reps):  # interleaved, so machine noise hits all three alike
        decode_s.append(step(1))
        verify_s.append(step(5))
        ref_s.append(ref_step())
    d, v, r = (statistics.median(x) for x in (decode_s, verify_s, ref_s))
    path = fma.describe() if block.kernel_mode == "fma" else None
    return {"kernel_mode": block.kernel_mode, "kernels": path.as_dict() if path else None, "context": context, "blocks_decode_step_s": round(d, 4),
            "transformers_decode_step_s": round(r, 4), "decode_ratio": round(r / d, 3),
            "verify5_step_s": round(v, 4), "verify5_over_decode": round(v / d, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1700, 4000])
    parser.add_argument("--rounds", type=int, default=1, help="runs of each measurement (median reported)")
    parser.add_argument("--prefill-chunk", type=int, default=SpecConfig().prefill_chunk,
                        help="positions per prefill chunk of the ring (default: the coordinator's)")
    parser.add_argument("--skip-three", action="store_true", help="no 3-stage ring (and no 2-thread reference)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype in the stages and in transformers (default float32)")
    parser.add_argument("--isa", default="auto", help="the kernels' instruction set (SWARM_ISA: auto, avx512, avx2, neon)")
    args = parser.parse_args()
    os.environ["SWARM_ISA"] = args.isa  # the stages inherit it; this process's blocks read it on first use

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype)).eval()
    layers = model_num_layers(model_dir)
    result = {"model": args.model, "dtype": args.dtype, "prefill_chunk": args.prefill_chunk, "prompts": []}
    setups = [("one_stage", [LayerRange(0, layers)], 1)]
    if not args.skip_three:
        thirds = [layers // 3, 2 * layers // 3]
        setups.append(("three_stages", [LayerRange(0, thirds[0]), LayerRange(thirds[0], thirds[1]),
                                        LayerRange(thirds[1], layers)], 2))
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            ids = prompt_ids(tokenizer, length)
            entry = {"prompt_tokens": len(ids)}
            for name, ranges, threads in setups:
                with LocalRing(args.model, ranges, Path(tmp) / name, threads=1,
                               extra_args=["--dtype", args.dtype]) as ring:
                    spec = RingSpec(model=args.model, stages=ring.ring_spec().stages)
                    rings, refs = [], []
                    for _ in range(args.rounds):  # alternate, so noise hits both alike
                        rings.append(trio.run(ring_ttft, spec, model_dir, ids, Path(tmp) / "coord.key",
                                              args.prefill_chunk))
                        refs.append(reference_ttft(model, ids, threads))
                ring_s = statistics.median(r[0] for r in rings)
                ref_s = statistics.median(r[0] for r in refs)
                entry[name] = {"ring_ttft_s": round(ring_s, 3), f"transformers_{threads}_thread_s": round(ref_s, 3),
                               "ratio": round(ref_s / ring_s, 3),
                               "same_token": all(r[1] == f[1] for r, f in zip(rings, refs)),
                               "ring_runs": [round(r[0], 3) for r in rings],
                               "reference_runs": [round(r[0], 3) for r in refs]}
                print(json.dumps({"progress": name, "prompt_tokens": len(ids), **entry[name]}), file=sys.stderr)
            result["prompts"].append(entry)
    result["in_process"] = in_process(model, model_dir, args.dtype)
    result["cpu"] = cpu_name()
    result["vector_unit"] = vector_unit()
    result["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(result, indent=1))


def vector_unit() -> str:
    """The widest vector unit the CPU reports (/proc/cpuinfo flags): avx512f, avx2, neon (asimd) or none."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    for unit in ("avx512f", "avx2", "asimd"):
        if unit in flags:
            return "neon" if unit == "asimd" else unit
    return "none"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo) and torch's thread count now (also bench/quantized.py's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads at the end)"
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()

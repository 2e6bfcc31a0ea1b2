"""llama.cpp against a swarm stage, side by side: prefill and decode speed of one GGUF on the CPU.

Both sides get the same GGUF, the same prompt token ids (a fixed English text, ``bench.prefill``'s
paragraph, cut to ``--prompt-tokens`` by the model's tokenizer), the same thread count, greedy
decoding of ``--new-tokens`` tokens with EOS ignored, and one short warm-up request first:

- llama.cpp through the ``xllamacpp`` wheel (``pip install -e .[bench]``): its server in this
  process, one ``/completions`` request with the prompt as token ids, ``temperature 0, top_k 1``;
  speeds are llama.cpp's own timings (``prompt_per_second``, ``predicted_per_second``);
- swarm: a ring of 1 stage holding every layer on loopback (``swarm stage --threads N`` plus
  ``--stage-args``; none by default, which loads the GGUF expanded to float32), plain greedy decoding
  (no drafter, K = 0); prefill speed is prompt tokens over the time to first token (which also holds
  the session's opening and a loopback hop, where llama.cpp's prompt time is its compute alone),
  decode speed is the coordinator's ``tokens_per_s`` (after the first token).

Ratios are swarm over llama.cpp (below 1: swarm is slower). ``same_text`` is a sanity check, not a
promise: llama.cpp rounds activations to 8 bits in its quantized dot products and swarm to 16 (or,
without ``--quantize``, computes on weights expanded to float32), so two near-equal logits can pick
different tokens. The JSON also holds the GGUF's tensor
bytes of the layers (``blk.*``) and of all its tensors, the stage's held weight bytes (its READY line's
``weights_bytes``; the stage holds every tensor) and their ratio to all the GGUF's tensors, the CPU and
its widest vector unit. Prints one JSON object.

``--make-q8-0 OUT.gguf`` instead writes a Q8_0 GGUF of ``--model`` (each quantized tensor dequantized
and re-quantized to Q8_0, metadata, tokenizer and float tensors copied), checks that llama.cpp loads it
and answers, prints one JSON object and exits; bench it with ``--model OUT.gguf``.

Usage: python bench/vs_llamacpp.py [--model PATH.gguf] [--threads 1 2] [--prompt-tokens 500]
           [--new-tokens 128] [--prefill-chunk 128] [--stage-args "--flag value"] [--make-q8-0 OUT.gguf]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prefill import cpu_name, prompt_ids, vector_unit  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.config import SpecConfig  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import _builtin_gguf, resolve_model  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from tests.support.ring import ring_generate  # noqa: E402

WARMUP_TOKENS = 16  # prompt positions and new tokens of the warm-up request on each side
TEXT_CHARS = 120  # of each side's generated text in the JSON (``same_text`` compares all of it)
HELD_BYTES_KEYS = ("weights_bytes", "loaded_bytes", "held_bytes")  # what a READY line may call them


def layer_tensor_bytes(gguf_path: Path, layers_only: bool = True) -> int:
    """Bytes of the GGUF's layer tensors (``blk.*``; every tensor with ``layers_only`` False) as stored in
    the file (quantized blocks included)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(gguf_path).tensors if not layers_only or t.name.startswith("blk."))


def llamacpp_server(gguf_path: Path, threads: int, n_ctx: int):
    """An ``xllamacpp.Server`` over ``gguf_path`` on the CPU: one slot, ``threads`` for prompt and decode."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf_path)
    params.n_ctx = n_ctx
    params.n_parallel = 1
    params.n_gpu_layers = 0
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.verbosity = -1  # its per-request log lines would bury the JSON's stderr neighbours
    return xllamacpp.Server(params)


def llamacpp_complete(server, prompt: list[int] | str, new_tokens: int) -> dict:
    """One greedy ``/completions`` request (EOS ignored, no prompt cache); llama.cpp's response dict."""
    return server.handle_completions({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                                      "ignore_eos": True, "cache_prompt": False})


def run_llamacpp(gguf_path: Path, ids: list[int], new_tokens: int, threads: int) -> dict:
    """Prefill and decode speed of llama.cpp at ``threads``, by its own timings, after a warm-up request."""
    server = llamacpp_server(gguf_path, threads, len(ids) + new_tokens + 16)
    try:
        llamacpp_complete(server, ids[:WARMUP_TOKENS], WARMUP_TOKENS)
        t0 = time.perf_counter()
        out = llamacpp_complete(server, ids, new_tokens)
        wall_s = time.perf_counter() - t0
    finally:
        del server  # its threads go before the stage starts
    if "timings" not in out:
        raise RuntimeError(f"llama.cpp answered without timings: {json.dumps(out)[:500]}")
    t = out["timings"]
    return {"prompt_tokens": t["prompt_n"], "prefill_s": round(t["prompt_ms"] / 1e3, 4),
            "prefill_tok_s": round(t["prompt_per_second"], 2), "new_tokens": t["predicted_n"],
            "decode_tok_s": round(t["predicted_per_second"], 2), "wall_s": round(wall_s, 3),
            "text": out["choices"][0]["text"]}


def run_swarm(model: str, model_dir: Path, ids: list[int], new_tokens: int, threads: int, stage_args: list[str],
              prefill_chunk: int, key_dir: Path) -> dict:
    """Prefill (time to first token) and decode speed of a 1-stage ring, after a warm-up decode."""
    layers = model_num_layers(model_dir)
    spec_config = SpecConfig(prefill_chunk=prefill_chunk)  # no drafter: K = 0, plain greedy decoding
    with LocalRing(model, [LayerRange(0, layers)], key_dir, threads=threads, extra_args=stage_args) as ring:
        ready = ring.stages[0].ready
        spec = ring.ring_spec()
        generate = partial(ring_generate, spec, model_dir, layers, key_dir=key_dir, hop_timeout_s=600.0,
                           spec_config=spec_config)
        trio.run(partial(generate, ids[:WARMUP_TOKENS], WARMUP_TOKENS))
        info: dict = {}
        out = trio.run(partial(generate, ids, new_tokens, info=info))
    held = next((ready[k] for k in HELD_BYTES_KEYS if ready.get(k) is not None), None)
    return {"prompt_tokens": len(ids), "ttft_s": round(info["ttft_s"], 4),
            "prefill_tok_s": round(len(ids) / info["ttft_s"], 2), "new_tokens": len(out),
            "decode_tok_s": round(info["tokens_per_s"], 2), "total_s": round(info["total_s"], 3),
            "stage_weights_bytes": held, "kernels": ready.get("kernels"), "output_ids": out}


def make_q8_0(src: Path, out: Path) -> dict:
    """Write a Q8_0 GGUF of ``src``: quantized tensors dequantized and re-quantized to Q8_0 (``gguf.quants``);
    float tensors, metadata and tokenizer copied; ``general.file_type`` set to MOSTLY_Q8_0.

    Args:
        src: a GGUF file. out: where the Q8_0 GGUF goes (overwritten).
    Returns:
        ``{"tensor_types": {type: count}, "file_bytes": N, "layer_tensor_bytes": N}`` of the written file.
    Raises:
        ValueError: a tensor's rows do not split into Q8_0 blocks of 32.
    """
    import numpy as np
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        vtype = field.types[0]
        value = LlamaFileType.MOSTLY_Q8_0 if field.name == Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    kept = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)
    for t in reader.tensors:
        if t.tensor_type in kept:
            # a Q8_0 tensor's data is (rows, bytes per row) uint8: the writer turns it back into elements
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        values = dequantize(t.data, t.tensor_type).astype(np.float32)  # (rows, columns)
        if values.shape[-1] % 32:
            raise ValueError(f"{t.name}: {values.shape[-1]} columns do not split into Q8_0 blocks of 32")
        writer.add_tensor(t.name, quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    written = GGUFReader(out)
    types: dict[str, int] = {}
    for t in written.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"tensor_types": types, "file_bytes": out.stat().st_size, "layer_tensor_bytes": layer_tensor_bytes(out)}


def gguf_path_of(model: str) -> Path:
    """The GGUF file a ``--model`` names: a path, or a built-in name's shipped file."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise SystemExit(f"no such GGUF file: {path}")
        return path.resolve()
    try:
        return _builtin_gguf(model.lower())
    except KeyError:
        raise SystemExit(f"--model must be a .gguf file or a built-in name, got {model!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m",
                    help="a GGUF file, or a built-in name (default: the shipped SmolLM2-135M-Instruct Q4_1 GGUF)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, each run on both sides")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=SpecConfig().prefill_chunk,
                    help="positions per prefill chunk of the ring (default: the coordinator's)")
    ap.add_argument("--stage-args", default="", help='more `swarm stage` flags, one string (e.g. "--dtype bfloat16")')
    ap.add_argument("--make-q8-0", type=Path, metavar="OUT.gguf",
                    help="write a Q8_0 GGUF of --model, check llama.cpp answers from it, and exit")
    args = ap.parse_args(argv)
    if args.prompt_tokens < WARMUP_TOKENS or args.new_tokens < 2 or min(args.threads) < 1:
        ap.error(f"--prompt-tokens must be >= {WARMUP_TOKENS}, --new-tokens >= 2, --threads >= 1")
    gguf_path = gguf_path_of(args.model)
    if args.make_q8_0:
        made = make_q8_0(gguf_path, args.make_q8_0)
        server = llamacpp_server(args.make_q8_0, 1, 128)
        answer = llamacpp_complete(server, "The capital of France is", 8)
        del server
        print(json.dumps({"bench": "vs_llamacpp.make_q8_0", "source": str(gguf_path), "out": str(args.make_q8_0),
                          **made, "llamacpp_answer": answer["choices"][0]["text"]}))
        return 0

    import xllamacpp
    from transformers import AutoTokenizer

    model_dir = resolve_model(str(gguf_path)).path  # the stage resolves the same file to the same directory
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    stage_args = shlex.split(args.stage_args)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            llama = run_llamacpp(gguf_path, ids, args.new_tokens, threads)
            print(json.dumps({"progress": "llamacpp", "threads": threads, **llama}), file=sys.stderr)
            swarm = run_swarm(str(gguf_path), model_dir, ids, args.new_tokens, threads, stage_args,
                              args.prefill_chunk, Path(tmp))
            swarm["text"] = tokenizer.decode(swarm.pop("output_ids"))
            print(json.dumps({"progress": "swarm", "threads": threads, **swarm}), file=sys.stderr)
            same_text = swarm["text"] == llama["text"]
            for side in (llama, swarm):
                side["text"] = side["text"][:TEXT_CHARS]
            runs.append({"threads": threads, "llamacpp": llama, "swarm": swarm,
                         "swarm_over_llamacpp": {
                             "decode": round(swarm["decode_tok_s"] / llama["decode_tok_s"], 3),
                             "prefill": round(swarm["prefill_tok_s"] / llama["prefill_tok_s"], 3)},
                         "same_text": same_text})
    held = next((r["swarm"]["stage_weights_bytes"] for r in runs if r["swarm"]["stage_weights_bytes"]), None)
    tensor_bytes = layer_tensor_bytes(gguf_path, layers_only=False)
    print(json.dumps({"bench": "vs_llamacpp", "model": str(gguf_path), "layers": model_num_layers(model_dir),
                      "gguf_layer_tensor_bytes": layer_tensor_bytes(gguf_path), "gguf_tensor_bytes": tensor_bytes,
                      "stage_weights_bytes": held,  # the stage holds every layer, the embedding and the norm
                      "held_over_gguf": round(held / tensor_bytes, 3) if held else None, "stage_args": stage_args,
                      "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "prefill_chunk": args.prefill_chunk,
                      "xllamacpp": xllamacpp.__version__, "cpu": cpu_name(), "vector_unit": vector_unit(),
                      "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The triton kernel mode's kernels against the stock ones a rows-mode CUDA stage runs, side by side.

For each GEMM width (SmolLM2-135M's MLP up projection, a ~1B Llama's) and row count M (a decode
row, a verify chunk of 5, prefill slices of 64 and 512 rows), the time of ``triton_ops.linear`` and
of ``F.linear`` (``torch_ms``: cuBLAS on a GPU) over all M rows at once, and of the rows mode's M
one-row calls; for attention over a session of ``--keys`` cached positions, T query rows of ``triton_ops.attention``
against T one-row SDPA calls (the rows mode). Each figure is the median of ``--repeat`` timed calls
after a warm-up (which also compiles the Triton kernels). ``rows_match`` says whether every row of
the M-row call has the bits of the same row computed alone (the batch-invariance the stage relies
on); for torch it is a measurement, not a promise.

Prints one JSON object (and writes it to --out). Usage on a GPU: python bench/triton_kernels.py
A CPU smoke run under Triton's interpreter (tiny shapes, slow):
  TRITON_INTERPRET=1 python bench/triton_kernels.py --device cpu --dtype float32 --small --repeat 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.kernels import triton_ops  # noqa: E402


def _time_ms(fn, device: torch.device, repeat: int) -> float:
    fn()  # warm-up: compiles the Triton kernel for this specialization
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 4)


def _rows_match(many: torch.Tensor, one_by_one) -> bool:
    return all(torch.equal(many[i], one_by_one(i)) for i in range(many.shape[0]))


def bench_linear(k: int, n: int, ms: list[int], device, dtype, repeat: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    out = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        tri = triton_ops.linear(x, w)
        stock = F.linear(x, w)
        out.append({
            "k": k, "n": n, "m": m,
            "triton_ms": _time_ms(lambda: triton_ops.linear(x, w), device, repeat),
            "torch_ms": _time_ms(lambda: F.linear(x, w), device, repeat),
            "rows_mode_ms": _time_ms(lambda: [F.linear(x[i:i + 1].clone(), w) for i in range(m)], device, repeat),
            "triton_rows_match": _rows_match(tri, lambda i: triton_ops.linear(x[i:i + 1].clone(), w)[0]),
            "torch_rows_match": _rows_match(stock, lambda i: F.linear(x[i:i + 1].clone(), w)[0]),
        })
    return out


def bench_attention(h: int, hkv: int, dh: int, keys_n: int, ts: list[int], device, dtype, repeat: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for t in ts:
        s = keys_n + t
        keys = torch.randn(s, hkv, dh, generator=gen).to(device, dtype)
        values = torch.randn(s, hkv, dh, generator=gen).to(device, dtype)
        q = torch.randn(t, h, dh, generator=gen).to(device, dtype)
        pos, scale = keys_n, dh ** -0.5

        def sdpa_rows():
            return [F.scaled_dot_product_attention(q[i:i + 1].transpose(0, 1).unsqueeze(0),
                                                   keys[:pos + i + 1].transpose(0, 1).unsqueeze(0),
                                                   values[:pos + i + 1].transpose(0, 1).unsqueeze(0),
                                                   scale=scale, enable_gqa=h != hkv) for i in range(t)]

        tri = triton_ops.attention(q, keys, values, pos, scale)
        decode_match = _rows_match(tri, lambda i: triton_ops.attention(
            q[i:i + 1].clone(), keys[:pos + i + 1], values[:pos + i + 1], pos + i, scale)[0])
        out.append({"h": h, "hkv": hkv, "dh": dh, "cached": keys_n, "t": t,
                    "triton_ms": _time_ms(lambda: triton_ops.attention(q, keys, values, pos, scale), device, repeat),
                    "sdpa_rows_ms": _time_ms(sdpa_rows, device, repeat), "triton_rows_match": decode_match})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--keys", type=int, default=1024, help="cached positions before the attention rows")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run under the interpreter)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ok, why = triton_ops.available(device, dtype)
    if not ok:
        print(json.dumps({"error": f"the triton kernels cannot run here: {why}"}))
        return 2
    if args.small:
        widths, ms, heads, keys_n, ts = [(40, 72)], [1, 5], [(4, 2, 16)], 70, [1, 3]
    else:
        widths, ms, heads, keys_n, ts = [(576, 1536), (2048, 5632)], [1, 5, 64, 512], [(9, 3, 64), (16, 4, 128)], \
            args.keys, [1, 5, 64]
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton's interpreter)",
        "dtype": args.dtype, "torch": torch.__version__, "triton": triton_ops.triton.__version__,
        "tiles": triton_ops.describe(),
        "linear": [row for k, n in widths for row in bench_linear(k, n, ms, device, dtype, args.repeat)],
        "attention": [row for h, hkv, dh in heads
                      for row in bench_attention(h, hkv, dh, keys_n, ts, device, dtype, args.repeat)],
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

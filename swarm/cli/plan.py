"""``swarm plan``: what a model costs in memory per layer and per token of KV, and how its layers split over cards.

Owns: the command over ``swarm.model.plan``: ``MODEL`` as a model directory (its safetensors headers), a
``config.json`` alone (transformers' meta device) or a built-in name or GGUF; a table per dtype, contiguous
blocks per card with ``--gpus``, ``--json``; exit 1 naming the shortfall. docs/commands.md, "Memory planning".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from swarm.errors import ConfigError, ModelError


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="bytes per layer and per token of KV; a split of the layers over cards",
                       description="Memory per layer and per token of KV at each dtype, and a split of the model's "
                                   "layers over a list of cards (contiguous blocks in the order given, in proportion "
                                   "to what each card holds). Float dtypes are what a stage loads with --dtype, int8 "
                                   "and int4 what it holds with --quantize (CPU only).")
    p.add_argument("model", help="a model directory, a directory or file with config.json alone (e.g. a 70B "
                                 "config: nothing is downloaded), a .gguf file or a built-in name (smollm2-135m)")
    p.add_argument("--gpus", metavar="SIZES",
                   help="comma-separated memory per card in ring order, e.g. 24GB,24GB,12GB (GB = 10^9 bytes, "
                        "GiB = 2^30); prints a split of the layers over them")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "int8", "int4"],
                   help="the dtype the split's cards run (default bfloat16)")
    p.add_argument("--ctx", type=int, help="KV positions per session each stage budgets (default: the model's "
                                           "maximum context, at most 4096)")
    p.add_argument("--sessions", type=int, default=1, help="concurrent full-context sessions per stage (default 1)")
    p.add_argument("--reserve", default="1GB",
                   help="memory per card kept for the runtime: CUDA context, activations, allocator slack "
                        "(default 1GB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def cmd_plan(args) -> int:
    from swarm.model import plan

    model = _shapes(args.model)
    if args.sessions < 1:
        raise ConfigError(f"--sessions must be >= 1, got {args.sessions}")
    max_ctx = int(model.config.get("max_position_embeddings") or model.config.get("n_positions") or 4096)
    ctx = args.ctx if args.ctx is not None else min(max_ctx, 4096)
    if not 0 < ctx <= max_ctx:
        raise ConfigError(f"--ctx must be in [1, {max_ctx}] (the model's maximum context), got {ctx}")
    kv_tokens = ctx * args.sessions
    fps = {d: plan.footprint(model, d) for d in plan.DTYPES}
    out = {"model": args.model, "shapes_from": model.source, "family": model.config.get("model_type"),
           "num_layers": model.num_layers, "ctx": ctx, "sessions": args.sessions,
           "dtypes": {d: {"layer_bytes": f.layer, "head_extra_bytes": f.head, "tail_extra_bytes": f.tail,
                          "model_bytes": f.total, "kv_bytes_per_token_layer": f.kv_token_layer,
                          "kv_bytes_per_token": f.kv_token_layer * f.num_layers,
                          "quantized": d in plan.QUANTIZED} for d, f in fps.items()}}
    failure = None
    if args.gpus:
        entries = [e.strip() for e in args.gpus.split(",")]
        if not all(entries):
            raise ConfigError(f"--gpus {args.gpus!r} has an empty entry: give sizes like 24GB,24GB,12GB")
        cards = [plan.parse_size(e) for e in entries]
        reserve = plan.parse_size(args.reserve, zero=True)
        fp = fps[args.dtype]
        try:
            placements = plan.split(fp, cards, kv_tokens=kv_tokens, reserve=reserve)
        except ConfigError as exc:
            failure = str(exc)
            placements = []
        rows = []
        for p_ in placements:
            weights = plan.range_bytes(model, p_.layers, args.dtype) if p_.layers else 0
            kv = len(p_.layers) * kv_tokens * fp.kv_token_layer if p_.layers else 0
            rows.append({"card": p_.card, "capacity_bytes": p_.capacity,
                         "layers": p_.layers.as_list() if p_.layers else None, "weights_bytes": weights,
                         "kv_bytes": kv, "needed_bytes": weights + kv + (reserve if p_.layers else 0),
                         "free_bytes": p_.capacity - weights - kv - (reserve if p_.layers else 0)})
        out["split"] = {"dtype": args.dtype, "reserve_bytes": reserve, "kv_tokens_per_stage": kv_tokens,
                        "stages": rows, "fits": failure is None, **({"error": failure} if failure else {})}
    notes = []
    if args.gpus and args.dtype in plan.QUANTIZED:
        notes.append(f"{args.dtype} stages run on the CPU for now (swarm stage --quantize): the split is of CPU memory")
    quant_cfg = model.config.get("quantization_config")
    if isinstance(quant_cfg, dict):
        notes.append(f"this checkpoint is quantized ({quant_cfg.get('quant_method', 'unknown method')}), which the "
                     "stage's loader does not read: the figures are for float weights")
    out["notes"] = notes
    if args.json:
        print(json.dumps(out))
    else:
        _print(out, fps)
        for note in notes:
            print(f"note: {note}")
    if failure:
        print(f"swarm plan: error: {failure}", file=sys.stderr)
        return 1
    return 0


def _shapes(spec: str):
    from swarm.model import plan

    path = Path(spec).expanduser()
    if path.exists() and (path.is_file() and path.suffix != ".gguf" or (path / "config.json").is_file()):
        return plan.model_shapes(path)
    if path.is_dir():
        raise ModelError(f"{path} has no config.json")
    from swarm.model.resolve import resolve_model

    return plan.model_shapes(resolve_model(spec).path)


def _print(out: dict, fps: dict) -> None:
    from swarm.model.plan import human

    print(f"{out['model']}: {out['family']}, {out['num_layers']} layers (shapes from {out['shapes_from']}); "
          f"KV budget per stage: {out['ctx']} positions x {out['sessions']} session(s)")
    print(f"{'dtype':<10}{'per layer':>12}{'first stage +':>15}{'last stage +':>14}{'model':>12}"
          f"{'KV/token/layer':>16}{'KV/token':>12}")
    for d, f in fps.items():
        mark = " (--quantize, CPU)" if out["dtypes"][d]["quantized"] else ""
        print(f"{d:<10}{human(f.layer):>12}{human(f.head):>15}{human(f.tail):>14}{human(f.total):>12}"
              f"{human(f.kv_token_layer):>16}{human(f.kv_token_layer * f.num_layers):>12}{mark}")
    split = out.get("split")
    if not split:
        return
    if not split["fits"]:
        print(f"split in {split['dtype']}: the layers do not fit these cards (below)")
        return
    print(f"split in {split['dtype']} ({human(split['reserve_bytes'])} kept per card):")
    for s in split["stages"]:
        layers = "-" if s["layers"] is None else f"--layers {s['layers'][0]}:{s['layers'][1]}"
        print(f"  card {s['card']} {human(s['capacity_bytes']):>9}: {layers:<18} weights {human(s['weights_bytes']):>9}"
              f"  KV {human(s['kv_bytes']):>9}  free {human(s['free_bytes']):>9}")

"""A paper model of a ring's decode tokens/s, checked against the measured speculation bench.

The model (docs/scale.md derives it): a ring of S stages and S + 1 one-way hops of h seconds
(coordinator -> stage 0 -> ... -> tail -> coordinator), each also taking u seconds per row it carries
(a row's bytes over the link's bandwidth). A verify chunk of c = K + 1 rows costs t(c) seconds at a
stage, so one round trip is R(c) = (S + 1)(h + u c) + S t(c) + o (o: the coordinator's own time). Drafts are accepted independently with probability a (the greedy rule of Leviathan et
al. 2023, arXiv 2211.17192). With D chunks in flight (PipeInfer, arXiv 2407.11798: each drafted as if
the one before fully accepts; a rejection makes every chunk in flight stale), a chunk goes out every
I = max(R / D, t(c), S t(c) / cores) seconds (the ring's latency shared by D chunks, but never
faster than the slowest stage, nor than the machine when stages share its cores), a run of chunks
lasts until the first rejection and commits 1 / (1 - a) tokens on average in R + I p / (1 - p)
seconds, p = a^c the chance that a chunk is accepted whole:

    tok/s = (1 - a^c) / ((1 - a) (R (1 - p) + I p))   (for D = 1 this is E / R, E = (1 - a^c) / (1 - a))

``--validate FILE.jsonl`` calibrates t(c) = (R0(c) - o) / S on the file's 0 ms, depth-1 cells of the
draftable set (R0(c) = tokens per round trip / tokens/s: a straight line in c fitted to them, o = 0),
and the hops' own cost on its 10 ms depth-1 draftable cells (R10(c) - R0(c) = (S + 1)(h + e + u c):
e, the emulating relay's fixed cost per frame, and u, fitted), and predicts every other cell (other hops, depths, K, and the novel set, whose n-gram drafter
proposes only mean_accepted / accept_rate drafts per chunk) from the hops alone: one JSON object
with the relative error of each cell and their median and maximum. ``--gpus`` prints the model's
tokens/s of a 70B-class ring of consumer GPUs over a grid of hops, RTT, K, depth and acceptance
(the card's decode time from its memory bandwidth, docs/scale.md says which numbers).
Usage: python bench/scale_model.py --validate bench/results/spec_ring-2026-11-30.jsonl
       python bench/scale_model.py --gpus
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ring:
    """What the model needs of a ring.

    Attributes:
        stages: S, stages in the ring.
        hop_s: one-way latency of each of the S + 1 hops, seconds.
        hop_row_s: seconds a hop takes per row of the chunk (a row's bytes / the link's bytes per second).
        step_s: ``step_s(rows)``, a stage's seconds for a chunk of that many rows (the slowest stage's).
        overhead_s: the coordinator's own seconds per round trip.
        cores: compute units the stages share (a stage each: ``stages``; this CPU: 2).
    """

    stages: int
    hop_s: float
    step_s: object
    hop_row_s: float = 0.0
    overhead_s: float = 0.0
    cores: int | None = None

    def round_trip_s(self, rows: int) -> float:
        return (self.stages + 1) * (self.hop_s + self.hop_row_s * rows) + self.stages * self.step_s(rows) + \
            self.overhead_s


def tokens_per_s(ring: Ring, k: int, depth: int, accept: float, drafts: float | None = None) -> float:
    """Decode tokens/s of the ring (the formula in the module docstring).

    Args:
        ring: the ring.
        k: draft tokens per verify chunk (0: plain greedy decoding).
        depth: verify chunks in flight.
        accept: the chance a draft is accepted, in [0, 1).
        drafts: drafts the drafter really proposes per chunk (<= k; None: k).
    Returns:
        Tokens per second.
    """
    d = k if drafts is None else min(drafts, k)
    rows = 1 + max(0, round(d))
    r = ring.round_trip_s(rows)
    if d <= 0:
        return 1.0 / r
    if depth <= 1 or drafts is not None and drafts < k:
        # one chunk at a time (or a drafter with too little to run ahead): E tokens per round trip
        return sum(accept ** i for i in range(int(d) + 1)) / r if d == int(d) else (1 + d * accept) / r
    cores = ring.cores or ring.stages
    interval = max(r / depth, ring.step_s(rows), ring.stages * ring.step_s(rows) / cores)
    p = accept ** rows
    return (1 - p) / ((1 - accept) * (r * (1 - p) + interval * p))


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def validate(path: Path, stages: int = 3, cores: int = 2) -> dict:
    """Calibrate on the 0 ms depth-1 draftable cells of a ``bench/spec_ring.py`` JSONL, predict the rest."""
    cells = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    calib = [c for c in cells if c["hop_ms"] == 0 and c["depth"] == 1 and c["prompt_set"] == "draftable"]
    if len(calib) < 2:
        raise SystemExit(f"{path}: needs at least two 0 ms depth-1 cells of the draftable set to calibrate")
    rows = [1 + c["k"] for c in calib]
    round_trip = [c["tokens_per_round_trip"] / c["tokens_per_s"] for c in calib]
    a, b = _fit_line(rows, round_trip)

    def step_s(n: int) -> float:
        return (a + b * n) / stages

    hop_calib = [c for c in cells if c["hop_ms"] == 10 and c["depth"] == 1 and c["prompt_set"] == "draftable"]
    extra, per_row = 0.0, 0.0
    if len(hop_calib) >= 2:  # the emulated hops' own cost: fixed per frame, and per row
        rows10 = [1 + c["k"] for c in hop_calib]
        per_hop = [((c["tokens_per_round_trip"] / c["tokens_per_s"]) - (a + b * n)) / (stages + 1) - 0.010
                   for c, n in zip(hop_calib, rows10)]
        extra, per_row = _fit_line(rows10, per_hop)
    calib = calib + hop_calib
    out = []
    for c in cells:
        if c in calib:
            continue
        hop = c["hop_ms"] / 1000
        ring = Ring(stages, hop + (extra if hop else 0.0), step_s, hop_row_s=per_row if hop else 0.0, cores=cores)
        accept = min(c["accept_rate"], 0.999)
        drafts = c["mean_accepted"] / c["accept_rate"] if c["accept_rate"] > 0 else 0.0
        predicted = tokens_per_s(ring, c["k"], c["depth"], accept, drafts if drafts < c["k"] - 0.5 else None)
        out.append({"hop_ms": c["hop_ms"], "depth": c["depth"], "k": c["k"], "prompt_set": c["prompt_set"],
                    "measured": c["tokens_per_s"], "predicted": round(predicted, 2),
                    "error": round(predicted / c["tokens_per_s"] - 1, 3)})
    errors = [abs(c["error"]) for c in out]
    by = {}
    for key in ("depth", "prompt_set", "hop_ms"):
        for value in sorted({c[key] for c in out}, key=str):
            sub = [abs(c["error"]) for c in out if c[key] == value]
            by[f"{key}={value}"] = round(statistics.median(sub), 3)
    return {"file": str(path), "stages": stages, "cores": cores,
            "calibration": {"cells": len(calib), "round_trip_s_at_1_row": round(a + b, 4),
                            "extra_s_per_row": round(b, 5), "hop_fixed_extra_s": round(extra, 5),
                            "hop_s_per_row": round(per_row, 5)},
            "cells": len(out), "median_abs_error": round(statistics.median(errors), 3),
            "max_abs_error": round(max(errors), 3), "median_abs_error_by": by, "predictions": out}


# A 70B-class Llama on consumer cards whose decode is bound by reading the weights once per step; the
# split is `swarm plan`'s own (swarm.model.plan) over Llama-3-70B's published config in configs/.
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama-3-70b"
CARD = {"name": "rtx4090", "bytes": 24 * 10 ** 9, "bandwidth_bytes_s": 1008e9}
EFFICIENCY = 0.7  # of the card's bandwidth a decode step reaches (kernels, launches, norms)
UPLINK_BITS_S = 100e6  # a volunteer's upload: a bfloat16 row (2 x 8192 bytes) takes 1.3 ms a hop
KV_TOKENS, RESERVE = 4096, 10 ** 9  # swarm plan's defaults: one 4,096-position session, 1 GB kept per card


def gpu_grid() -> dict:
    """The model's tokens/s of a 70B ring of 4090s over RTT, K, depth and acceptance, split by ``swarm plan``."""
    sys.path.insert(0, str(CONFIG.parents[1]))
    from swarm.errors import ConfigError
    from swarm.model.plan import footprint, model_shapes, split

    shapes = model_shapes(CONFIG)
    hidden = shapes.config["hidden_size"]
    rows = []
    for quant in ("int4", "int8", "bfloat16"):
        fp = footprint(shapes, quant)
        for cards in range(1, 64):
            try:
                placed = [p for p in split(fp, [CARD["bytes"]] * cards, kv_tokens=KV_TOKENS, reserve=RESERVE)
                          if p.layers is not None]
                break
            except ConfigError:
                continue
        step = max(fp.layers_bytes(p.layers) for p in placed) / (CARD["bandwidth_bytes_s"] * EFFICIENCY)

        def step_s(n: int, step=step) -> float:
            return step * (1 + 0.01 * (n - 1))  # memory-bound: a few more rows cost little

        for rtt_ms in (1, 20, 60, 120):
            ring = Ring(len(placed), rtt_ms / 2000, step_s, hop_row_s=2 * hidden * 8 / UPLINK_BITS_S,
                        overhead_s=0.002)
            for k, depth, accept in ((0, 1, 0.0), (4, 1, 0.6), (4, 2, 0.6), (8, 2, 0.7), (8, 4, 0.8)):
                rows.append({"weights": quant, "stages": len(placed),
                             "layers": [f"{p.layers.start}:{p.layers.end}" for p in placed],
                             "stage_step_ms": round(1000 * step, 1), "rtt_ms": rtt_ms, "k": k, "depth": depth,
                             "accept": accept, "tokens_per_s": round(tokens_per_s(ring, k, depth, accept), 1)})
    return {"model": str(CONFIG.relative_to(CONFIG.parents[1])), "card": CARD, "efficiency": EFFICIENCY,
            "uplink_bits_s": UPLINK_BITS_S, "coordinator_s": 0.002, "kv_tokens": KV_TOKENS,
            "reserve_bytes": RESERVE, "grid": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", type=Path, help="a bench/spec_ring.py JSONL to check the model against")
    ap.add_argument("--gpus", action="store_true", help="print the 70B consumer-GPU grid")
    ap.add_argument("--stages", type=int, default=3, help="stages of the measured ring (default 3)")
    ap.add_argument("--cores", type=int, default=2, help="cores the measured ring's stages shared (default 2)")
    args = ap.parse_args(argv)
    if not args.validate and not args.gpus:
        ap.error("give --validate FILE.jsonl and/or --gpus")
    out = {}
    if args.validate:
        out["validation"] = validate(args.validate, args.stages, args.cores)
    if args.gpus:
        out["gpus"] = gpu_grid()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

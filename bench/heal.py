"""Mid-generation heal on SmolLM2-135M: 3 stages + 1 warm spare, kill the middle stage.

Each trial starts a fresh ring of real ``swarm stage`` processes (1 torch thread each) plus one
spare for layers [10, 20), sends a 512-token prompt, SIGKILLs the middle stage after 64 committed
tokens, and lets the coordinator heal and finish 96 tokens. It checks the ids equal an
uninterrupted run and prints one JSON object with the medians over the trials (seconds):
detection (kill -> the coordinator notices), locate + swap (probe, dial the spare, reopen the
session), replay (re-feed prompt + committed output in prefill chunks), and total disruption
(kill -> the next committed token, minus one normal token time), and which replay the heal took
(``survivors_kept``: only the spare rebuilt its KV from the hidden states the predecessor resent,
each survivor recomputed one position; ``shadow``, with ``--shadow``: the spare had shadowed the
middle stage live, its predecessor mirroring every frame to it, so it was promoted with
``refill_tokens`` (usually 0) to rebuild; ``full``: every stage replayed). Target: total under 1 s.
Usage: python bench/heal.py [--trials 5] [--shadow | --full-replay] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.config import RingSpec, StageSpec  # noqa: E402
from swarm.coordinator.decoding import DecodeOptions, decode  # noqa: E402
from swarm.errors import collapse  # noqa: E402
from swarm.cli.launch import LocalRing  # noqa: E402
from swarm.model.block import model_num_layers  # noqa: E402
from swarm.model.resolve import model_manifest_digest, resolve_model  # noqa: E402
from swarm.ranges import even_split  # noqa: E402
from swarm.coordinator.ring import RingClient  # noqa: E402
from swarm.transport import load_or_create_key, open_host  # noqa: E402

TEXT = ("The history of the lighthouse is a history of trade, weather and human stubbornness. "
        "Long before electric lamps, keepers tended fires and oil lamps through the night, ") * 40


async def generate(spec, model_dir, prompt, new_tokens, key, on_ids=None, shadow=False):
    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring = RingClient(host, spec, 60.0, 30.0, heartbeat_s=1.0)
        await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
        decoded = await decode(ring, prompt, DecodeOptions(new_tokens, shadow=shadow), on_ids=on_ids)
        out, rec = decoded.output_ids, decoded.as_record()
        nursery.cancel_scope.cancel()
    return out, rec


def trial(model: str, model_dir: Path, prompt: list[int], new_tokens: int, kill_at: int, tmp: Path,
          full: bool = False, shadow: bool = False, threads: int = 1) -> dict:
    n = model_num_layers(model_dir)
    ranges = even_split(n, 3)
    keep = ["--heal-log-mb", "0"] if full else []  # the predecessor keeps nothing: a full replay
    with LocalRing(model, ranges, tmp / "keys", threads=threads, extra_args=["--dtype", "float32", *keep]) as ring, \
            LocalRing(model, [ranges[1]], tmp / "spare-keys", threads=threads,
                      extra_args=["--dtype", "float32"]) as spare:
        spec = RingSpec(model=model, stages=tuple(StageSpec(s.addr, s.layers) for s in ring.stages),
                        spares=(StageSpec(spare.stages[0].addr, ranges[1]),))
        key = load_or_create_key(tmp / "c.key")
        commits: list[tuple[int, float]] = []
        kill = {}

        def on_ids(out):
            now = time.monotonic()
            commits.append((len(out), now))
            if len(out) == kill_at and not kill:
                os.kill(ring.stages[1].proc.pid, signal.SIGKILL)
                kill["t"] = time.monotonic()

        try:
            try:
                out, rec = trio.run(generate, spec, model_dir, prompt, new_tokens, key, on_ids, shadow)
            except BaseExceptionGroup as group:
                raise collapse(group) from None
        except Exception:
            print("spare's log (last lines):\n  " + "\n  ".join(spare.stages[0].stderr_tail[-15:]), file=sys.stderr)
            raise
    (event,) = rec["heal_events"]
    token_gaps = [b[1] - a[1] for a, b in zip(commits, commits[1:]) if b[0] <= kill_at]
    normal = statistics.median(token_gaps) if token_gaps else 0.0
    after = next(t for count, t in commits if count > kill_at)
    return {"ids": out, "detection_s": event["detected_at"] - kill["t"], "locate_s": event["detect_s"],
            "swap_s": event["swap_s"], "replay_s": event["replay_s"], "replay_tokens": event["replay_tokens"],
            "survivor_tokens": event.get("survivor_tokens"), "refill_tokens": event.get("refill_tokens"),
            "replay": event.get("replay", "full"), "total_disruption_s": after - kill["t"] - normal,
            "normal_token_s": normal, "decode_tokens_per_s": rec["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--kill-at", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--full-replay", action="store_true",
                    help="stages keep no sent hidden states (--heal-log-mb 0): measure the full replay instead")
    ap.add_argument("--shadow", action="store_true",
                    help="the spare shadows the middle stage live (DecodeOptions(shadow=True)): the heal promotes it")
    ap.add_argument("--threads", type=int, default=1,
                    help="--threads of every stage and the spare (a ring computes one stage at a time, so each "
                         "may use the machine's cores; default 1)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(resolved.path))
    prompt = list(tok(TEXT)["input_ids"])[: args.prompt_tokens]
    import torch

    # the uninterrupted reference: transformers greedy in this process
    ref_model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=torch.float32).eval()
    ref = ref_model.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False)[0, len(prompt):].tolist()
    del ref_model
    rows = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            row = trial(args.model, resolved.path, prompt, args.new_tokens, args.kill_at, Path(tmp), args.full_replay,
                        args.shadow, args.threads)
        row["identical"] = row.pop("ids") == ref
        rows.append(row)
        print(json.dumps({"trial": i, **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}),
              file=sys.stderr)
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0] if k not in ("identical", "replay")}
    print(json.dumps({"model": resolved.name, "trials": args.trials, "prompt_tokens": len(prompt),
                      "killed_after_tokens": args.kill_at, "shadow": args.shadow, "threads": args.threads,
                      "all_identical": all(r["identical"] for r in rows),
                      "replay": sorted({r["replay"] for r in rows}), "median": med,
                      "target_total_disruption_s": 1.0}))


if __name__ == "__main__":
    main()

"""Compute audits: how fast each cheat is caught, false accusations, what an audit costs (issue 29).

Prints one JSON object:

- ``cheats``: per cheat kind of tests/support/cheats.py and per rate ``s`` (5%, 10%), over
  ``--trials`` seeded trials: ``caught_fraction_within_n`` (caught within the first ``n`` cheated
  sessions, where the theory 1-(1-s)^n first reaches 95%: 59 at 5%, 29 at 10%), the theory at that
  ``n``, ``cheated_sessions_until_caught`` (median, mean, p95: cheated sessions up to and including
  the one whose audit caught it), ``sessions_until_caught`` (all the identity's sessions, honest ones
  too) and ``detected_per_audited_cheat`` (audits of a cheated session that failed it). Every kind
  sees the same seeded draws (common random numbers), so kinds caught at every audit agree exactly;
- ``false_accusations``: failed verdicts over ``--honest`` audited sessions of an honest stage (must be 0);
- ``auditor_cost``: seconds per audited position (the re-run and the checks of the openings) over the
  stage's own decode seconds per position;
- ``ring``: decode tokens/s of a 2-stage ring of ``swarm stage`` processes (libp2p on loopback) with
  and without an auditor process, side by side, interleaved, under ``--audit-load``: ``per-job`` (the
  product's ``Auditor.audit_job`` at rate 1, as every session of a new identity is audited: the picked
  window and those before it of each stage, re-run and checked, one job audited per job the ring
  serves; the steady 5% rate is 1/20 of it) or ``stress`` (every window of every stage of a job opened
  once a second, nothing re-run: about 5x the openings of ``per-job`` here).

What is simulated (``simulated``): the detection trials and false accusations run the product's audit
code (``swarm.openings`` window logs, commitments, signed openings and their checks; ``swarm.proofs.pick``
on signed job receipts; ``swarm.auditor.judge.judge``, which re-runs the block and builds the proof;
``verify_proof`` on every proof) on in-process stories260k blocks (predecessor [0, 1), audited stage
[1, 3)), without the network: a session is a prompt chunk and a few decode steps of seeded random
tokens, and only sessions the hash picks are computed (the others only advance the cheat's session
count). ``ulp`` changes one value at one position in every session (the smallest per-session cheat);
``replay`` computes its first session (honestly) and sends its outputs in every later one. The steady
cheats run at the bare rate (no first-sessions rule, to compare with the theory);
``intermittent`` runs with the default 100% audit of an identity's first 20 sessions, which it evades
by being honest for exactly those.

Usage: python bench/audit.py [--trials 200] [--honest 1000] [--tokens 48] [--rounds 3] [--parts trials,honest,cost,ring]
       [--audit-load per-job|stress]
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
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm import openings, proofs, receipts, wire  # noqa: E402
from swarm.auditor.judge import Blocks, judge, verify_proof  # noqa: E402
from swarm.kernels.facts import stage_class  # noqa: E402
from swarm.model.block import load_block  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402
from swarm.transport.identity import peer_id_of, sign  # noqa: E402
from bench.transport import process_cpu_s  # noqa: E402
from tests.support.cheats import KINDS, cheat  # noqa: E402

MODEL = ROOT.parent / "shared" / "models" / "stories260k"
PRED, STAGE = LayerRange(0, 1), LayerRange(1, 3)
PROMPT_LEN, DECODE = 12, 4


def _key(name: str):
    """A fixed ed25519 identity per role, so the trials' job signatures and draws repeat run after run."""
    import hashlib

    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair(hashlib.sha256(b"bench/audit " + name.encode()).digest())


class Sim:
    """One predecessor and one audited stage (optionally cheating), signing receipts as stages do."""

    def __init__(self, keys: Path, kind: str | None, seed: int):
        self.pred = load_block(MODEL, PRED, dtype="float32", device="cpu")
        self.stage = load_block(MODEL, STAGE, dtype="float32", device="cpu")
        self.double = cheat(self.stage, kind, seed=seed, position=PROMPT_LEN + 1, session=None) if kind else None
        self.pkey, self.skey, self.coord = _key("pred"), _key("stage"), _key("coordinator")
        self.rng = torch.Generator().manual_seed(seed)

    def job_sig(self, trial: int, n: int) -> str:
        body = {"schema": receipts.JOB_SCHEMA, "trial": trial, "session": n}
        return receipts.sign_receipt(body, lambda d: sign(self.coord, d))["sig"]

    def session(self, job: str) -> tuple:
        """Compute one session at both stages; return each one's (signed receipt, raw openings, openings)."""
        n = PROMPT_LEN + DECODE
        ids = torch.randint(1, 500, (n,), generator=self.rng).tolist()
        pc, sc = self.pred.new_cache(n), self.stage.new_cache(n)
        logs = (openings.WindowLog(), openings.WindowLog())
        chunks = [(0, PROMPT_LEN)] + [(PROMPT_LEN + i, 1) for i in range(DECODE)]
        for pos, t in chunks:
            (h,) = self.pred.forward_batch([(pc, pos, torch.tensor([ids[pos:pos + t]]))])
            hmap = wire.encode_tensor(h)
            logs[0].record_chunk({"pos": pos, "tokens": ids[pos:pos + t]}, hmap)
            (y,) = self.stage.forward_batch([(sc, pos, wire.decode_tensor(hmap))])
            logs[1].record_chunk({"pos": pos, "hidden": hmap}, wire.encode_tensor(y))
        return tuple(self._signed(b, key, log, job) for b, key, log in
                     ((self.pred, self.pkey, logs[0]), (self.stage, self.skey, logs[1])))

    def _signed(self, block, key, log, job: str):
        c = openings.Commitment(log.snapshot())
        body = receipts.StageLedger(job, "n" * 32).body(
            session="s-" + job, coordinator="c", peer_id=peer_id_of(key), model="stories260k", model_digest="d",
            range_digest=block.digest_of(), layers=block.layer_range.as_list(), num_layers=block.num_layers,
            dtype="float32", wire_dtype="float32", positions=len(log), repro=stage_class(block).as_dict(),
            windows=c.field())
        r = receipts.sign_receipt(body, lambda d: sign(key, d))
        raw = [openings.sign_opening(openings.opening_body(r, c, k), lambda d: sign(key, d)) for k in range(len(c.tree))]
        return r, raw, [openings.check_opening(r, o, k) for k, o in enumerate(raw)]


def audit_once(sim: Sim, auditor_block, akey, job: str):
    (pr, praw, pop), (sr, sraw, sop) = sim.session(job)
    return judge(auditor_block, sr, sop, sraw, (pr, pop, praw), sampled=False, auditor=peer_id_of(akey),
                 sign=lambda d: sign(akey, d), now_ms=0)


def trials(kind: str, rate: float, count: int, keys: Path, blocks: Blocks, akey) -> dict:
    first = proofs.FIRST_SESSIONS if kind == "intermittent" else 0
    cap = 20000 if kind == "intermittent" else 2000
    until, sessions, audited_cheats, detected, proofs_ok = [], [], 0, 0, 0
    auditor_block = blocks.get(STAGE.as_list(), "float32")
    for t in range(count):
        sim = Sim(keys, kind, seed=1000 * t + int(rate * 100))
        peer = peer_id_of(sim.skey)
        if kind == "replay":  # the replayer's first session is computed (honestly): what it replays later
            sim.session(f"t{t}-first")
        cheats = 0  # cheated sessions so far
        for n in range(cap):
            choice = proofs.pick(sim.job_sig(t, n), peer, 1, rate=rate, seen=n, first_sessions=first)
            if not choice.audit:
                cheats += sim.double.unseen()
                continue
            v = audit_once(sim, auditor_block, akey, f"t{t}-n{n}")
            cheated = sim.double.sessions - 1 in sim.double.cheated
            cheats += cheated
            audited_cheats += cheated
            if v.outcome == "failed":
                detected += cheated
                verify_proof(v.proof, blocks)  # raises if the proof would not hold
                proofs_ok += 1
                until.append(cheats)
                sessions.append(n + 1)
                break
        else:
            until.append(math.inf)
    n_theory = math.ceil(math.log(0.05) / math.log(1 - rate))
    return {"rate": rate, "trials": count, "n": n_theory, "theory": round(1 - (1 - rate) ** n_theory, 4),
            "caught_fraction_within_n": round(sum(u <= n_theory for u in until) / count, 4),
            "caught_fraction": round(sum(u != math.inf for u in until) / count, 4),
            "cheated_sessions_until_caught": _spread([u for u in until if u != math.inf]),
            "sessions_until_caught": _spread(sessions),
            "detected_per_audited_cheat": round(detected / audited_cheats, 4) if audited_cheats else None,
            "audited_cheats": audited_cheats, "proofs_verified": proofs_ok, "first_sessions": first}


def _spread(xs: list) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"median": None, "mean": None, "p95": None}
    p95 = xs[int(0.95 * (len(xs) - 1))]
    return {"median": statistics.median(xs), "mean": round(statistics.fmean(xs), 2), "p95": p95}


def honest(count: int, keys: Path, blocks: Blocks, akey) -> dict:
    sim = Sim(keys, None, seed=7)
    block = blocks.get(STAGE.as_list(), "float32")
    failed = sum(audit_once(sim, block, akey, f"h{i}").outcome != "passed" for i in range(count))
    return {"audited_sessions": count, "false_accusations": failed}


def cost(keys: Path, blocks: Blocks, akey, positions: int = 64) -> dict:
    """Seconds per position: the stage decoding one position at a time vs an auditor re-running them."""
    sim = Sim(keys, None, seed=3)
    x = wire.decode_tensor(wire.encode_tensor(torch.randn(1, positions, sim.stage.hidden_size)))
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        c = sim.stage.new_cache(positions)
        for p in range(positions):
            sim.stage.forward_batch([(c, p, x[:, p:p + 1])])
    decode_s = (time.perf_counter() - t0) / (reps * positions)
    global PROMPT_LEN, DECODE
    saved = PROMPT_LEN, DECODE
    PROMPT_LEN, DECODE = positions - 8, 8
    block = blocks.get(STAGE.as_list(), "float32")
    spent = []
    try:
        for i in range(reps):
            (pr, praw, pop), (sr, sraw, sop) = sim.session(f"c{i}")
            t0 = time.perf_counter()
            judge(block, sr, sop, sraw, (pr, pop, praw), sampled=False, auditor=peer_id_of(akey),
                  sign=lambda d: sign(akey, d), now_ms=0)
            spent.append((time.perf_counter() - t0) / positions)
    finally:
        PROMPT_LEN, DECODE = saved
    audit_s = statistics.median(spent)
    return {"stage_decode_s_per_position": round(decode_s, 6), "auditor_s_per_position": round(audit_s, 6),
            "fraction": round(audit_s / decode_s, 4), "positions": positions}


def _ring_run(tokens: int, rounds: int, tmp: Path, load: str) -> dict:
    """Decode tokens/s of a 2-stage ring of ``swarm stage`` processes, alternating runs without and with
    an auditor process auditing an earlier job (``load``: see the module docstring)."""
    import subprocess

    from swarm.cli.launch import LocalRing
    from tests.support.ring import signed_job

    runs = {"off": [], "on": []}
    outcomes: list[str] = []  # what the auditor process did: per-job verdicts, or "opened" / "audit" (refused)
    cpu = {"off": [], "on": []}  # the stages' CPU milliseconds per token of each run (machine noise hardly moves it)
    prompt = list(range(5, 5 + 70))
    with LocalRing(str(MODEL), [LayerRange(0, 2), LayerRange(2, 5)], tmp / "keys", threads=1,
                   extra_args=["--dtype", "float32"]) as ring:
        spec = ring.ring_spec()
        first = trio.run(signed_job, spec, MODEL, tmp, prompt, tmp / "r", tokens)
        job = tmp / "first-job.json"
        job.write_text(json.dumps(first["doc"]))
        every_s = tokens / first["doc"]["tokens_per_s"] if load == "per-job" else 1.0  # one job's time: one audit
        for mode in ["off", "on", "on", "off"] * rounds:
            opener = None
            if mode == "on":
                # at the lowest CPU priority: an auditor runs on its own machine, so its own checks should
                # not be what slows the ring here (the stages' answers to it are what is measured)
                opener = subprocess.Popen(["nice", "-n", "19", sys.executable, __file__, "--open-loop", str(job),
                                           "--audit-load", load, "--audit-every-s", str(every_s)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                seen = []
                for line in opener.stderr:  # wait until it is opening windows (its imports take seconds)
                    seen.append(line)
                    if line.startswith(("opened", "audited")):
                        outcomes.extend(line.split()[1:] if line.startswith("audited") else ["opened"])
                        break
                else:
                    raise RuntimeError(f"the auditor process opened nothing: {''.join(seen)[-500:]}")
            before = sum(process_cpu_s(sp.proc.pid) for sp in ring.stages)
            try:
                res = trio.run(signed_job, spec, MODEL, tmp, prompt, tmp / "r", tokens)
                cpu[mode].append(1000 * (sum(process_cpu_s(sp.proc.pid) for sp in ring.stages) - before) / tokens)
            finally:
                if opener is not None:
                    opener.terminate()
                    rest = opener.communicate(timeout=30)[1]
                    outcomes.extend(w for line in rest.splitlines() if line.startswith(("opened", "audited", "audit refused"))
                                    for w in (line.split()[1:] if line.startswith("audited") else [line.split()[0]]))
            runs[mode].append(res["doc"]["tokens_per_s"])
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    # each "on" run sits next to an "off" run (off, on, on, off): their ratio cancels the machine's drift
    paired = [a / b for a, b in zip(runs["on"], runs["off"])]
    return {"tokens_per_s_without_audits": round(off, 2), "tokens_per_s_with_audits": round(on, 2),
            "change_pct": round(100 * (on - off) / off, 2),
            "paired_ratio_median": round(statistics.median(paired), 4),
            "paired_ratio_geomean": round(statistics.geometric_mean(paired), 4),
            "paired_ratios": [round(r, 3) for r in paired], "runs": runs, "tokens": tokens,
            "stages_cpu_ms_per_token_without_audits": round(statistics.median(cpu["off"]), 4),
            "stages_cpu_ms_per_token_with_audits": round(statistics.median(cpu["on"]), 4),
            "stages_cpu_change_pct": round(100 * (statistics.median(cpu["on"]) / statistics.median(cpu["off"]) - 1), 2),
            "cpu_runs": {k: [round(x, 4) for x in v] for k, v in cpu.items()},
            "audit_load": load, "audit_every_s": round(every_s, 3),
            "auditor_outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
            "note": "stages are `swarm stage` processes (1 thread each), the coordinator this process; with audits "
                    "an auditor process (nice 19: its own work stands for another machine's) on the same 2 cores: "
                    + ("the product's Auditor.audit_job at rate 1 (a new identity's first sessions) on an earlier "
                       "job every audit_every_s (one job's duration): the picked window and those before it of "
                       "each stage, re-run and checked; the steady 5% rate is 1/20 of this load" if load == "per-job"
                       else "every window of every stage of an earlier job opened once a second, not re-run")}


async def _open_loop(job_path: Path, load: str, every_s: float) -> None:
    """``--open-loop``: the auditor process of the ring part, until terminated: every ``every_s`` seconds
    either open every window of every stage of a job (``stress``) or audit it as the product's auditor
    does at rate 1 (``per-job``)."""
    from swarm.auditor.run import Auditor
    from swarm.errors import SwarmError
    from swarm.transport import open_host
    from tests.support.ring import LOOPBACK

    job = json.loads(job_path.read_text())
    akey = _key("opener")
    async with open_host(akey, [LOOPBACK]) as host:
        opener = Auditor(host, akey, Blocks(MODEL), rate=1.0, all_windows=load == "stress")
        while True:
            if load == "per-job":
                verdicts = await opener.audit_job(job)
                print("audited", " ".join(v.outcome.replace(" ", "_") for v in verdicts), file=sys.stderr, flush=True)
                await trio.sleep(every_s)
                continue
            for r, entry in zip(job["stage_receipts"], job["ring"]):
                try:
                    await opener._open(entry["addr"], r, r["windows"]["leaves"] - 1)
                    print("opened", r["windows"]["leaves"], "windows", file=sys.stderr, flush=True)
                except SwarmError as exc:  # a refusal (the rate limit) is the stage protecting itself
                    print(f"audit refused: {exc}", file=sys.stderr, flush=True)
            await trio.sleep(every_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--honest", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--audit-load", choices=("per-job", "stress"), default="per-job",
                    help="the ring part's audits: per-job (the product's auditor at rate 1, one job audited per "
                         "job served, as for a new identity) or stress (every window of a job opened every second)")
    ap.add_argument("--audit-every-s", type=float, default=1.0, help=argparse.SUPPRESS)  # the auditor process's pace
    ap.add_argument("--open-loop", type=Path, metavar="JOB", help=argparse.SUPPRESS)  # the ring part's auditor
    ap.add_argument("--parts", default="trials,honest,cost,ring",
                    help="which parts to run (comma-separated): the cheats' trials, the honest sessions, the "
                         "auditor's cost, the ring's tokens/s with and without audits (default: all)")
    args = ap.parse_args(argv)
    if args.open_loop:
        try:
            trio.run(_open_loop, args.open_loop, args.audit_load, args.audit_every_s)
        except KeyboardInterrupt:
            pass
        return 0
    parts = set(args.parts.split(","))
    if not parts <= {"trials", "honest", "cost", "ring"}:
        ap.error(f"--parts takes trials, honest, cost and ring, got {args.parts!r}")
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        blocks, akey = Blocks(MODEL), _key("auditor")
        out = {"bench": "audit", "model": "stories260k", "simulated": __doc__.split("What is simulated")[1]
               .split("Usage:")[0].strip().replace("\n", " "), "cheats": {}}
        for kind in args.kinds.split(",") if "trials" in parts else []:
            out["cheats"][kind] = [trials(kind, s, args.trials, tmp, blocks, akey) for s in (0.05, 0.10)]
        if "honest" in parts:
            out["false_accusations"] = honest(args.honest, tmp, blocks, akey)
        if "cost" in parts:
            out["auditor_cost"] = cost(tmp, blocks, akey)
        if "ring" in parts:
            out["ring"] = _ring_run(args.tokens, args.rounds, tmp, args.audit_load)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

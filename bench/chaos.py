"""Chaos soak: real stages killed, frozen and restarted under load; no request lost, no output changed.

Starts a bootstrap node and ``--stages`` (default 12) real ``swarm stage`` processes of stories260k
(1 torch thread each, ``--metrics-listen`` on loopback) holding overlapping blocks of 1-3 layers, so
every layer has several holders. ``--clients`` (default 4) client threads each run requests back to
back for ``--minutes``: every request is one ``swarm coordinate --model M --bootstrap B --json``
process (the product's client that names only the model: it routes over the DHT's records and
heals from them), greedy, on one of ``PROMPTS``. Meanwhile, every ``--fault-every-s`` (jittered
0.5x-1.5x) one random stage that is up gets a fault:

- ``kill``: SIGKILL; the volunteer brings it back 3-12 s later under the same key file (same PeerId,
  new port);
- ``stop``: SIGSTOP for 2-6 s, then SIGCONT (a frozen machine that recovers);
- ``restart``: SIGTERM (the stage drains: running sessions may finish) and, once it exited, start
  again at once under the same key.

A fault is never put on a stage whose absence would leave a layer with no holder up (a swarm that
lost every holder of a layer cannot answer, which is not what this measures), and at most
``--max-faulted`` stages are faulted at once. Before anything starts, the solo reference of every
prompt is computed in this process with transformers (greedy ``generate`` on the same weights,
float32): every output must equal it token for token.

At the end (faults stopped, every stage up again, clients done) each stage's metrics must show
0 open sessions and 0 KV bytes within ``--idle-wait-s``, and a stage process that served the whole
soak must not have grown its RSS by more than ``--rss-growth-mb``.

Prints one JSON object (and writes it to ``--out``): faults by kind, requests completed / lost /
different from solo, heals, per-stage sessions, KV and RSS at the end, wall time, load average.
Acceptance (issue 31): at least 100 faults, 0 requests lost, 0 outputs different from solo.

Usage: python bench/chaos.py [--minutes 10] [--stages 12] [--clients 4] [--fault-every-s 4] [--out FILE]

Every child (stages, bootstrap node, clients) runs in its own process group and is reaped on every
exit path, a stopped stage is continued first so it can act on its SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.cli.launch import BootstrapNode, LocalRing, start_swarm  # noqa: E402
from swarm.errors import StageLost  # noqa: E402
from swarm.ranges import LayerRange  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a bird",
           "Tom had a red ball", "The sun was hot and", "A big bear lived", "Sue liked to sing"]
# 12 overlapping blocks of stories260k's 5 layers: holders per layer 4, 7, 8, 7, 4
BLOCKS = [(0, 2), (0, 2), (0, 3), (0, 3), (1, 3), (1, 4), (2, 4), (2, 5), (2, 5), (3, 5), (3, 5), (1, 4)]
KINDS = ("kill", "stop", "restart")


def blocks_for(count: int, num_layers: int) -> list[LayerRange]:
    """``count`` overlapping blocks: ``BLOCKS`` repeated (clipped to ``num_layers``)."""
    out = []
    for i in range(count):
        start, end = BLOCKS[i % len(BLOCKS)]
        out.append(LayerRange(min(start, num_layers - 1), min(end, num_layers)))
    return out


def solo_references(model_dir: Path, prompts: list[str], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy new ids) per prompt: the product's tokenization (``encode_prompt``, no
    chat template) and one transformers process, float32, stopping at EOS as ``swarm coordinate`` does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.coordinator.generation import encode_prompt, eos_ids

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stop = sorted(eos_ids(model_dir, tok))
    out = []
    for text in prompts:
        ids = encode_prompt(tok, text, chat=False)
        gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=stop,
                             pad_token_id=0)[0, len(ids):].tolist()
        out.append((ids, gen))
    return out


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB from /proc (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def read_metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The unlabelled gauges of a stage's /metrics page (``swarm_stage_sessions_open``, ...)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


@dataclass
class Slot:
    """One stage position of the soak: its block, key directory (same key across restarts), process."""

    index: int
    layers: LayerRange
    key_dir: Path
    ring: LocalRing | None = None
    state: str = "starting"  # up | stopped | down | draining | starting
    starts: int = 0
    rss_first_mb: float | None = None  # of the current process, sampled once it had served a while
    rss_first_at: float = 0.0
    rss_max_mb: float = 0.0
    start_errors: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.ring.stages[0].proc.pid if self.ring and self.ring.stages else None

    @property
    def ready(self) -> dict:
        return self.ring.stages[0].ready if self.ring and self.ring.stages and self.ring.stages[0].ready else {}


class Soak:
    """The swarm under chaos: slots, faults, clients, and what they saw."""

    def __init__(self, args, model: str, num_layers: int, refs, tmp: Path, boot: str):
        self.args, self.model, self.num_layers, self.refs, self.tmp, self.boot = args, model, num_layers, refs, tmp, boot
        self.rng = random.Random(args.seed)
        self.lock = threading.RLock()
        self.slots = [Slot(i, r, tmp / "keys" / f"slot-{i}") for i, r in enumerate(blocks_for(args.stages, num_layers))]
        self.faults = {k: 0 for k in KINDS}
        self.fault_log: list[dict] = []
        self.skipped = 0
        self.results: list[dict] = []
        self.stop_clients = threading.Event()
        self.threads: list[threading.Thread] = []
        self.client_procs: dict[int, object] = {}
        self.env = dict(os.environ)
        self.pending: list[tuple[float, object]] = []

    # ---- stages
    def stage_args(self) -> list[str]:
        return ["--dtype", "float32", "--bootstrap", self.boot, "--metrics-listen", "127.0.0.1:0"]

    def start_slot(self, slot: Slot) -> None:
        """Start (or restart) ``slot``'s stage under its key; blocks until READY (run in a thread)."""
        try:
            ring = LocalRing(self.model, [slot.layers], slot.key_dir, threads=1, extra_args=self.stage_args(),
                             startup_timeout_s=180, env=self.env)
            with self.lock:
                slot.ring = ring
            ring.start()
        except StageLost as exc:
            slot.start_errors.append(str(exc))
            ring.stop()
            with self.lock:
                slot.state = "down"
            self.later(5.0, lambda: self._restart_thread(slot))  # try again, as a volunteer would
            return
        with self.lock:
            slot.state, slot.starts = "up", slot.starts + 1
            slot.rss_first_mb, slot.rss_first_at = None, time.monotonic() + self.args.rss_settle_s

    def _restart_thread(self, slot: Slot) -> None:
        with self.lock:
            slot.state = "starting"
        t = threading.Thread(target=self.start_slot, args=(slot,), daemon=True)
        t.start()
        self.threads.append(t)

    def later(self, delay_s: float, action) -> None:
        with self.lock:
            self.pending.append((time.monotonic() + delay_s, action))

    def run_due(self) -> None:
        now = time.monotonic()
        with self.lock:
            due = [a for a in self.pending if a[0] <= now]
            self.pending = [a for a in self.pending if a[0] > now]
        for _, action in due:
            action()

    def coverage_ok_without(self, victim: Slot) -> bool:
        up = [s for s in self.slots if s.state == "up" and s is not victim]
        return all(any(s.layers.start <= layer < s.layers.end for s in up) for layer in range(self.num_layers))

    def inject(self) -> None:
        """One fault on a random stage that is up and whose absence leaves every layer a holder."""
        with self.lock:
            faulted = sum(s.state != "up" for s in self.slots)
            candidates = [s for s in self.slots if s.state == "up" and self.coverage_ok_without(s)]
            if faulted >= self.args.max_faulted or not candidates:
                self.skipped += 1
                return
            slot = self.rng.choice(candidates)
            kind = self.rng.choices(KINDS, weights=self.args.weights)[0]
            pid = slot.pid
            self.faults[kind] += 1
            self.fault_log.append({"t": round(time.monotonic() - self.t0, 2), "kind": kind, "slot": slot.index,
                                   "layers": slot.layers.as_list(), "pid": pid})
            if kind == "kill":
                slot.state = "down"
                os.killpg(pid, signal.SIGKILL)
                slot.ring.stop(grace_s=5)  # reaps it
                self.later(self.rng.uniform(3, 12), lambda: self._restart_thread(slot))
            elif kind == "stop":
                slot.state = "stopped"
                os.killpg(pid, signal.SIGSTOP)
                self.later(self.rng.uniform(2, 6), lambda: self._cont(slot, pid))
            else:
                slot.state = "draining"
                t = threading.Thread(target=self._drain_and_restart, args=(slot,), daemon=True)
                t.start()
                self.threads.append(t)

    def _cont(self, slot: Slot, pid: int) -> None:
        with self.lock:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            if slot.state == "stopped" and slot.pid == pid:
                slot.state = "up"

    def _drain_and_restart(self, slot: Slot) -> None:
        slot.ring.stop(grace_s=self.args.drain_grace_s)  # SIGTERM: drain, exit 0 (SIGKILL after the grace)
        code = slot.ring.stages[0].proc.returncode
        if code != 0:
            slot.start_errors.append(f"drain exit code {code}")
        self._restart_thread(slot)

    def sample_rss(self) -> None:
        now = time.monotonic()
        with self.lock:
            for s in self.slots:
                if s.state != "up" or s.pid is None:
                    continue
                rss = rss_mb(s.pid)
                if rss is None:
                    continue
                if s.rss_first_mb is None and now >= s.rss_first_at:
                    s.rss_first_mb = rss
                s.rss_max_mb = max(s.rss_max_mb, rss)

    # ---- clients
    def client(self, cid: int) -> None:
        n = 0
        key = self.tmp / f"client-{cid}.key"
        while not self.stop_clients.is_set():
            p = (cid + n * self.args.clients) % len(self.refs)
            n += 1
            self.results.append(self.request(cid, p, key))

    def request(self, cid: int, p: int, key: Path) -> dict:
        prompt_ids, ref = self.refs[p]
        argv = ["coordinate", "--model", self.model, "--bootstrap", self.boot, "--prompt", PROMPTS[p],
                "--max-new-tokens", str(self.args.new_tokens), "--json", "--key", str(key),
                "--receipt-dir", str(self.tmp / "receipts")]
        t = time.monotonic()
        proc = start_swarm(argv, self.env)
        self.client_procs[cid] = proc
        out, err = [], []
        readers = [threading.Thread(target=lambda f, acc: acc.extend(f), args=(proc.stdout, out), daemon=True),
                   threading.Thread(target=lambda f, acc: acc.append(f.read()), args=(proc.stderr, err), daemon=True)]
        for r in readers:
            r.start()
        row = {"client": cid, "prompt": p, "t": round(t - self.t0, 2)}
        try:
            code = proc.wait(timeout=self.args.request_timeout_s)
        except Exception:  # subprocess.TimeoutExpired, or the zygote's equivalent
            code = None
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for r in readers:
            r.join(5)
        row["wall_s"] = round(time.monotonic() - t, 2)
        if code is None:
            row.update(ok=False, error=f"hung: no answer within {self.args.request_timeout_s} s")
        elif code != 0:
            tail = "".join(err).strip().splitlines()[-3:]
            row.update(ok=False, error=f"exit {code}: " + " | ".join(tail))
        else:
            try:
                res = json.loads(out[-1])
            except (IndexError, ValueError):
                row.update(ok=False, error="no JSON on stdout")
                return row
            row.update(ok=True, same=res["output_ids"] == ref and res["prompt_ids"] == prompt_ids,
                       new_tokens=res["new_tokens"], heals=len(res.get("heal_events", [])),
                       route_s=res.get("route_s"), ring=[e["layers"] for e in res["ring"]],
                       heal_kinds=[e.get("replay") for e in res.get("heal_events", [])])
            if not row["same"]:
                row["output_ids"], row["ref"] = res["output_ids"], ref
        if not row["ok"]:
            print(f"chaos: request lost: {row}", file=sys.stderr, flush=True)
        return row

    # ---- the run
    def run(self) -> dict:
        self.t0 = time.monotonic()
        starters = [threading.Thread(target=self.start_slot, args=(s,), daemon=True) for s in self.slots]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        down = [s.index for s in self.slots if s.state != "up"]
        if down:
            raise StageLost(f"stages {down} did not start: {[self.slots[i].start_errors for i in down]}")
        started_s = time.monotonic() - self.t0
        print(f"chaos: {len(self.slots)} stages up in {started_s:.1f} s; soaking {self.args.minutes} min",
              file=sys.stderr, flush=True)
        clients = [threading.Thread(target=self.client, args=(c,), daemon=True) for c in range(self.args.clients)]
        for c in clients:
            c.start()
        t_soak = time.monotonic()
        end = t_soak + self.args.minutes * 60
        next_fault = t_soak + self.args.warmup_s
        next_sample, next_note = t_soak, t_soak + 30
        while time.monotonic() < end:
            self.run_due()
            now = time.monotonic()
            if now >= next_fault:
                self.inject()
                next_fault = now + self.args.fault_every_s * self.rng.uniform(0.5, 1.5)
            if now >= next_sample:
                self.sample_rss()
                next_sample = now + 5
            if now >= next_note:
                done = sum(r["ok"] for r in self.results)
                print(f"chaos: {now - t_soak:.0f} s: faults {self.faults} requests ok {done} "
                      f"lost {len(self.results) - done} load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                next_note = now + 30
            time.sleep(0.1)
        soak_s = time.monotonic() - t_soak
        # faults stop: every stage comes back, clients finish their request in flight
        self.stop_clients.set()
        while self.pending or any(s.state != "up" for s in self.slots):
            self.run_due()
            if time.monotonic() - end > 300:
                break
            time.sleep(0.2)
        for c in clients:
            c.join(self.args.request_timeout_s + 10)
        return self.report(started_s, soak_s, self.idle_check())

    def idle_check(self) -> dict:
        """Wait (up to ``--idle-wait-s``) for every stage to show 0 open sessions and 0 KV bytes."""
        t = time.monotonic()
        last = {}
        while True:
            last = {}
            for s in self.slots:
                url = s.ready.get("metrics_url")
                try:
                    m = read_metrics(url) if url else {}
                except OSError as exc:
                    m = {"error": str(exc)}
                last[s.index] = m
            idle = all(m.get("swarm_stage_sessions_open") == 0 and m.get("swarm_stage_kv_used_bytes") == 0
                       for m in last.values())
            if idle or time.monotonic() - t > self.args.idle_wait_s:
                return {"idle": idle, "after_s": round(time.monotonic() - t, 2), "metrics": last}
            time.sleep(1)

    def report(self, started_s: float, soak_s: float, idle: dict) -> dict:
        self.sample_rss()
        rows = self.results
        ok = [r for r in rows if r["ok"]]
        lost = [r for r in rows if not r["ok"]]
        diff = [r for r in ok if not r["same"]]
        stages = []
        for s in self.slots:
            m = idle["metrics"].get(s.index, {})
            rss = rss_mb(s.pid) if s.pid else None
            stages.append({"slot": s.index, "layers": s.layers.as_list(), "peer_id": s.ready.get("peer_id"),
                           "starts": s.starts, "sessions_open": m.get("swarm_stage_sessions_open"),
                           "kv_used_bytes": m.get("swarm_stage_kv_used_bytes"),
                           "rss_mb": round(rss, 1) if rss else None,
                           "rss_first_mb": round(s.rss_first_mb, 1) if s.rss_first_mb else None,
                           "start_errors": s.start_errors[-3:]})
        # a process that served the whole soak (never restarted) must not have grown past the bound
        growth = [st["rss_mb"] - st["rss_first_mb"] for st in stages
                  if st["starts"] == 1 and st["rss_mb"] and st["rss_first_mb"]]
        heals = sum(r.get("heals", 0) for r in ok)
        walls = [r["wall_s"] for r in ok]
        total_faults = sum(self.faults.values())
        result = {
            "model": "stories260k", "stages": len(self.slots), "clients": self.args.clients,
            "blocks": [s.layers.as_list() for s in self.slots], "minutes": self.args.minutes,
            "fault_every_s": self.args.fault_every_s, "new_tokens": self.args.new_tokens,
            "faults": {**self.faults, "total": total_faults, "skipped_no_candidate": self.skipped},
            "requests": {"completed": len(ok), "lost": len(lost), "different_from_solo": len(diff),
                         "with_heal": sum(1 for r in ok if r.get("heals")),
                         "wall_s_p50": round(statistics.median(walls), 2) if walls else None,
                         "wall_s_max": max(walls) if walls else None},
            "heals": heals,
            "lost_examples": lost[:10], "different_examples": diff[:5],
            "idle": {"all_zero": idle["idle"], "after_s": idle["after_s"]},
            "rss_growth_max_mb": round(max(growth), 1) if growth else None,
            "rss_growth_bound_mb": self.args.rss_growth_mb,
            "stages_end": stages,
            "swarm_start_s": round(started_s, 1), "soak_s": round(soak_s, 1),
            "wall_s": round(time.monotonic() - self.t0, 1), "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(), "fault_log_head": self.fault_log[:20],
        }
        result["acceptance"] = {
            "faults_at_least_100": total_faults >= 100, "no_request_lost": not lost,
            "no_output_different": not diff, "sessions_back_to_zero": idle["idle"],
            "rss_bounded": all(g <= self.args.rss_growth_mb for g in growth),
        }
        return result

    def reap(self) -> None:
        """Every child, whatever happened: clients killed, stopped stages continued, stages stopped."""
        self.stop_clients.set()
        for proc in list(self.client_procs.values()):
            if proc.poll() is None:
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for s in self.slots:
            if s.ring is not None and s.pid is not None:
                _killpg(s.pid, signal.SIGCONT)
        for s in self.slots:
            if s.ring is not None:
                s.ring.stop(grace_s=5)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared/models/stories260k"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--stages", type=int, default=12)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fault-every-s", type=float, default=4.0, help="mean seconds between faults (jittered 0.5-1.5x)")
    ap.add_argument("--weights", type=float, nargs=3, default=[1.0, 1.0, 1.0], metavar=("KILL", "STOP", "RESTART"),
                    help="relative frequency of each fault kind")
    ap.add_argument("--max-faulted", type=int, default=3, help="stages faulted (down, frozen, restarting) at once")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--warmup-s", type=float, default=5.0, help="seconds of requests before the first fault")
    ap.add_argument("--request-timeout-s", type=float, default=180.0, help="a request taking longer is lost (hung)")
    ap.add_argument("--drain-grace-s", type=float, default=40.0, help="SIGKILL a draining stage after this")
    ap.add_argument("--idle-wait-s", type=float, default=60.0,
                    help="how long the stages may take to show 0 sessions once the clients are done")
    ap.add_argument("--rss-settle-s", type=float, default=30.0, help="first RSS sample this long after a start")
    ap.add_argument("--rss-growth-mb", type=float, default=64.0, help="bound on a stage process's RSS growth")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from swarm.model.block import model_num_layers
    from swarm.model.resolve import resolve_model

    resolved = resolve_model(args.model)
    num_layers = model_num_layers(resolved.path)
    refs = solo_references(resolved.path, PROMPTS, args.new_tokens)
    os.environ.setdefault("SWARM_ZYGOTE", "1")  # stages and clients fork from one preloaded parent
    os.environ["PYTHONUNBUFFERED"] = "1"  # before the zygote starts: an import-time variable it must share
    with tempfile.TemporaryDirectory(prefix="swarm-chaos-") as tmpdir:
        tmp = Path(tmpdir)
        os.environ["SWARM_CACHE"] = str(tmp / "cache")
        previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            with BootstrapNode(tmp / "boot.key") as boot:
                soak = Soak(args, str(resolved.path), num_layers, refs, tmp, boot.addr)
                try:
                    result = soak.run()
                finally:
                    soak.reap()
        finally:
            signal.signal(signal.SIGTERM, previous)
    text = json.dumps(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

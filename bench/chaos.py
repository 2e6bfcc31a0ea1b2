"""Chaos soak: real stages killed, frozen and restarted under load; no request lost, no output changed.

Starts a bootstrap node and ``--stages`` (default 12) real ``swarm stage`` processes of stories260k
(1 torch thread each, ``--metrics-listen`` on loopback) holding overlapping blocks of 1-3 layers, so
every layer has several holders. ``--clients`` (default 4) client threads each run requests back to
back for ``--minutes``, greedy, on one of ``PROMPTS``, through the product's clients that name only
the model (they route over the DHT's records and heal from them):

- ``--client coordinate``: every request is one ``swarm coordinate --model M --bootstrap B
  --json`` process; its ``output_ids`` are compared;
- ``--client serve``: one ``swarm serve --model M --bootstrap B`` process, and every request a
  ``POST /v1/completions`` (``temperature`` 0) to it; its text and ``usage.completion_tokens`` are
  compared (with the reference ids decoded as serve decodes them). Its clients are kept across
  requests, so most of the wall time is generation and faults land mid-answer more often;
- ``--client mixed`` (default): half the clients each way (even-numbered ones ``coordinate``). Meanwhile, every ``--fault-every-s`` (jittered
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
soak must not have grown its RSS by more than ``--rss-growth-mb``: every process of every stage
(restarts are new processes) is sampled every 5 s from /proc, from ``--rss-settle-s`` after its
READY (the first sessions allocate) to its end, and the growth between those samples is bounded.

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


def parse_blocks(text: str) -> list[LayerRange]:
    """``"0:3,0:3,2:5"`` -> layer ranges."""
    return [LayerRange(*(int(x) for x in part.split(":"))) for part in text.split(",")]


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
    rss_last_mb: float | None = None
    rss_since: float = 0.0  # when rss_first_mb was taken
    lives: list[dict] = field(default_factory=list)  # the RSS of each process that ended: first, last, seconds
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
        ranges = parse_blocks(args.blocks) if args.blocks else blocks_for(args.stages, num_layers)
        self.slots = [Slot(i, r, tmp / "keys" / f"slot-{i}") for i, r in enumerate(ranges)]
        self.faults = {k: 0 for k in KINDS}
        self.fault_log: list[dict] = []
        self.skipped = 0
        self.results: list[dict] = []
        self.stop_clients = threading.Event()
        self.threads: list[threading.Thread] = []
        self.client_procs: dict[int, object] = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")  # as LocalRing and the zygote set it
        self.serve_url: str | None = None
        self.serve_proc = None
        self.ref_texts: list[str] = []
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
            self.end_life(slot)
            slot.rss_first_at = time.monotonic() + self.args.rss_settle_s

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
            if self.args.max_faults is not None and sum(self.faults.values()) >= self.args.max_faults:
                return
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

    def end_life(self, slot: Slot) -> None:
        """Keep the RSS of the process that served ``slot`` until now (a new one starts)."""
        if slot.rss_first_mb is not None and slot.rss_last_mb is not None:
            slot.lives.append({"first_mb": slot.rss_first_mb, "last_mb": slot.rss_last_mb,
                               "seconds": round(time.monotonic() - slot.rss_since)})
        slot.rss_first_mb = slot.rss_last_mb = None

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
                    s.rss_first_mb, s.rss_since = rss, now
                if s.rss_first_mb is not None:
                    s.rss_last_mb = rss

    # ---- clients
    def client(self, cid: int) -> None:
        n = 0
        key = self.tmp / f"client-{cid}.key"
        while not self.stop_clients.is_set():
            p = (cid + n * self.args.clients) % len(self.refs)
            n += 1
            row = self.request(cid, p, key) if self.kind_of(cid) == "coordinate" else self.complete(cid, p)
            row["via"] = self.kind_of(cid)
            if not row["ok"]:
                print(f"chaos: request lost: {row}", file=sys.stderr, flush=True)
            self.results.append(row)

    def kind_of(self, cid: int) -> str:
        """The client path of client ``cid``: ``coordinate`` or ``serve``."""
        if self.args.client == "mixed":
            return "coordinate" if cid % 2 == 0 else "serve"
        return self.args.client

    def start_serve(self) -> None:
        """``swarm serve --model M --bootstrap B --port 0`` as a child; its URL from its first stdout line."""
        argv = ["serve", "--model", self.model, "--bootstrap", self.boot, "--port", "0",
                "--key", str(self.tmp / "serve.key"), "--receipt-dir", str(self.tmp / "receipts")]
        self.serve_proc = start_swarm(argv, self.env)
        self.serve_err: list[str] = []
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(self.serve_proc.stdout), daemon=True).start()
        threading.Thread(target=lambda: [self.serve_err.append(x) or self.serve_err.__delitem__(slice(0, -40))
                                         for x in self.serve_proc.stderr], daemon=True).start()
        end = time.monotonic() + 120
        while not lines:
            if self.serve_proc.poll() is not None or time.monotonic() > end:
                raise StageLost(f"swarm serve did not start: {''.join(self.serve_err[-5:])}")
            time.sleep(0.1)
        self.serve_url = lines[0].split()[2].removesuffix("/v1")  # "swarm serve: http://127.0.0.1:PORT/v1 (...)"
        import httpx

        self.served_model = httpx.get(self.serve_url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def complete(self, cid: int, p: int) -> dict:
        """One ``POST /v1/completions`` to ``swarm serve``, compared with the solo reference."""
        import httpx

        body = {"model": self.served_model, "prompt": PROMPTS[p], "max_tokens": self.args.new_tokens,
                "temperature": 0}
        t = time.monotonic()
        row = {"client": cid, "prompt": p, "t": round(t - self.t0, 2)}
        try:
            resp = httpx.post(self.serve_url + "/v1/completions", json=body, timeout=self.args.request_timeout_s)
        except httpx.HTTPError as exc:
            row.update(ok=False, wall_s=round(time.monotonic() - t, 2), error=f"{type(exc).__name__}: {exc}")
            return row
        row["wall_s"] = round(time.monotonic() - t, 2)
        if resp.status_code != 200:
            row.update(ok=False, error=f"HTTP {resp.status_code}: {resp.text[:4000]}")
            return row
        doc = resp.json()
        text, used = doc["choices"][0]["text"], doc["usage"]["completion_tokens"]
        ref_text, ref = self.ref_texts[p], self.refs[p][1]
        row.update(ok=True, same=text == ref_text and used == len(ref), new_tokens=used, total_s=row["wall_s"],
                   route_s=None, heals=None)
        if not row["same"]:
            row["text"], row["ref_text"] = text, ref_text
        return row

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
            lines = "".join(err).strip().splitlines()
            row.update(ok=False, error=f"exit {code}: " + " | ".join(lines[-3:]), log_tail=lines[-40:])
        else:
            try:
                res = json.loads(out[-1])
            except (IndexError, ValueError):
                row.update(ok=False, error="no JSON on stdout")
                return row
            row.update(ok=True, same=res["output_ids"] == ref and res["prompt_ids"] == prompt_ids,
                       new_tokens=res["new_tokens"], heals=len(res.get("heal_events", [])),
                       route_s=res.get("route_s"), total_s=round(res.get("total_s") or 0, 2), ring=[e["layers"] for e in res["ring"]],
                       heal_kinds=[e.get("replay") for e in res.get("heal_events", [])])
            if not row["same"]:
                row["output_ids"], row["ref"] = res["output_ids"], ref
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
        if self.args.client != "coordinate":
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model)
            from swarm.coordinator.text import Detokenizer

            # a completion's text continues its prompt (decoded after the prompt's last ids, as the product does)
            self.ref_texts = [Detokenizer(tok, context=ids).decode(ref) for ids, ref in self.refs]
            self.start_serve()
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
        for s in self.slots:
            self.end_life(s)
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
                           "log_tail": (s.ring.stages[0].stderr_tail[-8:] if s.ring and s.ring.stages and
                                        m.get("swarm_stage_sessions_open") else []),
                           "rss_lives": [{k: round(v, 1) for k, v in life.items()} for life in s.lives],
                           "start_errors": s.start_errors[-3:]})
        # a process that served the whole soak (never restarted) must not have grown past the bound
        lives = [life for s in self.slots for life in s.lives]
        growth = [life["last_mb"] - life["first_mb"] for life in lives]
        heals = {"coordinate": sum(r.get("heals") or 0 for r in ok)}
        if self.serve_url is not None:  # serve counts the heals of all its requests
            try:
                heals["serve"] = int(read_metrics(self.serve_url + "/metrics").get("swarm_serve_heal_events_total", -1))
            except OSError:
                heals["serve"] = None
        by_via = {via: {"completed": sum(1 for r in ok if r["via"] == via),
                        "lost": sum(1 for r in lost if r["via"] == via)} for via in ("coordinate", "serve")}
        walls = [r["wall_s"] for r in ok]
        routes = [r["route_s"] for r in ok if r.get("route_s") is not None]
        total_faults = sum(self.faults.values())
        result = {
            "model": "stories260k", "stages": len(self.slots), "clients": self.args.clients,
            "client": self.args.client,
            "blocks": [s.layers.as_list() for s in self.slots], "minutes": self.args.minutes,
            "fault_every_s": self.args.fault_every_s, "new_tokens": self.args.new_tokens,
            "faults": {**self.faults, "total": total_faults, "skipped_no_candidate": self.skipped},
            "requests": {"completed": len(ok), "lost": len(lost), "different_from_solo": len(diff),
                         "coordinate_with_heal": sum(1 for r in ok if r.get("heals")),
                         "wall_s_p50": round(statistics.median(walls), 2) if walls else None,
                         "wall_s_max": max(walls) if walls else None,
                         "generate_s_p50": round(statistics.median(r["total_s"] for r in ok), 2) if ok else None,
                         "coordinate_route_s_p50": round(statistics.median(routes), 2) if routes else None},
            "heals": heals, "requests_by_client": by_via,
            "lost_examples": lost[:10], "different_examples": diff[:5],
            "idle": {"all_zero": idle["idle"], "after_s": idle["after_s"]},
            "rss_growth_max_mb": round(max(growth), 1) if growth else None,
            "rss_processes_sampled": len(lives), "rss_longest_life_s": max((x["seconds"] for x in lives), default=0),
            "rss_end_mb_max": max((st["rss_mb"] or 0 for st in stages), default=0),
            "rss_growth_bound_mb": self.args.rss_growth_mb,
            "stages_end": stages,
            "swarm_start_s": round(started_s, 1), "soak_s": round(soak_s, 1),
            "wall_s": round(time.monotonic() - self.t0, 1), "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(), "fault_log_head": self.fault_log[:20],
        }
        result["acceptance"] = {
            "faults_at_least_100": total_faults >= 100, "no_request_lost": not lost,
            "no_output_different": not diff, "sessions_back_to_zero": idle["idle"],
            "rss_bounded": bool(growth) and all(g <= self.args.rss_growth_mb for g in growth),
        }
        return result

    def reap(self) -> None:
        """Every child, whatever happened: clients killed, stopped stages continued, stages stopped."""
        self.stop_clients.set()
        for proc in [*self.client_procs.values(), *([self.serve_proc] if self.serve_proc else [])]:
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
    ap.add_argument("--blocks", help="the stages' blocks instead of --stages, e.g. 0:3,0:3,2:5,2:5,1:4")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--client", choices=["coordinate", "serve", "mixed"], default="mixed",
                    help="each request a `swarm coordinate` process, or a POST to one `swarm serve`, or half "
                         "the clients each way (default)")
    ap.add_argument("--max-faults", type=int, help="inject no more than this many faults")
    ap.add_argument("--fault-every-s", type=float, default=4.0, help="mean seconds between faults (jittered 0.5-1.5x)")
    ap.add_argument("--weights", type=float, nargs=3, default=[1.0, 1.0, 1.0], metavar=("KILL", "STOP", "RESTART"),
                    help="relative frequency of each fault kind")
    ap.add_argument("--max-faulted", type=int, default=3, help="stages faulted (down, frozen, restarting) at once")
    ap.add_argument("--new-tokens", type=int, default=96)
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
    saved = {k: os.environ.get(k) for k in ("SWARM_ZYGOTE", "SWARM_CACHE")}
    os.environ.setdefault("SWARM_ZYGOTE", "1")  # stages and clients fork from one preloaded parent
    from tests.support import zygote

    zygote.install()
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
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    text = json.dumps(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

"""The live dashboard (issue 18): one page, no build step, no CDN (``index.html`` ships in the package).

Owns: the page and the JSON it polls every second (``state``): the ring, layer coverage per model, tokens/s and
latency, recent jobs' receipt verdicts, heal events and audits per stage. ``swarm serve`` serves it at
``/dashboard``, ``swarm dashboard`` alone; what it shows and what never reaches it: docs/commands.md.
"""

from __future__ import annotations

import logging
import statistics
import time
from importlib import resources
from pathlib import Path

import trio
from swarm.errors import ConfigError, SwarmError

log = logging.getLogger(__name__)

MAX_JOBS = 20
WINDOW_S = 120.0  # the plots' time span


def page() -> bytes:
    """The dashboard's HTML (inline CSS and JS)."""
    return resources.files(__package__).joinpath("index.html").read_bytes()


_verified: dict[str, tuple[tuple, list[dict]]] = {}  # directory -> (its newest files' (name, mtime, size), jobs)


def jobs_from_dir(directory, limit: int = MAX_JOBS) -> list[dict]:
    """The newest ``limit`` job receipts in ``directory``, each verified (``swarm receipts verify``'s
    checks): ``{"file", "job_id", "tokens", "verified", "check", "reason"}``.

    The page polls every second: while those files are unchanged (names, mtimes and sizes), the
    verdicts of the last call are returned without verifying again."""
    from swarm import receipts

    d = Path(directory)
    stats = []
    for p in d.glob("*.json") if d.is_dir() else ():
        try:
            st = p.stat()
        except OSError:  # removed while we listed it
            continue
        stats.append((st.st_mtime_ns, p, st.st_size))
    newest = sorted(stats, key=lambda x: x[0], reverse=True)[:limit]
    key = tuple((p.name, t, size) for t, p, size in newest)
    cached = _verified.get(str(d))
    if cached is not None and cached[0] == key:
        return [dict(j) for j in cached[1]]
    out = []
    for path, verdict in receipts.verify_files([str(p) for _, p, _ in newest]):
        if isinstance(verdict, receipts.Verified):
            out.append({"file": Path(path).name, "job_id": verdict.job_id, "tokens": verdict.new_tokens,
                        "verified": True, "check": None, "reason": None})
        else:
            out.append({"file": Path(path).name, "job_id": None, "tokens": None, "verified": False,
                        "check": getattr(verdict, "check", "schema"), "reason": str(verdict)[:200]})
    _verified[str(d)] = (key, [dict(j) for j in out])
    return out


def rate_series(done: list[tuple[float, int]], now: float, window_s: float = WINDOW_S, step_s: float = 2.0):
    """Tokens/s per ``step_s`` bucket over the last ``window_s`` from ``[(unix time, tokens)]``."""
    start = now - window_s
    buckets = [0] * int(window_s / step_s)
    for t, n in done:
        if t >= start:
            buckets[min(len(buckets) - 1, int((t - start) / step_s))] += n
    return [[round(start + (i + 1) * step_s, 1), round(n / step_s, 3)] for i, n in enumerate(buckets)]


def latency_series(finished, now: float, window_s: float = WINDOW_S) -> list[list]:
    """``[[finish time, time to first token s, median inter-token gap s]]`` of the requests that
    finished in the last ``window_s`` (from ``ServeMetrics.finished``)."""
    return [[round(t, 2), ttft, itl] for t, _, ttft, itl in finished if now - t <= window_s]


def ring_coverage(ring, model: str, num_layers: int, down: frozenset[int] = frozenset()) -> dict:
    """Layer coverage of a ring's stages (but those at the ring positions in ``down``: they do not
    answer) and its spares, in the shape of ``swarm peers``' models."""
    from swarm.discovery.peers import uncovered

    held = [s for i, s in enumerate(ring.stages) if i not in down] + list(ring.spares)
    counts = [0] * num_layers
    for spec in held:
        for layer in range(spec.layers.start, min(spec.layers.end, num_layers)):
            counts[layer] += 1
    return {"name": model, "num_layers": num_layers, "coverage": counts, "uncovered": uncovered(counts),
            "holders": len(held), "source": "ring"}


class SwarmCoverage:
    """Layer coverage of every model that announces on the swarm's DHT, read again every
    ``every_s`` seconds in the background (``run``), so the page never waits on the DHT.

    ``models``: ``[{"name", "model_id", "num_layers", "coverage" (stages holding each layer),
    "uncovered" ([start, end) ranges nobody holds), "holders", "source": "dht"}]`` of the last
    read (None before the first); ``error``: why the last read failed, or None. One read sees at
    most the 256 providers a DHT node keeps per key (``SwarmDHT.find_records``)."""

    def __init__(self, dht, every_s: float = 5.0, timeout_s: float = 5.0, judge=None):
        """``judge``: ``await judge(records)`` after each read (``swarm serve``: the fraud proofs against
        its model's stages judged, for the stage table)."""
        self.dht, self.every_s, self.timeout_s, self.judge = dht, every_s, timeout_s, judge
        self.models: list[dict] | None = None
        self.error: str | None = None
        self.read_at: float | None = None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from swarm.discovery.peers import summarize

        task_status.started()
        while True:
            try:
                records = await self._census()
                if not records:  # nothing at all: perhaps we lost the swarm (a bootstrap restarted,
                    await self.dht.rejoin()  # or it fell out of our table), not the swarm its stages
                    records = await self._census()
                self.models = [{"name": m["name"] if isinstance(m["name"], str) else " / ".join(m["name"]),
                                "model_id": m["model_id"], "num_layers": m["num_layers"], "coverage": m["coverage"],
                                "uncovered": m["uncovered"], "holders": len(m["stages"]), "source": "dht"}
                               for m in summarize(records, {})["models"]]
                self.error, self.read_at = None, time.time()
                if self.judge is not None:
                    await self.judge(records)
            except SwarmError as exc:
                if self.error != str(exc):
                    log.warning("dashboard.coverage_unread reason=%s", exc)
                self.error = str(exc)
            await trio.sleep(self.every_s)

    async def _census(self) -> list:
        """Every stage record the DHT names, each provider waited for up to ``timeout_s``: a census, not a
        route's read, which stops soon after 90% answered (``SETTLE_QUORUM``). With dead stages' providers
        still listed, that dropped a live stage behind a relay (+50 ms each way) from the coverage."""
        return (await self.dht.read_records(None, timeout_s=self.timeout_s, quorum=1.0))[0]

    def state(self) -> dict:
        return {"models": self.models or [], "coverage_error": self.error, "coverage_read_at": self.read_at}


async def serve_state(state) -> dict:
    """The page's JSON for ``swarm serve`` (a ServeState with metrics)."""
    from swarm.serve.health import ring_health

    m, now = state.metrics, time.time()
    stages = await ring_health(state)
    finished, arrivals = list(m.finished), [tuple(a) for a in m.arrivals]
    recent = [(t, n) for t, n in arrivals if now - t < 10.0]  # whole seconds: the current one and 9 more
    ttfts = [x for _, _, x, _ in finished[-50:] if x is not None]
    itls = [x for _, _, _, x in finished[-50:] if x is not None]
    # in a thread: a directory read and signature checks must not hold up the server's event loop
    listed = state.config.receipts.listed_receipts
    jobs = await trio.to_thread.run_sync(jobs_from_dir, listed) if listed else []
    for j in jobs:
        if not j["verified"]:
            m.receipt_failed(j["file"], j["check"])
    coverage = state.coverage.state() if state.coverage is not None else {
        "models": [ring_coverage(state.ring, state.model_id, state.num_layers,
                                 frozenset(s["index"] for s in stages if not s["ok"]))], "coverage_error": None}
    audits = await audit_state(state, [s["peer_id"] for s in stages])
    return {
        "model": state.model_id, "num_layers": state.num_layers,
        "status": "ok" if all(s["ok"] for s in stages) else "degraded",
        "stages": [{**{k: s.get(k) for k in ("index", "layers", "peer_id", "ok", "error", "sessions", "kv_bytes",
                                             "latency_ms")}, "kernels": _kernels(s.get("kernels")),
                    "audit": audits["per_stage"].get(s["peer_id"])}
                   for s in stages],
        "shut_out": audits["shut_out"], "audits": audits["tally"], "audits_error": audits["error"],
        "tokens_per_s": sum(n for _, n in recent) / 10.0,
        "rate_series": rate_series(arrivals, now),
        "latency_series": latency_series(finished, now),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "itl_p50_s": statistics.median(itls) if itls else None,
        "requests": sum(m.requests.values()), "active": state.active,
        "heals": list(m.heal_log), "jobs": jobs, "dht": state.coverage is not None, **coverage,
        "receipts": str(listed) if listed else None,  # None: the page says
        # how to get receipts listed (--receipt-dir)
    }


def _kernels(reported) -> dict | None:
    """What the stage table shows of a stage's ``info_ok`` ``kernels``: ``{"mode", "isa", "library", "why"}``
    (None when the stage did not answer, or did not say)."""
    if not isinstance(reported, dict):
        return None
    return {k: str(reported.get(k) or "") for k in ("mode", "isa", "library", "why")}


async def audit_state(state, peer_ids: list[str]) -> dict:
    """What the dashboard shows of audits (``swarm serve``): per stage of the ring, the fraud proof
    against it as the server's ``shut_out`` judged it and the counts of ``--audits`` (its tally file,
    read with ``swarm.auditor.tally.read_tally``), and the stages shut out.

    Returns:
        ``{"per_stage": {PeerId: {"proof": "excluded" | "refused" | "unchecked" | None, "why",
        "audited", "passed", "failed"} (counts None without a tally entry)}, "shut_out": [{"peer_id",
        "layers", "why"}], "tally": the file or None, "error": why the file could not be read, or None}``.
    """
    from swarm.auditor.tally import COUNTS, read_tally

    path, tally, error = state.config.receipts.audit_tally, {}, None
    if path is not None:
        try:  # in a thread: a file read must not hold up the server's event loop
            tally = await trio.to_thread.run_sync(read_tally, path)
        except ConfigError as exc:  # e.g. rewritten by an auditor just now: shown, next poll reads again
            error = str(exc)
    shut_out = state.shut_out
    per_stage = {}
    for peer in peer_ids:
        judged = (shut_out.judged(peer) if shut_out is not None and peer else None) or {"proof": None, "why": None}
        per_stage[peer] = {**judged, **(tally.get(peer) or {k: None for k in COUNTS})}
    excluded = [{"peer_id": p, "layers": list(c.layers), "why": c.line()}
                for p, c in (shut_out.verified.items() if shut_out is not None else ())]
    return {"per_stage": per_stage, "shut_out": excluded, "tally": str(path) if path else None, "error": error}


def receipts_app(directory, coverage: SwarmCoverage | None = None):
    """A Starlette app serving the page alone (``swarm dashboard``): over a receipt directory
    (``directory``, or None), and the swarm's coverage (``coverage``, whose ``run`` the caller
    runs)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, RedirectResponse, Response
    from starlette.routing import Route

    async def index(request):
        return Response(page(), media_type="text/html; charset=utf-8")

    async def state(request):
        jobs = await trio.to_thread.run_sync(jobs_from_dir, directory) if directory is not None else []
        status = [f"{sum(j['verified'] for j in jobs)} of {len(jobs)} receipts verified"] if directory else []
        if coverage is not None:
            n = len(coverage.models or [])
            status.append("swarm: " + (coverage.error or "reading the DHT..." if coverage.models is None else
                                       f"{n} model{'' if n == 1 else 's'} announce{'s' if n == 1 else ''}"))
        return JSONResponse({"status": "; ".join(status), "receipts": str(directory) if directory else None,
                             "stages": None, "jobs": jobs, "heals": [], "tokens_per_s": 0, "rate_series": [],
                             "latency_series": [], "dht": coverage is not None,
                             **(coverage.state() if coverage else {"models": []})})

    async def root(request):
        return RedirectResponse("/dashboard")

    return Starlette(routes=[Route("/", root), Route("/dashboard", index), Route("/dashboard/", index),
                             Route("/dashboard/state", state)])

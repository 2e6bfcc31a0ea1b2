"""The live dashboard (issue 18): one page, no build step, no CDN (``index.html`` ships in the package).

Owns: the page, and the JSON it polls every second (``state``): the ring as a picture (stages,
layer ranges, PeerIds, state, sessions, KV memory), layer coverage, tokens/s over the last two
minutes, time to first token, the recent jobs with their receipt verdicts (verified, or failed and
which check), and heal events. ``swarm serve`` serves it at ``/dashboard`` (state from its ring and
metrics); ``swarm dashboard --receipts DIR`` serves it alone over a receipt directory.

Nothing sensitive reaches the page: no prompt text, token ids or key material; PeerIds and
addresses are public by nature. It binds where its server binds: keep that private.

May import: starlette (lazily), ``swarm.receipts``.
"""

from __future__ import annotations

import statistics
import time
from importlib import resources
from pathlib import Path

MAX_JOBS = 20


def page() -> bytes:
    """The dashboard's HTML (inline CSS and JS)."""
    return resources.files(__package__).joinpath("index.html").read_bytes()


def jobs_from_dir(directory, limit: int = MAX_JOBS) -> list[dict]:
    """The newest ``limit`` job receipts in ``directory``, each verified (``swarm receipts verify``'s
    checks): ``{"file", "job_id", "tokens", "verified", "check", "reason"}``."""
    from swarm import receipts

    d = Path(directory)
    files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[:limit] if d.is_dir() else []
    out = []
    for path, verdict in receipts.verify_files([str(p) for p in files]):
        if isinstance(verdict, receipts.Verified):
            out.append({"file": Path(path).name, "job_id": verdict.job_id, "tokens": verdict.new_tokens,
                        "verified": True, "check": None, "reason": None})
        else:
            out.append({"file": Path(path).name, "job_id": None, "tokens": None, "verified": False,
                        "check": getattr(verdict, "check", "schema"), "reason": str(verdict)[:200]})
    return out


def rate_series(done: list[tuple[float, int]], now: float, window_s: float = 120.0, step_s: float = 2.0):
    """Tokens/s per ``step_s`` bucket over the last ``window_s`` from ``[(finish time, tokens)]``."""
    start = now - window_s
    buckets = [0] * int(window_s / step_s)
    for t, n in done:
        if t >= start:
            buckets[min(len(buckets) - 1, int((t - start) / step_s))] += n
    return [[round(start + (i + 1) * step_s, 1), round(n / step_s, 3)] for i, n in enumerate(buckets)]


async def serve_state(state) -> dict:
    """The page's JSON for ``swarm serve`` (a ServeState with metrics)."""
    from swarm.serve import ring_health

    m, now = state.metrics, time.time()
    stages = await ring_health(state)
    recent = [(t, n) for t, n, _ in m.finished if now - t <= 10.0]
    ttfts = [x for _, _, x in list(m.finished)[-50:] if x is not None]
    return {
        "model": state.model_id, "num_layers": state.num_layers,
        "status": "ok" if all(s["ok"] for s in stages) else "degraded",
        "stages": [{k: s.get(k) for k in ("index", "layers", "peer_id", "ok", "error", "sessions", "kv_bytes",
                                          "latency_ms")} for s in stages],
        "tokens_per_s": sum(n for _, n in recent) / 10.0,
        "rate_series": rate_series([(t, n) for t, n, _ in m.finished], now),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "requests": sum(m.requests.values()), "active": state.active,
        "heals": list(m.heal_log), "jobs": jobs_from_dir(state.dashboard_receipts) if state.dashboard_receipts else [],
    }


def receipts_app(directory):
    """A Starlette app serving the page over a receipt directory alone (``swarm dashboard``)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, RedirectResponse, Response
    from starlette.routing import Route

    async def index(request):
        return Response(page(), media_type="text/html; charset=utf-8")

    async def state(request):
        jobs = jobs_from_dir(directory)
        return JSONResponse({"status": f"{sum(j['verified'] for j in jobs)} of {len(jobs)} receipts verified",
                             "receipts": str(directory), "stages": None, "jobs": jobs, "heals": [],
                             "tokens_per_s": 0, "rate_series": []})

    async def root(request):
        return RedirectResponse("/dashboard")

    return Starlette(routes=[Route("/", root), Route("/dashboard", index), Route("/dashboard/", index),
                             Route("/dashboard/state", state)])

"""Prometheus metrics of ``swarm serve`` (issue 18): ``ServeMetrics``, served on ``/metrics``.

Owns: the counters and gauges read at scrape time, the histograms (time to first token, inter-token latency,
request time, heal phases) and the recent requests, arrivals and heal events the dashboard shows.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from swarm.metrics import LATENCY_BUCKETS
from swarm.metrics import counter as _counter
from swarm.metrics import gauge as _gauge

# inter-token gaps: 0 (drafts accepted together) up to a slow hop
ITL_BUCKETS = (0.0001, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServeMetrics:
    """``swarm serve``'s metrics (``swarm_serve_*``): requests by status, tokens, time to first
    token, inter-token latency, request time, heals, receipts written and failed, prefix reuse.

    Request statuses: ``ok``, ``abandoned`` (the client hung up), ``error`` (the ring failed it),
    ``invalid`` (refused before the ring: HTTP 400, or 405 on an API route)."""

    def __init__(self, state):
        self.state = state
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests: dict[str, int] = {}
        self.ttft_seconds = Histogram("swarm_serve_time_to_first_token_seconds", "Request start -> first token",
                                      buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_seconds = Histogram("swarm_serve_inter_token_seconds",
                                             "Time between two consecutive tokens of a request reaching the server "
                                             "(tokens accepted together from one verify chunk arrive together: gap 0)",
                                             buckets=ITL_BUCKETS, registry=self.registry)
        self.request_seconds = Histogram("swarm_serve_request_seconds", "Request start -> last token",
                                         buckets=LATENCY_BUCKETS, registry=self.registry)
        self.heal_seconds = Histogram("swarm_serve_heal_seconds", "Heal phases: detection, swap, replay (rebuilding "
                                      "the replacement's KV), total", labelnames=["phase"], buckets=LATENCY_BUCKETS,
                                      registry=self.registry)
        self.tokens = 0
        self.heals = 0
        self.receipts_written = 0
        self.receipt_failures: dict[str, int] = {}  # check -> receipts that failed it
        self._failed_files: set = set()  # receipt files already counted as failed (each counts once)
        # (unix time, new tokens, ttft_s, median inter-token gap s) of recent requests (dashboard)
        self.finished: deque = deque(maxlen=4096)
        self.arrivals: deque = deque(maxlen=600)  # [unix second, tokens that reached the server in it]
        self.heal_log: deque = deque(maxlen=50)  # recent heal events, for the dashboard's timeline
        self.registry.register(_ServeCollector(self))

    def tokens_arrived(self, n: int, gaps: list[float]) -> None:
        """``n`` new tokens of a request reached the server now (counted live, while it runs);
        ``gaps``: the seconds since that request's previous token, one per token (none for its
        first token)."""
        self.tokens += n
        for gap in gaps:
            self.inter_token_seconds.observe(gap)
        second = int(time.time())
        if self.arrivals and self.arrivals[-1][0] == second:
            self.arrivals[-1][1] += n
        else:
            self.arrivals.append([second, n])

    def request_done(self, status: str, record: dict | None = None, new_tokens: int = 0,
                     gaps: list[float] | None = None) -> None:
        """Count a request by ``status`` and observe its timings (its tokens and their gaps were
        counted as they arrived, ``tokens_arrived``); ``gaps`` gives the latency plot its median."""
        self.requests[status] = self.requests.get(status, 0) + 1
        if record is None:
            return
        self.heals += len(record.get("heal_events") or [])
        now = time.time()
        self.finished.append((now, new_tokens, record.get("ttft_s"), statistics.median(gaps) if gaps else None))
        for e in record.get("heal_events") or []:
            for phase, key in (("detection", "detect_s"), ("swap", "swap_s"), ("replay", "replay_s"),
                               ("total", "total_s")):
                if isinstance(e.get(key), (int, float)):
                    self.heal_seconds.labels(phase=phase).observe(e[key])
            self.heal_log.append({"time": now, "stage": e.get("stage"), "layers": list(e.get("layers") or []),
                                  "replay": e.get("replay"), "total_s": float(e.get("total_s") or 0.0)})
        if record.get("ttft_s") is not None:
            self.ttft_seconds.observe(record["ttft_s"])
        if record.get("total_s") is not None:
            self.request_seconds.observe(record["total_s"])

    def receipt_written(self, file: str, check: str | None) -> None:
        """A job receipt this server signed and saved as ``file``; ``check``: the verification check
        it failed, None when it verified."""
        self.receipts_written += 1
        if check is not None:
            self.receipt_failed(file, check)

    def receipt_failed(self, file: str, check: str) -> None:
        """A receipt ``file`` failed ``check`` (at write time, or when the dashboard verified its
        directory); each file counts once."""
        if file not in self._failed_files:
            self._failed_files.add(file)
            self.receipt_failures[check] = self.receipt_failures.get(check, 0) + 1

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ServeCollector:
    def __init__(self, m: ServeMetrics):
        self.m = m

    def describe(self):
        return []

    def collect(self):
        m, st = self.m, self.m.state
        requests = CounterMetricFamily("swarm_serve_requests", "Requests finished, by status", labels=["status"])
        for status in sorted(set(m.requests) | {"ok", "error", "abandoned", "invalid"}):
            requests.add_metric([status], m.requests.get(status, 0))
        yield requests
        yield _gauge("swarm_serve_active_requests", "Requests on the ring now", st.active)
        yield _counter("swarm_serve_tokens_generated", "New tokens of all requests", m.tokens)
        yield _counter("swarm_serve_cached_prompt_tokens", "Prompt positions taken from the stages' prefix caches",
                       st.cached_tokens)
        yield _counter("swarm_serve_heal_events", "Heals during requests (a stage replaced mid-answer)", m.heals)
        yield _counter("swarm_serve_receipts_written", "Job receipts signed and saved (--receipt-dir)",
                       m.receipts_written)
        failed = CounterMetricFamily("swarm_serve_receipt_verification_failures",
                                     "Job receipts that failed verification, by the check they failed (each file "
                                     "once: at write time, or when the dashboard verified its directory)",
                                     labels=["check"])
        for check, n in sorted(m.receipt_failures.items()):
            failed.add_metric([check], n)
        yield failed

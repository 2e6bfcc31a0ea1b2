"""Prometheus metrics of a stage and of ``swarm serve`` (issue 18), with prometheus_client.

Owns: ``StageMetrics`` and ``ServeMetrics``: each node has its own ``CollectorRegistry`` (several
nodes may share a process in tests). Counters and gauges that the node already keeps (sessions, KV
bytes, steps, frames and bytes of its streams, refusals, prefix cache) are read at scrape time by a
collector, so they cost nothing per frame; histograms (step time, rows per step, send time, time to
first token, inter-token latency) are observed where the event happens. Names and units follow the
Prometheus conventions (``_seconds``, ``_bytes``, ``_total``). No label carries prompt text, token
ids, session ids or key material: labels are fixed small sets (a refusal reason, a request status,
a receipt check), and ``swarm_stage_info`` names the stage's public PeerId, model and layers.

``swarm stage --metrics-listen HOST:PORT`` serves a stage's on ``/metrics`` (prometheus_client's own
HTTP server, in a thread); ``swarm serve`` serves its own on ``/metrics`` next to the API.

May import: prometheus_client; it reads a StageServer / ServeState duck-typed (no import of them).
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REFUSAL_REASONS = ("busy", "forbidden", "overflow", "draining", "bad_request", "no_session", "no_state",
                   "unavailable", "internal")
# inter-token gaps: 0 (drafts accepted together) up to a slow hop
ITL_BUCKETS = (0.0001, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StageMetrics:
    """A stage's metrics (``swarm_stage_*``). ``server`` is a StageServer; ``host`` its SwarmHost
    (``meter``: frames and bytes of every framed stream), set when it serves."""

    def __init__(self, server):
        self.server = server
        self.registry = CollectorRegistry(auto_describe=True)
        self.step_seconds = Histogram("swarm_stage_step_seconds", "Compute of one scheduling step (a packed forward)",
                                      buckets=STEP_BUCKETS, registry=self.registry)
        self.step_rows = Histogram("swarm_stage_step_rows", "Rows (positions of all sessions) one step computed",
                                   buckets=ROW_BUCKETS, registry=self.registry)
        self.send_seconds = Histogram("swarm_stage_send_seconds",
                                      "Posting a computed frame to the next hop -> its write returned (outbox wait "
                                      "and send)", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_StageCollector(server))


class _StageCollector:
    def __init__(self, server):
        self.s = server

    def describe(self):
        return []

    def collect(self):
        s = self.s
        sessions = list(s.sessions.values())
        b, host = s.block, getattr(s, "host", None)
        info = GaugeMetricFamily("swarm_stage_info", "This stage: PeerId, model, layer range [start, end), dtype "
                                 "(always 1; join on it in queries)",
                                 labels=["peer_id", "model", "layers", "dtype"])
        info.add_metric([getattr(host, "peer_id", "") or "", s.model_name,
                         f"{b.layer_range.start}:{b.layer_range.end}", str(b.dtype).removeprefix("torch.")], 1)
        yield info
        yield _gauge("swarm_stage_sessions_open", "Sessions open at this stage", len(sessions))
        yield _gauge("swarm_stage_queue_depth", "Chunks queued for compute, all sessions",
                     sum(len(x.queue) for x in sessions))
        yield _gauge("swarm_stage_kv_used_bytes", "KV cache memory the open sessions hold",
                     sum(x.cache.nbytes() for x in sessions))
        yield _gauge("swarm_stage_kv_reserved_bytes", "KV memory the open sessions reserved (max_len positions)",
                     sum(x.reserved for x in sessions))
        yield _gauge("swarm_stage_kv_budget_bytes", "--kv-budget-mb in bytes (0: no limit)",
                     s.config.kv_budget_bytes or 0)
        yield _gauge("swarm_stage_draining", "1 while the stage drains (admits no new session)", int(bool(s.draining)))
        stats, timing = dict(s.stats), dict(s.timing)
        yield _counter("swarm_stage_steps", "Scheduling steps computed", stats["steps"])
        yield _counter("swarm_stage_batched_steps", "Steps that packed more than one session", stats["batched_steps"])
        yield _counter("swarm_stage_rows", "Rows computed by all steps", stats["rows"])
        yield _counter("swarm_stage_compute_seconds", "Seconds spent in forwards", timing.get("compute_s", 0.0))
        meter = getattr(getattr(s, "host", None), "meter", None)
        if meter is not None:
            yield _counter("swarm_stage_frames_received", "Frames received on all streams", meter.frames_in)
            yield _counter("swarm_stage_frames_sent", "Frames sent on all streams", meter.frames_out)
            yield _counter("swarm_stage_received_bytes", "Frame bytes received (before Noise/Yamux)", meter.bytes_in)
            yield _counter("swarm_stage_sent_bytes", "Frame bytes sent (before Noise/Yamux)", meter.bytes_out)
        refused = CounterMetricFamily("swarm_stage_refusals", "Error frames sent, by reason", labels=["reason"])
        counts = dict(s.refusals)
        for reason in sorted(set(REFUSAL_REASONS) | set(counts)):
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
        yield _counter("swarm_stage_repairs", "Heal repairs applied to surviving sessions", s.repairs)
        yield _counter("swarm_stage_receipts_signed", "Stage receipts signed", s.receipts_signed)
        prefix = s.prefix_stats()
        if prefix is not None:
            yield _gauge("swarm_stage_prefix_cache_blocks", "Prefix-cache blocks held", prefix["blocks"])
            yield _gauge("swarm_stage_prefix_cache_bytes", "Prefix-cache bytes held", prefix["bytes"])
            yield _counter("swarm_stage_prefix_cache_hits", "Prefix blocks reused", prefix["hits"])
            yield _counter("swarm_stage_prefix_cache_lookups", "Prefix lookups at session open", prefix["lookups"])
            yield _counter("swarm_stage_prefix_cache_evictions", "Prefix blocks evicted for room", prefix["evictions"])
            yield _counter("swarm_stage_prefix_cache_checksum_failures", "Prefix blocks dropped for a bad checksum",
                           prefix["checksum_failures"])


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


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)

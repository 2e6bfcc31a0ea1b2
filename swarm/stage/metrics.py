"""Prometheus metrics of a stage (issue 18): ``StageMetrics``, served by ``--metrics-listen``.

Owns: the counters and gauges read at scrape time from what the stage keeps, the histograms observed where the
event happens (step time, rows per step, send time), ``swarm_stage_info`` and ``swarm_stage_kernels_info``. The
list: docs/commands.md, "Metrics".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarm.metrics import LATENCY_BUCKETS
from swarm.metrics import counter as _counter
from swarm.metrics import gauge as _gauge

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KERNEL_LABELS = ("mode", "isa", "library", "arithmetic", "bf16_dot", "why")  # swarm_stage_kernels_info's
REFUSAL_REASONS = ("busy", "forbidden", "overflow", "draining", "bad_request", "no_session", "no_state",
                   "unavailable", "internal")


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
        k = s.kernels
        kernels = GaugeMetricFamily("swarm_stage_kernels_info", "The kernels this stage runs after its start-up "
                                    "proof: mode (fma, triton, rows), ISA, library (installed, built at run time, "
                                    "...), arithmetic, what forms the bfloat16 GEMM's pairs (vdpbf16ps, fma) "
                                    "and why rows (always 1)",
                                    labels=list(KERNEL_LABELS))
        kernels.add_metric([str(k.get(x) or "")[:200] for x in KERNEL_LABELS], 1)
        yield kernels
        yield _gauge("swarm_stage_sessions_open", "Sessions open at this stage", len(sessions))
        yield _gauge("swarm_stage_queue_depth", "Chunks queued for compute, all sessions",
                     sum(len(x.scheduling.queue) for x in sessions))
        yield _gauge("swarm_stage_kv_used_bytes", "KV cache memory the open sessions hold",
                     sum(x.cache.nbytes() for x in sessions))
        yield _gauge("swarm_stage_kv_reserved_bytes", "KV memory the open sessions reserved (max_len positions)",
                     s.reserved_bytes())
        yield _gauge("swarm_stage_kv_budget_bytes", "--kv-budget-mb in bytes (0: no limit)",
                     s.config.admission.kv_budget_bytes or 0)
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
        yield _counter("swarm_stage_repairs", "Heal repairs applied to surviving sessions", s.repairs.applied)
        yield _counter("swarm_stage_receipts_signed", "Stage receipts signed", s.signer.signed)
        store = s.audits.store
        yield _gauge("swarm_stage_audit_retained_bytes", "Recent jobs' rows kept for audits in memory", store.nbytes)
        yield _gauge("swarm_stage_audit_spilled_bytes", "... and in --audit-retention-dir", store.disk_bytes)
        role = s.auditing
        if role.on:  # the auditor role (--audit-rate): its tally over the stages it audited
            st = role.stats()
            for name, what in (("audited", "Stages of offered jobs this stage audited"),
                               ("passed", "... that reproduced bit for bit"),
                               ("failed", "... that did not, or refused to open their windows"),
                               ("unavailable", "... that had no record of the job: restarted since (not failed)")):
                yield _counter(f"swarm_stage_auditor_{name}", what, st[name])
            yield _counter("swarm_stage_auditor_offers", "Job offers queued", st["offers"])
            yield _counter("swarm_stage_auditor_offers_dropped", "Queued offers dropped for room (--audit-queue)",
                           st["dropped"])
            yield _gauge("swarm_stage_auditor_waiting", "Offered jobs waiting for idle time", st["waiting"])
            yield _gauge("swarm_stage_auditor_paused", "1 while the auditor waits for live sessions to end",
                         int(st["paused"]))
        prefix = s.prefix_stats()
        if prefix is not None:
            yield _gauge("swarm_stage_prefix_cache_blocks", "Prefix-cache blocks held", prefix["blocks"])
            yield _gauge("swarm_stage_prefix_cache_bytes", "Prefix-cache bytes held", prefix["bytes"])
            yield _counter("swarm_stage_prefix_cache_hits", "Prefix blocks reused", prefix["hits"])
            yield _counter("swarm_stage_prefix_cache_lookups", "Prefix lookups at session open", prefix["lookups"])
            yield _counter("swarm_stage_prefix_cache_evictions", "Prefix blocks evicted for room", prefix["evictions"])
            yield _counter("swarm_stage_prefix_cache_checksum_failures", "Prefix blocks dropped for a bad checksum",
                           prefix["checksum_failures"])

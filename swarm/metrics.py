"""Prometheus plumbing shared by the stage's and ``swarm serve``'s metrics, with prometheus_client.

Owns: the histogram buckets both use, the exposition content type and the two constructors of a metric family
read at scrape time (``gauge``, ``counter``). The metrics themselves: ``swarm.stage.metrics`` and
``swarm.serve.metrics``; their conventions: docs/architecture.md, "Notes by module".
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)

"""Reading a Prometheus /metrics page in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict:
    """{sample name with sorted labels: value} of one /metrics page (parsed by prometheus_client)."""
    text = httpx.get(url, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                key += f"[le={s.labels['le']}]"
            out[key] = s.value
    return out

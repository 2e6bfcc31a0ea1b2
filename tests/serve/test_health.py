"""``ring_health`` (``/health`` and the dashboard's stage table) over an in-process ring on real libp2p."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from swarm.errors import collapse
from swarm.serve.health import ring_health
from swarm.transport import load_or_create_key, open_host
from tests.support.ring import LOOPBACK, start_ring

pytestmark = pytest.mark.ring


def test_ring_health_reports_the_kernels_each_stage_runs(synthetic, tmp_path):
    """Each stage's ``info_ok`` ``kernels``, as the stage proved them: float64 stages run rows, saying why."""
    got = {}

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, synthetic("llama"), [(0, 2), (2, 4)], tmp_path)
                async with open_host(load_or_create_key(tmp_path / "serve.key"), [LOOPBACK]) as host:
                    config = SimpleNamespace(ring=SimpleNamespace(connect_timeout_s=10.0))
                    state = SimpleNamespace(ring=spec, host=host, config=config)
                    got["health"], got["servers"] = await ring_health(state), servers
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    why = "the fma kernels cannot run: they take float32 or bfloat16 on the CPU, this block is float64 on cpu"
    assert [s["ok"] for s in got["health"]] == [True, True], got["health"]
    for entry, server in zip(got["health"], got["servers"]):
        assert entry["kernels"] == server.kernels
        assert {k: entry["kernels"][k] for k in ("mode", "isa", "library", "why")} == {
            "mode": "rows", "isa": "", "library": "torch", "why": why}

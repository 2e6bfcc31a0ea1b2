"""A stage's metrics in its own process (``StageMetrics`` over an in-process StageServer): the kernels it
runs, as ``info_ok`` reports them. The scrape of a real stage process: tests/test_metrics.py."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from swarm.config import StageConfig
from swarm.kernels import fma
from swarm.model.block import load_block
from swarm.ranges import LayerRange
from swarm.stage.metrics import StageMetrics
from swarm.stage.server import StageServer
from swarm.transport import load_or_create_key
from swarm.transport.identity import peer_id_of
from tests.support.streams import NoNetwork


def _server(model, dtype, tmp_path) -> StageServer:
    layers = LayerRange(0, 2)
    block = load_block(model, layers, dtype=dtype, device="cpu")
    server = StageServer(StageConfig.of(model=str(model), layers=layers), block, "synthetic", "d" * 64,
                         key=load_or_create_key(tmp_path / "stage.key"))
    server.host = NoNetwork(peer_id_of(server.key))
    return server


def _kernels_line(server) -> str:
    (line,) = [x for x in generate_latest(StageMetrics(server).registry).decode().splitlines()
               if x.startswith("swarm_stage_kernels_info{")]
    return line


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_kernels_a_stage_runs_are_in_its_info_and_metrics(synthetic, tmp_path, dtype):
    """fma: which ISA and which library (installed or built at run time); rows: why (float64 here)."""
    server = _server(synthetic("llama", "float32"), dtype, tmp_path)
    kernels = server.info().kernels
    assert kernels is server.kernels and kernels["rows_ok"]
    if dtype == "float64" or not fma.available()[0]:
        why = ("the fma kernels cannot run: they take float32 or bfloat16 on the CPU, this block is float64 on cpu"
               if dtype == "float64" else f"the fma kernels cannot run: {fma.available()[1]}")
        assert {k: kernels[k] for k in ("mode", "isa", "library", "arithmetic", "why")} == {
            "mode": "rows", "isa": "", "library": "torch", "arithmetic": "", "why": why}
        assert _kernels_line(server) == (f'swarm_stage_kernels_info{{arithmetic="",bf16_dot="",isa="",library="torch",'
                                         f'mode="rows",why="{why}"}} 1.0')
        return
    path = fma.describe()
    assert {k: kernels[k] for k in ("mode", "isa", "library", "arithmetic", "why", "bf16_dot")} == {
        "mode": "fma", "isa": fma.isa(), "library": path.library, "arithmetic": path.arithmetic, "why": "",
        "bf16_dot": path.bf16_dot}
    assert path.bf16_dot in ("vdpbf16ps", "fma")
    assert kernels["isa"] in ("avx512", "avx2", "neon") and kernels["library"] in ("installed", "built at run time")
    assert _kernels_line(server) == (f'swarm_stage_kernels_info{{arithmetic="{path.arithmetic}",'
                                     f'bf16_dot="{path.bf16_dot}",isa="{fma.isa()}",library="{path.library}",'
                                     f'mode="fma",why=""}} 1.0')

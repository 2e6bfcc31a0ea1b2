"""Prometheus metrics (issue 18): scrape a real stage process's /metrics and a real `swarm serve`'s
after a few requests; the exposition parses with prometheus_client's parser, and the counters and
histograms moved by exactly what the requests did."""

from __future__ import annotations

import httpx
import pytest
import trio

from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient
from swarm.errors import RemoteError, collapse
from swarm.cli.launch import LocalRing
from swarm.model.block import model_num_layers
from swarm.model.resolve import model_manifest_digest
from swarm.ranges import LayerRange
from swarm.transport import load_or_create_key, open_host
from tests.support.metrics import scrape

RANGES = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
PROMPT = [1, 403, 407, 261, 378, 383, 286, 261]
NEW = 6
LONG = [1] + [403, 407, 261, 378, 383, 286, 261] * 3  # 22 positions: more than a short chunk (16)


@pytest.fixture(scope="module")
def metrics_ring(stories_dir, tmp_path_factory):
    """One ring of stage processes exporting metrics, for every test of this module (starting
    stages is what costs here); the stage test runs first, on stages nothing else has used yet."""
    keys = tmp_path_factory.mktemp("metrics-keys")
    with LocalRing(str(stories_dir), RANGES, keys, threads=1,
                   extra_args=["--dtype", "float32", "--metrics-listen", "127.0.0.1:0"]) as ring:
        yield ring


@pytest.mark.ring
@pytest.mark.process
def test_a_stage_process_exports_what_a_generation_did(stories_dir, metrics_ring, tmp_path):
    ring = metrics_ring  # nothing has used these stages yet
    urls = [sp.ready["metrics_url"] for sp in ring.stages]
    before = [scrape(u) for u in urls]

    async def main():
        async with open_host(load_or_create_key(tmp_path / "c.key"), ["/ip4/127.0.0.1/tcp/0"]) as host, \
                trio.open_nursery() as nursery:
            client = RingClient(host, ring.ring_spec(), 30.0, 10.0)
            await client.connect(model_num_layers(stories_dir), model_manifest_digest(stories_dir), nursery)
            out = (await decode(client, PROMPT, DecodeOptions(NEW))).output_ids
            with pytest.raises(RemoteError, match="maximum context"):  # refused at the tail, counted
                await client.open_session("too-long", 10**6)
            mid = [await trio.to_thread.run_sync(scrape, u) for u in urls]
            # a prompt longer than a short chunk is computed in slices of a long piece: its rows count too
            await decode(client, LONG, DecodeOptions(NEW))
            nursery.cancel_scope.cancel()
        return out, mid

    try:
        out, mid = trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    assert len(out) == NEW
    after = [scrape(u) for u in urls]
    for i, (a, b, c) in enumerate(zip(before, mid, after)):
        long = {k: c[k] - b.get(k, 0) for k in ("swarm_stage_rows_total", "swarm_stage_step_rows_sum")}
        assert long == dict.fromkeys(long, len(LONG) + NEW - 1), (i, long)
    for i, (a, b) in enumerate(zip(before, mid)):  # the first generation and the refused open
        d = {k: b[k] - a.get(k, 0) for k in b}
        # one prefill chunk, then NEW - 1 one-row decode chunks: one step each
        assert d["swarm_stage_steps_total"] == NEW, (i, d["swarm_stage_steps_total"])
        assert d["swarm_stage_rows_total"] == len(PROMPT) + NEW - 1
        assert d["swarm_stage_step_seconds_count"] == NEW and d["swarm_stage_step_rows_sum"] == len(PROMPT) + NEW - 1
        assert d["swarm_stage_step_rows_bucket[le=1.0]"] == NEW - 1  # the decode steps have one row
        assert d["swarm_stage_send_seconds_count"] == NEW  # each computed chunk went on once
        assert d["swarm_stage_frames_received_total"] >= NEW and d["swarm_stage_received_bytes_total"] > 0
        assert b["swarm_stage_sessions_open"] == 0 and b["swarm_stage_queue_depth"] == 0
        assert b["swarm_stage_kv_used_bytes"] == 0
    assert after[2]["swarm_stage_refusals_total{reason=overflow}"] - before[2].get(
        "swarm_stage_refusals_total{reason=overflow}", 0) == 1
    assert after[0]["swarm_stage_refusals_total{reason=busy}"] == 0
    for sp, a in zip(ring.stages, after):  # the info metric names each stage (public PeerId, layers)
        info = {k: v for k, v in a.items() if k.startswith("swarm_stage_info")}
        assert info == {f"swarm_stage_info{{dtype=float32}}{{layers={sp.layers.start}:{sp.layers.end}}}"
                        f"{{model=stories260k}}{{peer_id={sp.ready['peer_id']}}}": 1}, info
        k = sp.ready["kernels"]  # and the kernels it runs, as its READY line says (float32: fma where they run)
        kernels = {x: v for x, v in a.items() if x.startswith("swarm_stage_kernels_info")}
        assert kernels == {f"swarm_stage_kernels_info{{arithmetic={k['arithmetic']}}}{{bf16_dot={k['bf16_dot']}}}"
                           f"{{isa={k['isa']}}}{{library={k['library']}}}{{mode={k['mode']}}}{{why={k['why']}}}": 1}, kernels


@pytest.mark.process
def test_serve_exports_requests_tokens_and_latencies(stories_ring_metrics):
    server = stories_ring_metrics
    for _ in range(2):
        server.client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=5, temperature=0)
    with pytest.raises(Exception):
        server.client.completions.create(model="stories260k", prompt="Once", max_tokens=-3)  # 400: not a request
    assert httpx.get(server.url + "/v1/completions", timeout=10).status_code == 405  # the wrong method
    m = scrape(server.url + "/metrics")
    assert m["swarm_serve_requests_total{status=ok}"] == 2
    assert m["swarm_serve_requests_total{status=invalid}"] == 2  # refused before the ring
    assert m["swarm_serve_tokens_generated_total"] == 10
    assert m["swarm_serve_time_to_first_token_seconds_count"] == 2
    assert m["swarm_serve_request_seconds_count"] == 2
    assert m["swarm_serve_inter_token_seconds_count"] == 8  # 4 gaps between the 5 tokens of each
    assert 0 < m["swarm_serve_inter_token_seconds_sum"] < m["swarm_serve_request_seconds_sum"]
    assert m["swarm_serve_receipts_written_total"] == 0  # no --receipt-dir
    assert m["swarm_serve_active_requests"] == 0
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")
    text = httpx.get(server.url + "/metrics").text
    assert "Once upon" not in text  # no prompt text in metrics


@pytest.mark.process
def test_tokens_are_counted_while_a_request_runs(stories_ring_metrics):
    """Tokens, inter-token gaps and the dashboard's tokens/s move while a long answer streams, not
    only when it ends."""
    server = stories_ring_metrics
    before = scrape(server.url + "/metrics")
    pieces, during, live = 0, None, None
    for _ in server.client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=150,
                                              temperature=0, stream=True):
        pieces += 1
        if pieces == 30:  # mid-answer
            during = scrape(server.url + "/metrics")
            live = httpx.get(server.url + "/dashboard/state", timeout=30).json()
    after = scrape(server.url + "/metrics")
    assert pieces > 30
    mid = during["swarm_serve_tokens_generated_total"] - before["swarm_serve_tokens_generated_total"]
    assert 30 <= mid < 150, mid
    assert during["swarm_serve_inter_token_seconds_count"] - before["swarm_serve_inter_token_seconds_count"] == mid - 1
    assert during["swarm_serve_requests_total{status=ok}"] == before["swarm_serve_requests_total{status=ok}"]
    assert live["tokens_per_s"] > 0 and live["active"] == 1
    assert after["swarm_serve_tokens_generated_total"] - before["swarm_serve_tokens_generated_total"] == 150


@pytest.fixture(scope="module")
def stories_ring_metrics(metrics_ring, tmp_path_factory):
    from tests.support.serve import Server

    server = Server(metrics_ring.ring_spec(), tmp_path_factory.mktemp("serve-key"))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.process
def test_serve_with_a_receipt_dir_signs_every_request_and_counts_failed_receipts(metrics_ring, tmp_path):
    """``--receipt-dir``: each request's job receipt is saved and verifies; a receipt tampered with
    afterwards is counted once as a verification failure (by its check) when the dashboard reads it."""
    import json

    from swarm import receipts
    from tests.support.serve import Server

    out = tmp_path / "receipts"
    server = Server(metrics_ring.ring_spec(), tmp_path, receipt_dir=out)
    try:
        texts = [server.client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=6,
                                                  temperature=0).choices[0].text for _ in range(2)]
        files = sorted(out.glob("*.json"))
        m = scrape(server.url + "/metrics")
        verdicts = receipts.verify_files([str(f) for f in files])
        doc = json.loads(files[0].read_text())
        doc["output_ids"][0] = (doc["output_ids"][0] + 1) % 512  # the answer changed after signing
        files[0].write_text(json.dumps(doc))
        for _ in range(2):  # the dashboard verifies its directory on every poll; the file counts once
            state = httpx.get(server.url + "/dashboard/state", timeout=30).json()
        after = scrape(server.url + "/metrics")
    finally:
        server.stop()
    assert texts[0] == texts[1] and len(files) == 2
    assert m["swarm_serve_receipts_written_total"] == 2
    assert not any(k.startswith("swarm_serve_receipt_verification_failures_total") for k in m), m
    assert all(isinstance(v, receipts.Verified) for _, v in verdicts), verdicts
    assert all(len(doc["stage_receipts"]) == 3 for doc in (json.loads(f.read_text()) for f in files[1:]))
    assert sorted(j["verified"] for j in state["jobs"]) == [False, True]
    check = next(j["check"] for j in state["jobs"] if not j["verified"])
    assert after[f"swarm_serve_receipt_verification_failures_total{{check={check}}}"] == 1, after

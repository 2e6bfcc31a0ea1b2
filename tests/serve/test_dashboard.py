"""The dashboard (issue 18) in a real browser: headless Chromium loads `swarm serve`'s /dashboard over
a live 3-stage ring, and `swarm dashboard --receipts DIR` over a verified and a tampered receipt.

Chromium is Debian's `chromium` (`.ci/run` installs it with apt-get when missing); the
tests skip with a message saying so where it is not installed. Screenshots are kept in the tests'
temporary directories (the path is printed) for people to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from swarm.cli.launch import LocalRing, start_swarm
from swarm.ranges import LayerRange

RANGES = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; .ci/run does it)")
    return exe


def browse(chromium: str, url: str, out_dir: Path, name: str, width: int = 1200, height: int = 900,
           budget_ms: int = 4000) -> tuple[str, str]:
    """Load ``url`` headless, let its scripts run (polling included) for a few seconds of virtual
    time, save a screenshot; return (the DOM after the scripts ran, the browser's log)."""
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--enable-logging=stderr", "--v=0", f"--virtual-time-budget={budget_ms}",
             f"--window-size={width},{height}",
             f"--user-data-dir={out_dir / ('profile-' + name)}"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    shot = out_dir / f"{name}.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    print(f"screenshot: {shot}")
    return dom.stdout, dom.stderr


def console_errors(log: str) -> list[str]:
    """Console messages of the page that are errors (Chromium logs them as CONSOLE lines)."""
    return [line for line in log.splitlines() if "CONSOLE" in line and re.search(r"Uncaught|Error|error", line)]


def coverage_cells(dom: str) -> list[int]:
    """The holder count of each layer cell of the page's coverage bars, in order."""
    return [int(n) for n in re.findall(r'class="layer c[0-2]"[^>]*>(\d+)<', dom)]


def kernel_cells(dom: str) -> list[tuple[str, str, str]]:
    """(class, title, text) of each stage's kernels cell, in table order."""
    return re.findall(r'<td class="kernels ([a-z]+)"(?: title="([^"]*)")?>([^<]*)</td>', dom)


def plot_points(dom: str, plot_id: str) -> int:
    """How many points the latency plot ``plot_id`` draws."""
    m = re.search(rf'<svg id="{plot_id}"[^>]*>(.*?)</svg>', dom, re.S)
    return m.group(1).count('class="point"') if m else -1


@pytest.mark.process
def test_the_served_dashboard_shows_the_live_ring_and_its_throughput(stories_dir, chromium, tmp_path):
    from tests.support.serve import Server

    with LocalRing(str(stories_dir), RANGES, tmp_path, threads=1, extra_args=["--dtype", "float32"]) as ring:
        server = Server(ring.ring_spec(), tmp_path)
        try:
            before, log0 = browse(chromium, server.url + "/dashboard", tmp_path, "idle")
            assert console_errors(log0) == [], console_errors(log0)
            assert re.search(r'id="rate"[^>]*>0\.0<', before), "tokens/s is not 0 before any request"
            for _ in range(2):
                server.client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=24,
                                                 temperature=0)
            dom, log = browse(chromium, server.url + "/dashboard", tmp_path, "dashboard")
            phone, _ = browse(chromium, server.url + "/dashboard", tmp_path, "phone", width=390, height=844)
        finally:
            server.stop()
    assert console_errors(log) == [], console_errors(log)
    assert dom.count('class="stage-row"') == 3 and dom.count('class="stage"') == 3
    for sp in ring.stages:  # every stage's layers and (shortened) PeerId are on the page
        pid = sp.ready["peer_id"]
        assert f"{sp.layers.start}:{sp.layers.end}" in dom and f"{pid[:6]}...{pid[-4:]}" in dom
    rate = float(re.search(r'id="rate"[^>]*>([0-9.]+)<', dom).group(1))
    assert rate > 0, "tokens/s did not move after two requests"
    # layer coverage of the ring file: each of the 5 layers held once; latency over time: a point
    # per request in both plots, none before any request
    assert coverage_cells(dom) == [1, 1, 1, 1, 1] and "every layer is held" in dom
    # the kernels each stage runs, as its READY line said: fma with its ISA and library, or rows
    shown = [text for _, _, text in kernel_cells(dom)]
    ready = [sp.ready["kernels"] for sp in ring.stages]
    assert shown == [" ".join(x for x in (k["mode"], k["isa"]) if x) + (f", {k['library']}" if k["mode"] == "fma"
                                                                         else "") for k in ready], shown
    assert plot_points(dom, "ttft-plot") == 2 and plot_points(dom, "itl-plot") == 2
    assert plot_points(before, "ttft-plot") == 0
    assert "Once upon" not in dom  # no prompt text on the page
    assert "start swarm serve with --receipt-dir DIR" in dom  # no receipts: the page says how to get them
    assert phone.count('class="stage-row"') == 3


@pytest.mark.ring
@pytest.mark.process
def test_the_receipts_dashboard_names_the_failed_check_of_a_tampered_receipt(synthetic, chromium, tmp_path):
    from tests.support.ring import job_receipt

    model = synthetic("llama")
    receipts = tmp_path / "receipts"
    path = Path(job_receipt(model, tmp_path, [(0, 1), (1, 3), (3, 4)], [1, 5, 9, 3, 7, 2], receipts)["path"])
    doc = json.loads(path.read_text())
    doc["output_ids"] = list(doc["output_ids"])
    doc["output_ids"][0] = (doc["output_ids"][0] + 1) % 97  # the answer changed after signing
    (receipts / "tampered.json").write_text(json.dumps(doc))
    proc = start_swarm(["dashboard", "--receipts", str(receipts), "--port", "0"], dict(os.environ))
    try:
        line = proc.stdout.readline()
        url = re.search(r"(http://\S+/dashboard)", line).group(1)
        dom, log = browse(chromium, url, tmp_path, "receipts")
    finally:
        proc.terminate()
        proc.wait(10)
    assert console_errors(log) == [], console_errors(log)
    verdicts = re.findall(r'class="(ok|bad) verdict"[^>]*>([^<]*)<', dom)
    assert sorted(v for v, _ in verdicts) == ["bad", "ok"], verdicts
    bad = next(text for v, text in verdicts if v == "bad")
    assert bad.startswith("failed: ") and len(bad) > len("failed: "), bad
    assert "1 of 2 receipts verified" in dom
    # alone, the page has no requests of its own: no throughput or heal panels
    assert re.search(r'id="throughput-section" style="display: none;?"', dom), "throughput shown without a server"
    assert re.search(r'title="job signature: ', dom)  # the check's whole message on hover


@pytest.mark.process
def test_a_heal_shows_on_the_timeline(stories_dir, chromium, tmp_path):
    """A stage is SIGKILLed mid-answer; the request heals onto the spare, and the page lists the heal."""
    import os
    import signal

    from swarm.config import RingSpec, StageSpec
    from tests.support.serve import Server

    with LocalRing(str(stories_dir), [*RANGES, RANGES[1]], tmp_path, threads=1,
                   extra_args=["--dtype", "float32"]) as ring:
        full = ring.ring_spec()
        spec = RingSpec(model=full.model, stages=full.stages[:3], spares=(StageSpec(addr=full.stages[3].addr,
                                                                                      layers=full.stages[3].layers),))
        server = Server(spec, tmp_path)
        try:
            import httpx

            before = httpx.get(server.url + "/dashboard/state", timeout=30).json()
            victim = ring.stages[1].proc
            pieces = 0
            for chunk in server.client.completions.create(model="stories260k", prompt="Once upon a time",
                                                          max_tokens=200, temperature=0, stream=True):
                pieces += 1
                if pieces == 10:  # mid-answer: the middle stage dies
                    os.killpg(victim.pid, signal.SIGKILL)
            assert pieces > 10
            dom, log = browse(chromium, server.url + "/dashboard", tmp_path, "healed")
            from tests.support.metrics import scrape

            m = scrape(server.url + "/metrics")
        finally:
            server.stop()
    assert console_errors(log) == [], console_errors(log)
    heals = re.findall(r'<li class="heal">([^<]*)</li>', dom)
    assert len(heals) == 1 and "stage 1 [2, 4) replaced" in heals[0], heals
    assert dom.count('class="heal-mark"') == 1  # and on the throughput plot's time axis
    assert dom.count('class="stage-row"') == 3 and ">up<" in dom
    assert before["models"][0]["coverage"] == [1, 1, 2, 2, 1]  # the spare holds [2, 4) too
    assert coverage_cells(dom) == [1, 1, 1, 1, 1]  # healed onto it: no spare left
    assert m["swarm_serve_heal_events_total"] == 1
    for phase in ("detection", "swap", "replay", "total"):
        assert m[f"swarm_serve_heal_seconds_count{{phase={phase}}}"] == 1


PEER_IDS = ["12D3KooWFPYMKByWck88To64SnHVU4w5A4fBNgvHahZdGhrxaTEF",
            "12D3KooWByMaCC7Dboqf8u5HMfTippwxGup6aUvPDjAs4dm328HK",
            "12D3KooWMgCpxwDBc7dgNkwkgzXFhuApgsoYrA3PFJ4n73adXbhZ"]

# a page of the test's server that holds the dashboard in a frame of a phone's width and, once the
# dashboard's scripts have run, writes what it measured there into its own DOM (--dump-dom shows it)
PROBE = """<!doctype html><html><body style="margin:0">
<iframe id="f" src="/dashboard" style="width:390px;height:844px;border:0"></iframe><pre id="out"></pre>
<script>
const FONT = new URLSearchParams(location.search).get("font");
if (FONT) setTimeout(() => { document.getElementById("f").contentDocument.body.style.fontFamily = FONT; }, 1200);
setTimeout(() => {
  const d = document.getElementById("f").contentDocument;
  const labels = [...d.querySelectorAll("g.stage")].map(g => {
    const c = g.querySelector("circle").getBoundingClientRect(), r = c.width / 2;
    const cx = c.left + r, cy = c.top + r;
    return [...g.querySelectorAll("text")].map(t => {  // every corner of the label inside the circle
      const b = t.getBoundingClientRect();
      return [[b.left, b.top], [b.right, b.top], [b.left, b.bottom], [b.right, b.bottom]]
        .every(([x, y]) => Math.hypot(x - cx, y - cy) <= r + 0.5);
    });
  });
  document.getElementById("out").textContent = JSON.stringify({
    page_width: d.documentElement.scrollWidth, view_width: d.documentElement.clientWidth, labels,
    rate: d.getElementById("rate").textContent, status: d.getElementById("status").textContent,
    jobs_hint: d.getElementById("jobs-hint") ? d.getElementById("jobs-hint").textContent : null});
}, 3200);
</script></body></html>"""


KERNELS = [{"mode": "fma", "isa": "avx512", "library": "installed", "why": "", "bf16_dot": "vdpbf16ps"},
           {"mode": "fma", "isa": "avx2", "library": "built at run time", "why": ""},
           {"mode": "rows", "isa": "", "library": "torch", "why": "the fma kernels cannot run: SWARM_KERNELS=rows"}]


def served_state(tokens_per_s: float, receipts: str | None = None) -> dict:
    """A `swarm serve` dashboard state (the keys ``serve_state`` returns) of a healthy 3-stage ring."""
    from swarm.config import RingSpec, StageSpec
    from swarm.serve.dashboard import rate_series, ring_coverage

    stages = [{"index": i, "layers": [r.start, r.end], "peer_id": pid, "ok": True, "error": None, "sessions": 12,
               "kv_bytes": 123456789, "latency_ms": 1.5, "kernels": k}
              for i, (r, pid, k) in enumerate(zip(RANGES, PEER_IDS, KERNELS))]
    ring = RingSpec(model="m", stages=tuple(StageSpec(f"/ip4/127.0.0.1/tcp/{4001 + i}/p2p/{pid}", r)
                                            for i, (r, pid) in enumerate(zip(RANGES, PEER_IDS))))
    now = __import__("time").time()
    return {"model": "stories260k", "num_layers": 5, "status": "ok", "stages": stages,
            "tokens_per_s": tokens_per_s, "rate_series": rate_series([(now - 3, int(tokens_per_s * 10))], now),
            "latency_series": [], "ttft_p50_s": None, "itl_p50_s": None, "requests": 1, "active": 0, "heals": [],
            "jobs": [], "dht": False, "models": [ring_coverage(ring, "stories260k", 5)], "coverage_error": None,
            "receipts": receipts}


@contextmanager
def state_server(answers: list):
    """Serve the real dashboard page with ``answers`` as its successive /dashboard/state replies (a
    dict is answered as JSON, an int as that HTTP status; the last one repeats), and the probe page at
    /probe; yields the base URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from swarm.serve.dashboard import page

    queue = list(answers)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/dashboard/state":
                answer = queue.pop(0) if len(queue) > 1 else queue[0]
                body, status = (json.dumps(answer).encode(), 200) if isinstance(answer, dict) else (b"failed", answer)
                ctype = "application/json"
            else:
                body, status, ctype = (PROBE.encode() if self.path.startswith("/probe") else page()), 200, "text/html"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def probe(chromium: str, tmp_path: Path, answers: list, font: str = "") -> dict:
    """Load the probe page (the dashboard in a 390 px wide frame, its font switched to ``font`` after the
    first draw, if given) over ``answers`` (as ``state_server``), and return what it measured there."""
    with state_server(answers) as url:
        dom, log = browse(chromium, f"{url}/probe?font={font}", tmp_path, "probe", width=800, height=900,
                          budget_ms=8000)
    assert console_errors(log) == [], console_errors(log)
    import html

    out = re.search(r'<pre id="out">(.*?)</pre>', dom, re.S)
    assert out and out.group(1), dom[-2000:]
    return json.loads(html.unescape(out.group(1)))


@pytest.mark.process
@pytest.mark.parametrize("font", ["", "monospace", "serif"])  # the page's font, and wider ones a phone may use
def test_at_a_phone_width_nothing_overflows_and_peer_ids_stay_in_their_circles(chromium, tmp_path, font):
    got = probe(chromium, tmp_path, [served_state(3.2)], font)
    assert got["page_width"] <= got["view_width"] <= 390, got  # no horizontal scrolling of the page
    assert len(got["labels"]) == 3 and all(all(inside) for inside in got["labels"]), got["labels"]
    assert got["rate"] == "3.2", got


@pytest.mark.process
def test_recent_jobs_says_how_to_get_receipts_listed(chromium, tmp_path):
    assert "--receipt-dir" in probe(chromium, tmp_path, [served_state(0.0)])["jobs_hint"]
    assert probe(chromium, tmp_path / "2", [served_state(0.0, receipts="/srv/r")])["jobs_hint"] == \
        "no job receipts in /srv/r yet"


@pytest.mark.process
def test_the_headline_never_shows_a_stale_rate_when_the_state_cannot_be_read(chromium, tmp_path):
    """The page showed 0.0 tok/s while its state said 3.2: a poll that fails must not leave the last
    number up as if it were current."""
    got = probe(chromium, tmp_path, [served_state(3.2), 500])
    assert got["rate"] == "-" and "cannot reach the server" in got["status"] and "500" in got["status"], got


@pytest.mark.process
def test_the_stage_table_shows_audits_and_the_stages_shut_out(chromium, tmp_path):
    state = served_state(1.0)
    state["stages"][0]["audit"] = {"proof": None, "why": None, "audited": 3, "passed": 3, "failed": 0}
    state["stages"][2]["audit"] = {"proof": "refused", "why": "REFUSED (honest stage framed): ...", "audited": 1,
                                   "passed": 1, "failed": 0}
    state.update(shut_out=[{"peer_id": "12D3KooWCheater", "layers": [2, 4], "why": "VALID proof: stage X ..."}],
                 audits="/srv/audits.json", audits_error=None)
    with state_server([state]) as url:
        dom, log = browse(chromium, url + "/dashboard", tmp_path, "audits")
    assert console_errors(log) == [], console_errors(log)
    cells = re.findall(r'<td class="audit ([a-z]+)"(?: title="([^"]*)")?>([^<]*)</td>', dom)
    assert [(c, text) for c, _, text in cells] == [("ok", "3/3/0"), ("num", "-"), ("warn", "1/1/0, proof refused"),
                                                   ("bad", "proof verified: excluded")], cells
    assert cells[2][1].startswith("REFUSED (honest stage framed)") and cells[3][1].startswith("VALID proof")
    assert dom.count('class="stage-row"') == 3 and dom.count('class="excluded-row"') == 1
    assert "audits: audited/passed/failed from /srv/audits.json" in dom


@pytest.mark.process
def test_the_stage_table_shows_the_kernels_each_stage_runs_and_why_rows(chromium, tmp_path):
    state = served_state(1.0)
    state["stages"].append({**state["stages"][2], "index": 3, "ok": False, "error": "no answer within 5 s",
                            "kernels": None})  # a stage that did not answer: nothing known of its kernels
    with state_server([state]) as url:
        dom, log = browse(chromium, url + "/dashboard", tmp_path, "kernels")
    assert console_errors(log) == [], console_errors(log)
    assert kernel_cells(dom) == [("fast", "installed; bfloat16 pairs by vdpbf16ps", "fma avx512, installed"),
                                 ("fast", "built at run time", "fma avx2, built at run time"),
                                 ("warn", "the fma kernels cannot run: SWARM_KERNELS=rows", "rows"),
                                 ("num", "", "-")], kernel_cells(dom)


def test_ring_coverage_counts_only_stages_that_answer_and_the_spares():
    from swarm.config import RingSpec, StageSpec
    from swarm.serve.dashboard import ring_coverage

    addr = "/ip4/127.0.0.1/tcp/1/p2p/X"
    stages = tuple(StageSpec(addr, r) for r in RANGES)
    ring = RingSpec(model="m", stages=stages, spares=(StageSpec(addr, RANGES[1]),))
    assert ring_coverage(ring, "m", 5)["coverage"] == [1, 1, 2, 2, 1]
    down = ring_coverage(ring, "m", 5, frozenset({1}))
    assert down["coverage"] == [1, 1, 1, 1, 1] and down["holders"] == 3 and down["uncovered"] == []
    bare = ring_coverage(RingSpec(model="m", stages=stages), "m", 5, frozenset({1}))
    assert bare["coverage"] == [1, 1, 0, 0, 1] and bare["uncovered"] == [[2, 4]]


@pytest.mark.ring
def test_an_unchanged_receipt_directory_is_not_verified_again_on_every_poll(synthetic, tmp_path, monkeypatch):
    """The page polls every second: the same files give the last verdicts without verifying again;
    a file that changed (tampered after a first poll) is verified again and fails."""
    from swarm.serve import dashboard
    from swarm import receipts as receipts_mod
    from tests.support.ring import job_receipt

    receipts = tmp_path / "receipts"
    path = Path(job_receipt(synthetic("llama"), tmp_path, [(0, 2), (2, 4)], [1, 5, 9, 3], receipts)["path"])
    calls = []
    real = receipts_mod.verify_files
    monkeypatch.setattr(receipts_mod, "verify_files", lambda paths, **kw: calls.append(paths) or real(paths, **kw))
    first = dashboard.jobs_from_dir(receipts)
    first[0]["verified"] = "changed by a caller"  # callers get copies: the cache stays as it was
    again = dashboard.jobs_from_dir(receipts)
    assert len(calls) == 1 and again[0]["verified"] is True and again[0]["file"] == path.name
    doc = json.loads(path.read_text())
    doc["output_ids"] = [(t + 1) % 97 for t in doc["output_ids"]]
    path.write_text(json.dumps(doc, indent=1))
    tampered = dashboard.jobs_from_dir(receipts)
    assert len(calls) == 2 and tampered[0]["verified"] is False and tampered[0]["check"], tampered

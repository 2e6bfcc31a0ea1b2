"""`swarm serve`'s request lifecycle: size limits before work, admission before the status, SSE
keep-alives, a client leaving during a prefill, the drain on SIGTERM / Ctrl-C.

Stages are in-process ``StageServer``s on loopback (stories260k) whose forwards can be slowed (a
slow stage: the worker thread sleeps before each step), with ``serve_api`` in the same trio loop
in a thread; the drain tests run the real ``swarm serve`` command against them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import trio
import yaml

from swarm.cli.launch import start_swarm
from swarm.config import SpecConfig
from swarm.serve.app import serve_api
from swarm.serve.config import ServeConfig
from swarm.serve.lifecycle import Shutdown
from tests.support.ring import start_ring

pytestmark = [pytest.mark.ring, pytest.mark.process]

RANGES = [(0, 2), (2, 4), (4, 5)]
PROMPT = "Once upon a time"


class Ring:
    """In-process stages (and, with ``serve``, ``serve_api``) in a thread with its own trio loop.
    ``delay_s``: each stage sleeps this long in its worker thread before every forward step."""

    def __init__(self, model_dir: Path, key_dir: Path, serve: bool = True, stage_kwargs: dict | None = None,
                 ranges=tuple(RANGES), **serve_kwargs):
        self.delay_s = 0.0
        self.ranges = list(ranges)
        self.box: dict = {}
        self.shutdown = Shutdown()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       args=(model_dir, key_dir, serve, stage_kwargs or {}, serve_kwargs))
        self.thread.start()
        end = time.monotonic() + 120
        while "ready" not in self.box and "error" not in self.box:
            assert time.monotonic() < end, "the ring did not start"
            time.sleep(0.05)
        if "error" in self.box:
            raise self.box["error"]
        self.spec, self.stages = self.box["spec"], self.box["stages"]
        self.url = self.box.get("info", {}).get("url")

    def _slow(self, block):
        forward, steps = block.forward_batch, block.forward_steps

        def slowed(*args, **kwargs):
            time.sleep(self.delay_s)
            return forward(*args, **kwargs)

        def slowed_steps(*args, **kwargs):  # a long prompt's slice computed alone (pausable)
            time.sleep(self.delay_s)
            return steps(*args, **kwargs)

        block.forward_batch, block.forward_steps = slowed, slowed_steps

    def _run(self, model_dir, key_dir, serve, stage_kwargs, serve_kwargs):
        async def main():
            async with trio.open_nursery() as nursery:
                self.box["token"] = trio.lowlevel.current_trio_token()
                self.box["scope"] = nursery.cancel_scope
                spec, stages = await start_ring(nursery, model_dir, self.ranges, key_dir, "float32", **stage_kwargs)
                for server in stages:
                    self._slow(server.block)
                self.box.update(spec=spec, stages=stages)
                if serve:
                    config = ServeConfig.of(host="127.0.0.1", port=0, key_path=key_dir / "coord.key", **serve_kwargs)
                    self.box["info"] = await nursery.start(lambda task_status: serve_api(
                        spec, config, shutdown=self.shutdown, task_status=task_status))
                self.box["ready"] = True

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the test thread
            self.box["error"] = exc

    def sessions(self) -> list[int]:
        return [len(s.sessions) for s in self.stages]

    def stop(self):
        if "scope" in self.box:
            try:
                trio.from_thread.run_sync(self.box["scope"].cancel, trio_token=self.box["token"])
            except trio.RunFinishedError:
                pass
        self.thread.join(30)


@pytest.fixture
def ring_factory(stories_dir, tmp_path):
    made = []

    def make(**kwargs) -> Ring:
        ring = Ring(stories_dir, tmp_path / f"keys{len(made)}", **kwargs)
        made.append(ring)
        return ring

    yield make
    for ring in made:
        ring.stop()


def sse_lines(res) -> list[tuple[float, str]]:
    """(arrival time, line) of every non-empty line of a server-sent event stream."""
    return [(time.monotonic(), line) for line in res.iter_lines() if line]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def until(predicate, timeout_s: float, step_s: float = 0.05) -> float:
    """Poll ``predicate`` until true; returns the seconds it took (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        time.sleep(step_s)
    return time.monotonic() - t0


# ---- 3: one huge request never freezes the others -----------------------------------------------


@pytest.mark.serial
def test_a_huge_request_is_refused_before_the_work_and_never_stalls_the_others(ring_factory):
    """A 10 MB body is refused (413) before parsing, a 5 MB prompt (under the body limit) before
    tokenizing (400, it cannot fit 512 tokens), as are a chat of 300 long messages and a prompt
    list; meanwhile a stream's tokens and /health keep flowing. Before: the prompt was tokenized
    on the event loop (seconds), every stream and /health froze, and the answer was a 400 at the end."""
    ring = ring_factory()
    ring.delay_s = 0.02  # 60 tokens take a few seconds: the stream runs while the huge requests arrive
    url = ring.url
    stream_times: list[float] = []
    health_s: list[float] = []
    stop = threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}) as res:
            assert res.status_code == 200
            for t, line in sse_lines(res):
                stream_times.append(t)
        stop.set()

    def health():
        while not stop.is_set():
            t0 = time.monotonic()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            health_s.append(time.monotonic() - t0)
            time.sleep(0.05)

    huge = [("/v1/completions", {"prompt": "hello world. " * 800_000, "max_tokens": 4}, 413, "request_too_large"),
            ("/v1/completions", {"prompt": "hello world. " * 400_000, "max_tokens": 4}, 400,
             "context_length_exceeded"),
            ("/v1/completions", {"prompt": ["hello world. " * 400_000], "max_tokens": 4}, 400,
             "context_length_exceeded"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world. " * 1000}] * 300,
                                      "max_tokens": 4}, 400, "context_length_exceeded")]
    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(stream)
        polling = pool.submit(health)
        until(lambda: len(stream_times) >= 3, 30)
        for path, body, status, code in huge:
            t0 = time.monotonic()
            res = httpx.post(url + path, json=body, timeout=60)
            took = time.monotonic() - t0
            assert res.status_code == status and res.json()["error"]["code"] == code, res.text[:300]
            assert took < 3.0, f"{path} {status} took {took:.1f} s"
        streaming.result(timeout=60)
        polling.result(timeout=60)
    assert max(health_s) < 1.0, f"/health waited {max(health_s):.2f} s"
    assert max(gaps(stream_times)) < 1.5, f"the stream stalled {max(gaps(stream_times)):.2f} s"
    # a prompt that fits still works, and so does a body of just over the limit's size in valid JSON
    ok = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
@pytest.mark.serial
def test_tokenizing_long_prompts_runs_off_the_event_loop(smollm2_dir, tmp_path, monkeypatch):
    """SmolLM2 (one in-process stage): four chats of 650,000 characters each, under the character
    bound (8,192 positions x 81) so each is really templated and tokenized (~0.6 s apiece, ~150,000
    tokens, then refused as too long): /health and a running stream keep answering meanwhile.
    Before: the tokenizing ran on the event loop, four in a row."""
    monkeypatch.setenv("SWARM_CACHE", str(smollm2_dir.parent.parent))
    ring = Ring(smollm2_dir, tmp_path / "keys", ranges=[(0, 30)])
    try:
        url = ring.url
        ring.delay_s = 0.05
        health_s: list[float] = []
        stream_times: list[float] = []
        stop = threading.Event()

        def stream():
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 60,
                    "temperature": 0, "stream": True}) as res:
                assert res.status_code == 200
                stream_times.extend(t for t, _ in sse_lines(res))

        def health():
            while not stop.is_set():
                t0 = time.monotonic()
                assert httpx.get(url + "/health", timeout=30).status_code == 200
                health_s.append(time.monotonic() - t0)
                time.sleep(0.05)

        def long_chat(_):
            body = {"messages": [{"role": "user", "content": "hello world. " * 50_000}], "max_tokens": 4}
            res = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            return res.status_code, res.json()["error"]

        with ThreadPoolExecutor(6) as pool:
            streaming = pool.submit(stream)
            polling = pool.submit(health)
            until(lambda: len(stream_times) >= 2, 60)
            t0 = time.monotonic()
            answers = list(pool.map(long_chat, range(4)))
            took = time.monotonic() - t0
            stop.set()
            polling.result(60)
            streaming.result(120)
        for status, error in answers:
            assert status == 400 and error["code"] == "context_length_exceeded"
            assert "tokens" in error["message"] and "characters" not in error["message"]  # really tokenized
        print(f"took {took:.2f} s, /health at most {max(health_s):.2f} s, stream gap {max(gaps(stream_times)):.2f} s")
        assert took > 0.5, took  # the work was real
        assert max(health_s) < 1.0, f"/health waited {max(health_s):.2f} s while the prompts were tokenized"
        assert max(gaps(stream_times)) < 1.5, f"the stream stalled {max(gaps(stream_times)):.2f} s"
    finally:
        ring.stop()


# ---- 5: a refused stream gets 503, not 200 ------------------------------------------------------


def test_a_stream_the_ring_refuses_gets_503_with_retry_after(ring_factory):
    """A KV budget that holds one session at the head: of 10 concurrent streaming completions the
    admitted ones get 200 and run to [DONE], every other one a 503 with Retry-After and the
    ring_busy error as its body (not a 200 with the error inside, which clients do not retry).
    A draining stage refuses the same way."""
    ring = ring_factory(stage_kwargs={"kv_budget_mb": 0.1})  # one session of ~105 positions at the head
    ring.delay_s = 0.01
    body = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True}

    def one(i):  # every fourth one not streaming: its refusal is a 503 with Retry-After as well
        with httpx.stream("POST", ring.url + "/v1/completions", json={**body, "stream": i % 4 != 3},
                          timeout=120) as res:
            return res.status_code, res.headers.get("retry-after"), [line for _, line in sse_lines(res)]

    # warm: a stage's first batched session proves its batch tile between its KV budget check and
    # taking the session, so opens racing in then could all pass the check
    assert one(0)[0] == 200
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(10)))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert ok and refused, [r[0] for r in results]
    for _, _, lines in ok:
        if lines[0].startswith("{"):  # not streaming
            assert json.loads(lines[0])["choices"][0]["finish_reason"] == "length"
            continue
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2], lines[-3:]
        assert not any('"error"' in x for x in lines)
    for status, retry_after, lines in refused:
        assert status == 503 and retry_after is not None and int(retry_after) >= 1
        assert json.loads(lines[0])["error"]["code"] == "ring_busy", lines
    until(lambda: ring.sessions() == [0, 0, 0], 15)
    ring.stages[1].draining = True  # another refusal of the same kind: a stage shutting down
    try:
        status, retry_after, lines = one(0)
    finally:
        ring.stages[1].draining = False
    assert status == 503 and retry_after is not None and "draining" in json.loads(lines[0])["error"]["message"]
    plain = httpx.post(ring.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 100


# ---- 7: keep-alives while a stream waits; a client leaving a long prefill -----------------------


@pytest.mark.serial
def test_a_waiting_stream_sends_keepalives(ring_factory):
    """A slow prefill, and a stream queued behind --max-concurrency: SSE comments arrive at least
    every keepalive_s (0.3 s here) until the tokens do; the stream then ends normally."""
    ring = ring_factory(keepalive_s=0.3, max_concurrency=1)
    ring.delay_s = 0.4  # every forward step of every stage: a token takes ~1.2 s, the prefill more
    t0 = time.monotonic()
    with httpx.stream("POST", ring.url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT * 20, "max_tokens": 2, "temperature": 0, "stream": True}) as res:
        assert res.status_code == 200
        lines = sse_lines(res)
    first_data = next(i for i, (_, x) in enumerate(lines) if x.startswith("data: {"))
    assert first_data >= 2 and all(x == ": keep-alive" for _, x in lines[:first_data]), lines[:first_data + 1]
    assert max(gaps([t0] + [t for t, _ in lines])) < 0.9, gaps([t0] + [t for t, _ in lines])
    assert lines[-1][1] == "data: [DONE]"

    ring.delay_s = 0.05
    with ThreadPoolExecutor(1) as pool:  # holds the one ring client for a few seconds
        first = pool.submit(httpx.post, ring.url + "/v1/completions", timeout=60,
                            json={"prompt": PROMPT, "max_tokens": 25, "temperature": 0})
        until(lambda: ring.sessions()[0] == 1, 30)
        t0 = time.monotonic()
        with httpx.stream("POST", ring.url + "/v1/completions", timeout=60, json={
                "prompt": "The cat", "max_tokens": 4, "temperature": 0, "stream": True}) as res:
            assert res.status_code == 200
            queued = sse_lines(res)
        assert first.result().status_code == 200
    assert queued[0][1] == ": keep-alive" and queued[-1][1] == "data: [DONE]"
    assert max(gaps([t0] + [t for t, _ in queued])) < 0.9


@pytest.mark.serial
def test_a_client_leaving_during_a_long_prefill_frees_its_session_at_once(ring_factory):
    """A ~450-token prompt in 16-position chunks through slow stages (a prefill of many seconds):
    the client hangs up once the session is open, and every stage drops the session within a
    chunk or two, not after the prefill (the old stop point was the first token)."""
    ring = ring_factory(keepalive_s=0.3, spec=SpecConfig(prefill_chunk=16))
    # warm at full speed: a ring client's connect and a stage's first batched session (its tile proof)
    warm = httpx.post(ring.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert warm.status_code == 200
    ring.delay_s = 0.25
    with httpx.stream("POST", ring.url + "/v1/completions", timeout=60, json={
            "prompt": "Once upon a time there was a dog. " * 50, "max_tokens": 5, "temperature": 0,
            "stream": True}) as res:
        assert res.status_code == 200
        until(lambda: ring.sessions() == [1, 1, 1], 10)  # the prefill has begun
        left = time.monotonic()
    freed_s = until(lambda: ring.sessions() == [0, 0, 0], 30)
    assert freed_s < 2.5, f"freed {freed_s:.1f} s after the client left"
    assert time.monotonic() - left < 5
    health = httpx.get(ring.url + "/health", timeout=30).json()
    assert health["active_requests"] == 0 and health["status"] == "ok"


# ---- 6: SIGTERM drains, Ctrl-C ends streams cleanly --------------------------------------------


def _serve_process(ring: Ring, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    ring_file = tmp_path / "ring.yaml"
    ring_file.write_text(yaml.safe_dump(ring.spec.to_dict()))
    proc = start_swarm(["serve", "--ring", str(ring_file), "--port", "0", "--key", str(tmp_path / "c.key"), *args],
                       dict(os.environ))
    line = proc.stdout.readline()
    assert line.startswith("swarm serve: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    return proc, line.split()[2].removesuffix("/v1")


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.serial
def test_sigterm_drains_in_flight_requests_then_exits_0(ring_factory, tmp_path):
    """SIGTERM with three requests in flight: new requests get 503 + Retry-After and /health says
    draining; the short stream finishes normally; at --drain-timeout-s the long stream gets an
    error event and [DONE] and the long non-streaming request a 503; the log says so; exit 0, and
    the stages hold no session."""
    ring = ring_factory(serve=False)
    ring.delay_s = 0.03
    proc, url = _serve_process(ring, tmp_path, "--drain-timeout-s", "6")
    try:
        def stream(max_tokens):
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as res:
                return res.status_code, [line for _, line in sse_lines(res)]

        with ThreadPoolExecutor(3) as pool:
            short = pool.submit(stream, 25)  # about 3 s beside the others
            long = pool.submit(stream, 450)
            plain = pool.submit(httpx.post, url + "/v1/completions", timeout=60,
                                json={"prompt": "The cat", "max_tokens": 450, "temperature": 0})
            until(lambda: ring.sessions() == [3, 3, 3], 30)
            os.kill(proc.pid, signal.SIGTERM)
            until(lambda: httpx.get(url + "/health", timeout=30).status_code == 503, 10)
            assert httpx.get(url + "/health", timeout=30).json()["status"] == "draining"
            refused = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "server_shutting_down"
            (s_status, s_lines), (l_status, l_lines), p = short.result(60), long.result(60), plain.result(60)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
    finally:
        _reap(proc)
    assert s_status == 200 and s_lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in s_lines[-2]
    assert l_status == 200 and l_lines[-1] == "data: [DONE]"
    assert json.loads(l_lines[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert p.status_code == 503 and p.json()["error"]["code"] == "server_shutting_down"
    assert "serve.draining requests=3" in err and "serve.drained finished=1 ended=2" in err, err[-2000:]
    assert "drained (1 requests finished, 2 ended at the deadline)" in err
    until(lambda: ring.sessions() == [0, 0, 0], 15)


@pytest.mark.slow
def test_ctrl_c_ends_streams_with_an_error_event_and_exits_0(ring_factory, tmp_path):
    ring = ring_factory(serve=False)
    ring.delay_s = 0.03
    proc, url = _serve_process(ring, tmp_path)
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 450, "temperature": 0, "stream": True}) as res:
            lines = []
            for line in res.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 3:  # one Ctrl-C (a second would stop at once, by design)
                        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
    finally:
        _reap(proc)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert "serve.drained finished=0 ended=1" in err, err[-2000:]
    until(lambda: ring.sessions() == [0, 0, 0], 15)

"""`swarm serve` against slow, idle and too many clients (issue 45 item 2): header and body deadlines,
the connection cap that keeps room for /health and new requests, and a flood under a low open-file
limit that leaves one log line per condition, not a traceback flood.

The clients are raw sockets on loopback (what a Slowloris / R-U-Dead-Yet client does: a request's
headers, then a byte of body now and then); the stages are in-process ``StageServer``s (stories260k,
one stage) with ``serve_api`` in the same trio loop in a thread, or the real ``swarm serve`` command.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from swarm.cli.launch import start_swarm
from swarm.listen import OncePerCondition
from swarm.serve.app import serve_api
from swarm.serve.config import ServeConfig
from swarm.serve.guard import RateLog, default_max_connections
from tests.support.ring import start_ring
from tests.support.serve import LoopThread

SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 4096\r\n\r\n{")
SLOW_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
IDLE_KEEPALIVE = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class Served(LoopThread):
    """One in-process stage holding all of stories260k's layers and, unless ``serve`` is False,
    ``serve_api`` over it (``serve_kwargs``: ServeConfig fields), in a thread with its own trio loop."""

    def __init__(self, model_dir: Path, key_dir: Path, serve: bool = True, **serve_kwargs):
        super().__init__()

        async def main(nursery, box):
            box["spec"], _ = await start_ring(nursery, model_dir, [(0, 5)], key_dir, "float32")
            if serve:
                config = ServeConfig.of(host="127.0.0.1", port=0, key_path=key_dir / "coord.key", **serve_kwargs)
                box["info"] = await nursery.start(
                    lambda task_status: serve_api(box["spec"], config, task_status=task_status))

        box = self.start(main)
        self.spec = box["spec"]
        self.url = box.get("info", {}).get("url")
        self.port = int(self.url.rsplit(":", 1)[1]) if self.url else None

@pytest.fixture
def served(stories_dir, tmp_path):
    made = []

    def make(**kwargs) -> Served:
        s = Served(stories_dir, tmp_path / f"keys{len(made)}", **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


class Clients:
    """``n`` raw client sockets to ``port``: each sends ``first``, then (``trickle``) one byte every
    ``step_s``; ``step()`` also reads what the server sent and notes when it closed (EOF or reset)."""

    def __init__(self, port: int, n: int, first: bytes, trickle: bytes | None = b" ", step_s: float = 0.2):
        self.trickle, self.step_s = trickle, step_s
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
        self.t0 = time.monotonic()
        self.got = [b""] * n
        self.closed_at: list[float | None] = [None] * n
        for i, s in enumerate(self.socks):
            try:
                s.sendall(first)
            except OSError:  # closed already, for a newer connection at the cap
                self.closed_at[i] = 0.0
            s.setblocking(False)  # a socket with a timeout would wait out its timeout on each empty recv

    def step(self) -> None:
        now = time.monotonic()
        for i, s in enumerate(self.socks):
            if self.closed_at[i] is not None:
                continue
            try:
                while True:
                    data = s.recv(65536, socket.MSG_DONTWAIT)
                    if not data:
                        self.closed_at[i] = now - self.t0
                        break
                    self.got[i] += data
                if self.closed_at[i] is None and self.trickle:
                    s.send(self.trickle)
            except BlockingIOError:
                if self.trickle:
                    try:
                        s.send(self.trickle)
                    except OSError:
                        self.closed_at[i] = now - self.t0
            except OSError:  # reset: the server closed with our trickled bytes unread
                self.closed_at[i] = now - self.t0

    def run(self, until, timeout_s: float) -> None:
        """Trickle and watch until ``until(self)``, for at most ``timeout_s`` from now."""
        end = time.monotonic() + timeout_s
        while not until(self) and time.monotonic() < end:
            self.step()
            time.sleep(self.step_s)

    @property
    def closed(self) -> int:
        return sum(t is not None for t in self.closed_at)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def timed_get(url: str) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    res = httpx.get(url, timeout=30)
    return time.monotonic() - t0, res


@pytest.mark.ring
@pytest.mark.serial
def test_slow_bodies_are_cut_at_the_body_deadline_and_health_answers_meanwhile(served):
    # today's code: a trickle never ends, none of the 20 is ever cut
    srv = served(header_timeout_s=1.0, body_timeout_s=1.5, max_connections=64)
    stalled = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    stalled.sendall(SLOW_BODY)  # then nothing: the server reads all we sent, so its 408 reaches us intact
    clients = Clients(srv.port, 20, SLOW_BODY)
    try:
        clients.run(lambda c: time.monotonic() - c.t0 > 0.6, 5)
        took_s, res = timed_get(srv.url + "/health")
        assert res.status_code == 200 and took_s < 2.0, (took_s, res.text)
        clients.run(lambda c: c.closed == 20, 1.5 + 4.0)
        assert clients.closed == 20, clients.closed_at
        assert max(clients.closed_at) < 1.5 + 3.0, clients.closed_at
        answer = b""
        while chunk := stalled.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"code":"request_timeout"' in answer.replace(b" ", b""), answer
        # the server still serves: a real completion right after
        done = httpx.post(srv.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=60)
        assert done.status_code == 200 and done.json()["choices"][0]["text"], done.text
    finally:
        clients.close()
        stalled.close()


@pytest.mark.ring
@pytest.mark.serial
@pytest.mark.parametrize("first,trickle", [(SLOW_HEADERS, b"a"), (IDLE_KEEPALIVE, None)],
                         ids=["slow_headers", "idle_keepalive"])
def test_slow_headers_and_idle_keepalive_are_closed_at_the_header_deadline(served, first, trickle):
    # today's code: hypercorn's 5 s keep-alive timer, whatever the operator wants
    srv = served(header_timeout_s=1.0, body_timeout_s=30.0, max_connections=64)
    clients = Clients(srv.port, 10, first, trickle)
    try:
        clients.run(lambda c: c.closed == 10, 1.0 + 4.0)
        assert clients.closed == 10 and max(clients.closed_at) < 1.0 + 2.0, clients.closed_at
        if trickle is None:  # each got its answer before it idled out
            assert all(g.startswith(b"HTTP/1.1 200") for g in clients.got), [g[:40] for g in clients.got]
        took_s, res = timed_get(srv.url + "/health")
        assert res.status_code == 200 and took_s < 2.0
    finally:
        clients.close()


@pytest.mark.ring
@pytest.mark.serial
def test_at_the_connection_cap_the_oldest_waiting_clients_make_room(served):
    # 24 slow bodies against a cap of 8, deadlines far away: /health and a completion still get in
    # at once, because the oldest connections still sending their request are closed for them
    srv = served(header_timeout_s=30.0, body_timeout_s=30.0, max_connections=8)
    clients = Clients(srv.port, 24, SLOW_BODY)
    try:
        clients.run(lambda c: c.closed >= 16, 5.0)
        assert clients.closed >= 16, clients.closed_at
        assert all(t is not None for t in clients.closed_at[:16]), clients.closed_at  # the oldest first
        took_s, res = timed_get(srv.url + "/health")
        assert res.status_code == 200 and took_s < 2.0, (took_s, res.text)
        done = httpx.post(srv.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=60)
        assert done.status_code == 200, done.text
        clients.step()
        assert sum(t is None for t in clients.closed_at) <= 8  # never more than the cap open
    finally:
        clients.close()


@pytest.mark.ring
def test_clients_that_stop_reading_are_closed_at_the_send_deadline_and_their_generation_stops(served):
    """Three clients ask for long streamed answers and read none of it (a 1 KB receive buffer): once a write
    to each cannot complete for --send-timeout-s, the server closes it, its generation stops (the answer's
    400 tokens are never all sent) and the server is idle again; /health answers throughout."""
    s = served(send_timeout_s=2.0)
    body = (b'{"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 400, "stream": true, '
            b'"temperature": 0}')
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    socks = []
    for _ in range(3):
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        c.connect(("127.0.0.1", s.port))
        c.sendall(request)
        socks.append(c)
    try:
        end, health = time.monotonic() + 30, {}
        while time.monotonic() < end:
            time.sleep(0.5)
            waited, res = timed_get(s.url + "/health")
            health = res.json()
            assert res.status_code == 200 and waited < 5
            if health["active_requests"] == 0:
                break
        assert health["active_requests"] == 0, health
        for c in socks:  # what the server wrote before it gave up, then the end of the connection
            c.settimeout(5)
            got = b""
            while chunk := c.recv(65536):
                got += chunk
            assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in got, got[-200:]
    finally:
        for c in socks:
            c.close()


def test_default_max_connections_keeps_headroom_for_the_ring():
    assert default_max_connections(256) == 128
    assert default_max_connections(1024) == 768
    assert default_max_connections(100) == 16
    assert default_max_connections(10**6) == 4096
    import resource

    assert default_max_connections(resource.RLIM_INFINITY) == 4096


def test_rate_log_and_accept_filter_log_one_line_per_condition(caplog):
    now = [0.0]
    logger = logging.getLogger("tests.rate")
    rate = RateLog(logger, interval_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="tests.rate"):
        for _ in range(50):
            rate.log(logging.WARNING, "k", "cond a=%d", 1)
        rate.log(logging.WARNING, "other", "cond b")
        now[0] = 61
        rate.log(logging.WARNING, "k", "cond a=%d", 1)
    assert [r.getMessage() for r in caplog.records] == ["cond a=1", "cond b", "cond a=1 repeats=49"]

    caplog.clear()
    trio_log = logging.getLogger("tests.trio_accept")
    filt = OncePerCondition(interval_s=60, clock=lambda: now[0])
    trio_log.addFilter(filt)
    with caplog.at_level(logging.ERROR, logger="tests.trio_accept"):
        for _ in range(30):  # as trio.serve_listeners logs an accept out of descriptors, every 0.1 s
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                trio_log.error("accept returned %s (%s); retrying in %s seconds", "EMFILE", "Too many open files",
                               0.1, exc_info=True)
        now[0] = 200
        trio_log.error("accept returned %s (%s); retrying in %s seconds", "EMFILE", "Too many open files", 0.1)
    assert len(caplog.records) == 2 and caplog.records[0].exc_info is None, caplog.text
    assert "Traceback" not in caplog.text and "(29 more since the last such line)" in caplog.text


def _reap(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.process
@pytest.mark.ring
def test_swarm_serve_under_ulimit_256_outlives_300_slow_bodies(served, tmp_path):
    # the run: `ulimit -n 256`, 240 connections trickling bodies (300 here, past what fits).
    # Today's code: accept fails with EMFILE (a traceback each 0.1 s), /health and requests hang
    ring = served(serve=False)
    ring_file = tmp_path / "ring.yaml"
    ring_file.write_text(yaml.safe_dump(ring.spec.to_dict()))
    receipts = tmp_path / "receipts"
    receipts.mkdir()
    proc = start_swarm(["serve", "--ring", str(ring_file), "--port", "0", "--key", str(tmp_path / "c.key"),
                        "--receipt-dir", str(receipts)], dict(os.environ),
                       prefix=["sh", "-c", 'ulimit -n 256 && exec "$@"', "sh"])
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.extend(iter(proc.stderr.readline, "")), daemon=True)
    drain.start()
    clients = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("swarm serve: http://127.0.0.1:"), (line, "".join(stderr))
        url = line.split()[2].removesuffix("/v1")
        clients = Clients(int(url.rsplit(":", 1)[1]), 300, SLOW_BODY, step_s=1.0)
        clients.run(lambda c: time.monotonic() - c.t0 > 3.0, 10)
        took_s, res = timed_get(url + "/health")
        assert res.status_code == 200 and took_s < 5.0, (took_s, res.text)
        done = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=60)
        assert done.status_code == 200, done.text
        assert list(receipts.iterdir())  # its receipt was written: descriptors were left for it
        clients.run(lambda c: False, 2.0 + 3.0)
        assert clients.closed >= 300 - 128, clients.closed  # the default cap under 256: 128
    finally:
        if clients is not None:
            clients.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # drains and exits; killed below if it does not
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        _reap(proc)
        drain.join(10)
    log = "".join(stderr)
    assert "Traceback" not in log, log[-3000:]
    assert log.count("EMFILE") <= 2 and 1 <= log.count("http.connection_evicted") <= 2, log[-3000:]

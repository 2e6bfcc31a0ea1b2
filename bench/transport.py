"""Transport costs on loopback: the stages' libp2p framing path against plain TCP, and a ring's step.

Measured side by side in one run (rounds alternate libp2p / TCP so machine noise hits both alike;
medians over every repetition are reported):

- ``decode_one_way_ms``: a decode-sized hidden-state frame (``forward`` with hidden (1, 1, 576)
  float32, built by ``swarm.wire``) through ``FramedStream`` over a real ``open_host`` pair (TCP +
  Noise + Yamux) in two processes, on one persistent stream: half the median round trip of a
  ping-pong (the child echoes the frame back, decoding and re-encoding it as a stage would).
- ``prefill_mb_per_s``: frames of 16 MiB of hidden states over the same stream: the median time
  from ``send`` until the child's small ack, as bytes per second (10^6 bytes = 1 MB).
- ``tcp_decode_one_way_ms`` / ``tcp_prefill_mb_per_s``: the same frame bytes length-prefixed over
  plain trio TCP to the same child (also unpacked and packed with msgpack at both ends).
- ``stock_decode_one_way_ms`` / ``stock_prefill_mb_per_s``: the same over ``open_host(batched=False)``
  (libp2p 0.8.1's own Noise and Yamux classes, without ``swarm.transport.dataplane``), to the same child.
- ``codec_us``: msgpack packing + unpacking of each frame alone, in this process (no network).
- ``breakdown_ms``: per model, where a real ring's decode step goes: a 3-stage ring of real ``swarm stage``
  processes (default the shared stories260k model, 1 torch thread each) driven one token per step
  by a ``RingClient``; every stage's ``info_ok`` ``timing`` counters (docs/protocol.md) are read
  before and after the decode steps, and their differences are per-step means: parse (validate +
  decode the tensor), queue, to_thread (handoff to the worker thread), compute, encode, from_thread
  (handoff back to trio), outbox wait, send (msgpack + Noise/Yamux write). What the stages cannot see (reading, decrypting and unpacking each frame on the
  receiving side, kernel transit, the coordinator's reader) is the residual, per hop.

Prints one JSON object; ``--out`` also writes it (default path bench/results/transport-<date>.json).
Usage: python bench/transport.py [--rounds 5] [--pings 300] [--prefill-frames 3] [--model PATH ...]
[--decode-steps 100] [--ring-rounds 3] [--no-ring] [--out [PATH]]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import trio
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.transport import decode_body, encode_frame, load_or_create_key, open_host  # noqa: E402
from swarm.transport.framing import LENGTH_PREFIX_BYTES, decode_length_prefix  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("SWARM_SHARED", REPO.parent / "shared")) / "models" / "stories260k"
ECHO_PROTOCOL = "/swarm-bench/echo/1"
DECODE_HIDDEN = 576  # SmolLM2-135M's hidden size D: one decode row is 576 float32 = 2304 bytes
PREFILL_SHAPE = (1, 4096, 1024)  # float32: exactly 16 MiB of hidden states in one frame
ECHO_MAX_DATA = 1 << 20  # the child echoes frames with less tensor data than this, acks bigger ones
TIMEOUT_S = 60.0
LINKS = ("libp2p", "stock", "tcp")  # swarm's open_host; open_host(batched=False), libp2p's own classes; plain TCP
ACK = {"v": 1, "type": "ack"}
STAGE_METRICS = (("parse", "parse_s", "chunks"), ("queue", "queue_s", "picked"), ("to_thread", "to_thread_s", "steps"),
                 ("compute", "compute_s", "steps"), ("encode", "encode_s", "steps"),
                 ("from_thread", "from_thread_s", "steps"), ("outbox", "outbox_s", "frames_out"),
                 ("send", "send_s", "frames_out"))


# ---- the child: an echo server on libp2p and on plain TCP (no torch) ----------------------------

def _reply(msg: dict) -> dict:
    hidden = msg.get("hidden")
    big = isinstance(hidden, dict) and len(hidden.get("data", b"")) >= ECHO_MAX_DATA
    return ACK if big else msg


async def _tcp_read_frame(stream) -> dict | None:
    """One length-prefixed frame from a trio stream (None on EOF at a frame boundary)."""
    buf = bytearray()
    need = LENGTH_PREFIX_BYTES
    length = None
    while True:
        while len(buf) < need:
            data = await stream.receive_some(min(max(65536, need - len(buf)), 1 << 20))
            if not data:
                if not buf:
                    return None
                raise EOFError("EOF mid-frame")
            buf += data
        if length is None:
            length = decode_length_prefix(bytes(buf[:LENGTH_PREFIX_BYTES]))
            need = LENGTH_PREFIX_BYTES + length
            continue
        # a ping-pong never has bytes of the next frame behind this one
        return decode_body(memoryview(buf)[LENGTH_PREFIX_BYTES:need])


async def _echo_child(key_path: Path) -> None:
    from swarm.errors import StreamClosed

    async def on_libp2p(stream) -> None:
        with contextlib.suppress(StreamClosed):
            while True:
                msg = await stream.recv()
                await stream.send(_reply(msg), timeout_s=TIMEOUT_S)

    async def on_tcp(stream) -> None:
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError, EOFError):
                while (msg := await _tcp_read_frame(stream)) is not None:
                    await stream.send_all(encode_frame(_reply(msg)))

    async with open_host(load_or_create_key(key_path), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], batched=False) as stock:
        host.set_handler(ECHO_PROTOCOL, on_libp2p)
        stock.set_handler(ECHO_PROTOCOL, on_libp2p)
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(functools.partial(trio.serve_tcp, on_tcp, 0, host="127.0.0.1"))
            port = listener.socket.getsockname()[1]
            print(json.dumps({"libp2p": host.addrs()[0], "stock": stock.addrs()[0], "tcp_port": port}), flush=True)
            # the parent closes our stdin when it is done (or dies): then exit
            await trio.to_thread.run_sync(sys.stdin.read)
            nursery.cancel_scope.cancel()


# ---- the parent: ping-pong and bulk against the child ------------------------------------------

def decode_frame_msg():
    """A decode step's hidden-state frame as a stage sends it: ``forward`` with (1, 1, D) float32."""
    import torch

    from swarm import wire

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 1, DECODE_HIDDEN, generator=g)
    return wire.frame("forward", session="0" * 32, epoch=0, pos=1000, chunk=1000,
                      hidden=wire.encode_tensor(hidden))


def prefill_frame_msg():
    import torch

    from swarm import wire

    g = torch.Generator().manual_seed(1)
    return wire.frame("forward", session="0" * 32, epoch=0, pos=0, chunk=0, logits_from=PREFILL_SHAPE[1],
                      hidden=wire.encode_tensor(torch.randn(*PREFILL_SHAPE, generator=g)))


class TcpPeer:
    """The child's plain TCP echo: the same frame bytes, no security or muxer."""

    def __init__(self, stream) -> None:
        self.stream = stream

    async def send(self, msg: dict, timeout_s: float = TIMEOUT_S) -> None:
        with trio.fail_after(timeout_s):
            await self.stream.send_all(encode_frame(msg))

    async def recv(self, timeout_s: float = TIMEOUT_S) -> dict:
        with trio.fail_after(timeout_s):
            msg = await _tcp_read_frame(self.stream)
        if msg is None:
            raise EOFError("the echo child closed the TCP stream")
        return msg


async def ping_pong(peer, msg: dict, n: int, sends: list | None = None) -> list[float]:
    """Round trips (seconds) of ``msg`` echoed back by the child, one at a time; the seconds of each
    ``send`` call alone go to ``sends``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await peer.send(msg, timeout_s=TIMEOUT_S)
        t1 = time.perf_counter()
        await peer.recv(timeout_s=TIMEOUT_S)
        out.append(time.perf_counter() - t0)
        if sends is not None:
            sends.append(t1 - t0)
    return out


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class CpuClock:
    """CPU seconds (user + system) of this process and of the echo child, summed per transport."""

    def __init__(self, child_pid: int) -> None:
        self.child_pid = child_pid
        self.spent: dict[str, list[float]] = {}

    def _now(self) -> tuple[float, float]:
        return time.process_time(), process_cpu_s(self.child_pid)

    @contextlib.contextmanager
    def measure(self, key: str):
        a = self._now()
        yield
        b = self._now()
        got = self.spent.setdefault(key, [0.0, 0.0])
        got[0] += b[0] - a[0]
        got[1] += b[1] - a[1]


async def bulk(peer, msg: dict, n: int) -> list[float]:
    """Seconds from sending each big frame until the child's ack (the child unpacks it first)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await peer.send(msg, timeout_s=TIMEOUT_S)
        reply = await peer.recv(timeout_s=TIMEOUT_S)
        out.append(time.perf_counter() - t0)
        if reply.get("type") != "ack":
            raise RuntimeError(f"expected an ack, got {reply.get('type')!r}")
    return out


async def measure_links(addrs: dict, key_path: Path, rounds: int, pings: int, prefill_frames: int,
                        cpu: CpuClock) -> dict:
    small, big = decode_frame_msg(), prefill_frame_msg()
    times = {f"{name}_{what}": [] for name in LINKS for what in ("rtt", "bulk", "send")}
    async with open_host(load_or_create_key(key_path), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], batched=False) as stock_host:
        t0 = time.perf_counter()
        stream = await host.open_stream(addrs["libp2p"], ECHO_PROTOCOL, timeout_s=TIMEOUT_S)
        open_s = time.perf_counter() - t0
        stock = await stock_host.open_stream(addrs["stock"], ECHO_PROTOCOL, timeout_s=TIMEOUT_S)
        tcp = TcpPeer(await trio.open_tcp_stream("127.0.0.1", addrs["tcp_port"]))
        peers = {"libp2p": stream, "stock": stock, "tcp": tcp}
        for peer in peers.values():  # warm up: first frames pay for allocations and window growth
            await ping_pong(peer, small, 50)
            await bulk(peer, big, 1)
        for _ in range(rounds):
            for name, peer in peers.items():
                with cpu.measure(f"{name}_rtt"):
                    times[f"{name}_rtt"] += await ping_pong(peer, small, pings, times[f"{name}_send"])
            for name, peer in peers.items():
                with cpu.measure(f"{name}_bulk"):
                    times[f"{name}_bulk"] += await bulk(peer, big, prefill_frames)
        await stream.aclose()
        await stock.aclose()
        await tcp.stream.aclose()
    return {"times": times, "open_s": open_s, "decode_frame_bytes": len(encode_frame(small)),
            "prefill_frame_bytes": len(encode_frame(big))}


def codec_us(msg: dict, n: int) -> dict:
    """Microseconds to pack and unpack ``msg`` as a frame (median of n), no network."""
    pack, unpack = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        frame = encode_frame(msg)
        t1 = time.perf_counter()
        decode_body(memoryview(frame)[LENGTH_PREFIX_BYTES:])
        t2 = time.perf_counter()
        pack.append(t1 - t0)
        unpack.append(t2 - t1)
    return {"pack": round(statistics.median(pack) * 1e6, 1), "unpack": round(statistics.median(unpack) * 1e6, 1)}


def link_results(tmp: Path, rounds: int, pings: int, prefill_frames: int) -> dict:
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--echo-child", str(tmp / "echo.key")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the echo child exited with code {child.wait()} before it listened")
        addrs = json.loads(line)
        cpu = CpuClock(child.pid)
        got = trio.run(measure_links, addrs, tmp / "client.key", rounds, pings, prefill_frames, cpu)
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    t = got["times"]
    n_rtt, n_bulk = rounds * pings, rounds * prefill_frames

    def cpu_ms(key: str, n: int) -> dict:
        parent, child_s = cpu.spent[key]
        return {"sender": round(parent * 1000 / n, 4), "echo_child": round(child_s * 1000 / n, 4)}

    def one_way_ms(xs):
        return round(statistics.median(xs) * 1000 / 2, 4)

    def mb_per_s(xs):
        return round(got["prefill_frame_bytes"] / statistics.median(xs) / 1e6, 1)

    def one_way_quantiles(xs):
        q = statistics.quantiles(xs, n=20) if len(xs) > 1 else xs * 19
        return {"p5": round(q[0] * 500, 4), "p50": round(statistics.median(xs) * 500, 4), "p95": round(q[-1] * 500, 4)}

    def frame_ms(xs):
        return {"min": round(min(xs) * 1000, 2), "p50": round(statistics.median(xs) * 1000, 2),
                "max": round(max(xs) * 1000, 2)}

    return {
        "decode_one_way_ms": one_way_ms(t["libp2p_rtt"]),
        "prefill_mb_per_s": mb_per_s(t["libp2p_bulk"]),
        "tcp_decode_one_way_ms": one_way_ms(t["tcp_rtt"]),
        "tcp_prefill_mb_per_s": mb_per_s(t["tcp_bulk"]),
        "stock_decode_one_way_ms": one_way_ms(t["stock_rtt"]),
        "stock_prefill_mb_per_s": mb_per_s(t["stock_bulk"]),
        "decode_one_way_ms_quantiles": {name: one_way_quantiles(t[f"{name}_rtt"]) for name in LINKS},
        "prefill_frame_ms": {name: frame_ms(t[f"{name}_bulk"]) for name in LINKS},
        "decode_send_ms": {name: round(statistics.median(t[f"{name}_send"]) * 1000, 4) for name in LINKS},
        "cpu_ms_per_decode_round_trip": {name: cpu_ms(f"{name}_rtt", n_rtt) for name in LINKS},
        "cpu_ms_per_prefill_frame": {name: cpu_ms(f"{name}_bulk", n_bulk) for name in LINKS},
        "stream_open_ms": round(got["open_s"] * 1000, 2),
        "sizes": {"decode_frame_bytes": got["decode_frame_bytes"], "decode_hidden": [1, 1, DECODE_HIDDEN],
                  "prefill_frame_bytes": got["prefill_frame_bytes"], "prefill_hidden": list(PREFILL_SHAPE),
                  "dtype": "float32"},
        "counts": {"rounds": rounds, "round_trips_per_round": pings, "prefill_frames_per_round": prefill_frames,
                   "round_trips": len(t["libp2p_rtt"]), "prefill_frames": len(t["libp2p_bulk"]),
                   "warmup": {"round_trips": 50, "prefill_frames": 1}},
    }


# ---- a real ring's decode step ------------------------------------------------------------------

async def ring_steps(spec, model_dir: Path, key_path: Path, prompt: list[int], steps: int, rounds: int) -> dict:
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest
    from swarm.coordinator.ring import RingClient

    step_s, send_s, deltas = [], [], []
    async with open_host(load_or_create_key(key_path), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            trio.open_nursery() as nursery:
        ring = RingClient(host, spec, TIMEOUT_S, 30.0, heartbeat_s=5.0)
        await ring.connect(model_num_layers(model_dir), model_manifest_digest(model_dir), nursery)
        n = len(ring.links)
        for r in range(rounds):
            sid = f"bench-transport-{r}"
            await ring.open_session(sid, len(prompt) + steps + 1)
            await ring.send_chunk(sid, SimpleNamespace(epoch=0, pos=0, chunk_id=0, tokens=prompt,
                                                       logits_from=len(prompt) - 1))
            token = (await ring.next_result(sid)).token_ids[-1]
            before = [(await ring.stage_info(i)).timing for i in range(n)]
            for k in range(steps):
                chunk = SimpleNamespace(epoch=0, pos=len(prompt) + k, chunk_id=k + 1, tokens=[token], logits_from=None)
                t0 = time.perf_counter()
                await ring.send_chunk(sid, chunk)
                t1 = time.perf_counter()
                token = (await ring.next_result(sid)).token_ids[-1]
                step_s.append(time.perf_counter() - t0)
                send_s.append(t1 - t0)
            after = [(await ring.stage_info(i)).timing for i in range(n)]
            deltas.append([{k: a[k] - b[k] for k in a} for a, b in zip(after, before)])
            await ring.close_session(sid)
        infos = ring.infos
        nursery.cancel_scope.cancel()
    return {"step_s": step_s, "send_s": send_s, "deltas": deltas, "layers": [list(i.layers) for i in infos]}


def ring_breakdown(model: str, tmp: Path, steps: int, rounds: int) -> dict:
    import torch

    from swarm import wire
    from swarm.errors import collapse
    from swarm.cli.launch import LocalRing
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import resolve_model
    from swarm.ranges import even_split

    tmp.mkdir(parents=True, exist_ok=True)
    resolved = resolve_model(model)
    n = model_num_layers(resolved.path)
    prompt = list(range(1, 17))  # 16 token ids, valid in any vocabulary here
    t0 = time.perf_counter()
    with LocalRing(str(resolved.path), even_split(n, 3), tmp / "keys", threads=1,
                   extra_args=["--dtype", "float32"]) as ring:
        start_s = time.perf_counter() - t0
        try:
            got = trio.run(ring_steps, ring.ring_spec(), resolved.path, tmp / "coord.key", prompt, steps, rounds)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    config = json.loads((resolved.path / "config.json").read_text())
    hidden = config["hidden_size"]

    def per_step_ms(delta: dict, secs: str, count: str) -> float:
        return delta[secs] / delta[count] * 1000 if delta[count] else 0.0

    # per stage and metric: the median over rounds of the round's per-step mean
    stages = []
    for i, layers in enumerate(got["layers"]):
        row = {"layers": layers}
        for name, secs, count in STAGE_METRICS:
            row[name] = round(statistics.median(per_step_ms(d[i], secs, count) for d in got["deltas"]), 4)
        row["in_stage"] = round(sum(row[name] for name, _, _ in STAGE_METRICS), 4)
        stages.append(row)
    step_ms = statistics.median(got["step_s"]) * 1000
    step_mean_ms = statistics.fmean(got["step_s"]) * 1000
    coord_send_ms = statistics.fmean(got["send_s"]) * 1000
    sums = {name: round(sum(s[name] for s in stages), 4) for name, _, _ in STAGE_METRICS}
    in_stages = sum(s["in_stage"] for s in stages)
    hops = len(stages) + 1  # coordinator -> head -> ... -> tail -> coordinator
    residual = step_mean_ms - coord_send_ms - in_stages
    meta = dict(session="bench-transport-0", epoch=0, pos=1000, chunk=1000)
    return {
        "model": resolved.name, "stages": len(stages), "hidden_size": hidden, "threads_per_stage": 1,
        "decode_steps": len(got["step_s"]), "rounds": rounds, "ring_start_s": round(start_s, 2),
        "frame_bytes": {
            "coordinator_to_head": len(encode_frame(wire.frame("forward", tokens=[123], **meta))),
            "stage_to_stage": len(encode_frame(wire.frame(
                "forward", hidden=wire.encode_tensor(torch.zeros(1, 1, hidden)), **meta))),
            "tail_to_coordinator": len(encode_frame(wire.frame("result", token_ids=[123], **meta)))},
        "step_ms": round(step_ms, 4), "step_mean_ms": round(step_mean_ms, 4),
        "coordinator_send_ms": round(coord_send_ms, 4),
        "per_stage": stages, "stages_sum": sums, "in_stages_ms": round(in_stages, 4),
        "hops": hops,
        "unaccounted_ms": round(residual, 4),
        "unaccounted_per_hop_ms": round(residual / hops, 4),
        "note": ("per-stage values are per-step means from the stages' info timing counters (median over "
                 "rounds); unaccounted = step_mean - coordinator_send - in_stages: each hop's receiving side "
                 "(read, Noise decrypt, Yamux, msgpack unpack, reader -> handler channel), kernel transit, "
                 "and the coordinator's reader and result check"),
    }


# ---- the report ---------------------------------------------------------------------------------

def machine() -> dict:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}


def git_commit() -> str | None:
    """The measured tree's commit (``+dirty`` with uncommitted changes), None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating libp2p / TCP rounds")
    ap.add_argument("--pings", type=int, default=300, help="decode-frame round trips per round and transport")
    ap.add_argument("--prefill-frames", type=int, default=3, help="16 MiB frames per round and transport")
    ap.add_argument("--model", action="append", help="model of a ring breakdown (path or built-in name; repeat "
                    "for several; default: ../shared's stories260k where it exists, else smollm2-135m)")
    ap.add_argument("--decode-steps", type=int, default=100, help="decode steps per ring round")
    ap.add_argument("--ring-rounds", type=int, default=3)
    ap.add_argument("--no-ring", action="store_true", help="skip the ring breakdown")
    ap.add_argument("--out", nargs="?", const="", default=None,
                    help="also write the JSON here (no value: bench/results/transport-<date>.json)")
    ap.add_argument("--note", help="a line stored in the JSON (e.g. which tree was measured)")
    ap.add_argument("--echo-child", metavar="KEY", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.echo_child:
        trio.run(_echo_child, Path(args.echo_child))
        return 0
    if min(args.rounds, args.pings, args.prefill_frames, args.decode_steps, args.ring_rounds) < 1:
        ap.error("counts must be >= 1")
    models = args.model or [str(STORIES) if STORIES.is_dir() else "smollm2-135m"]
    if not args.no_ring:  # before minutes of measuring: a model that cannot be found fails now
        from swarm.errors import ModelError
        from swarm.model.resolve import resolve_model

        for model in models:
            try:
                resolve_model(model)
            except ModelError as e:
                ap.error(f"--model {model}: {e}")
    report = {"date": datetime.date.today().isoformat(), "commit": git_commit(), "note": args.note, "machine": machine(),
              "libp2p": importlib.metadata.version("libp2p"), "trio": importlib.metadata.version("trio"),
              "msgpack": importlib.metadata.version("msgpack"),
              "path": "swarm.transport open_host (TCP + Noise + Yamux) -> FramedStream, one persistent stream",
              "method": ("two processes on 127.0.0.1 (this one and an echo child); decode: one-way = half the "
                         "median ping-pong round trip (the child unpacks and re-packs the frame and sends it "
                         "back); prefill: median send -> ack time of one 16 MiB frame (the child unpacks it, "
                         "then acks); TCP: plain trio TCP to the same child, same length-prefixed msgpack "
                         "frames; rounds alternate libp2p and TCP"),
              "targets": {"decode_one_way_ms": 0.5, "prefill_mb_per_s": 300}}
    with tempfile.TemporaryDirectory() as tmp:
        report |= link_results(Path(tmp), args.rounds, args.pings, args.prefill_frames)
        report["codec_us"] = {"decode_frame": codec_us(decode_frame_msg(), 2000),
                              "prefill_frame": codec_us(prefill_frame_msg(), 5)}
        if not args.no_ring:
            report["breakdown_ms"] = {}
            for i, model in enumerate(models):
                got = ring_breakdown(model, Path(tmp) / f"ring-{i}", args.decode_steps, args.ring_rounds)
                report["breakdown_ms"][got["model"]] = got
    report["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(report)
    print(text)
    if args.out is not None:
        out = Path(args.out) if args.out else REPO / "bench" / "results" / f"transport-{report['date']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

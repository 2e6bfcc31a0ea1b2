"""Real hosts, real DHT: record put/get success and lookup latency at 10, 50 and 200 py-libp2p hosts.

For each size N the bench starts a bootstrap node and N-1 further server-mode swarm DHT nodes
(``swarm.transport.open_host`` + ``swarm.discovery.dht.open_dht``, as ``swarm stage`` builds them),
``--per-process`` hosts to a child process (each its own ``trio.run``), all on 127.0.0.1 with
port 0. Joins are staggered: each process joins two nodes at a time and starts the next once a
node's background self-lookup (``SwarmDHT.table_filled``) has ended; the first process joins alone,
the others start together once it is up. A joining node is given several bootstrap addresses, as
a volunteer's list of bootstrap nodes and peer cache give it: the bootstrap node and
``--bootstrap-peers`` random nodes already joined (a one-node list put all 199 joins, and every
announce, on one process: 60 of 199 nodes failed to join, issue 31); ``open_dht`` joins through
any that answers and retries while none does, so a node that still fails is the product's
failure. Every node but the bootstrap
announces a signed stage record of its own PeerId (``sign_record`` + ``SwarmDHT.announce``, as a
stage does), ``--announce-concurrency`` at a time per process (all at once, 49 announces on 2 cores
ran past their deadline, issue 31). Then:

- ``join_one``: one more server node joins as ``swarm stage`` does (clock sync included): the time
  ``open_dht`` takes (what start-up waits for) and when its background self-lookup ended;
- ``put`` / ``holders``: for each record, how many of the 20 nodes closest to its key (libp2p's metric:
  XOR of SHA-256 of key and of PeerId, over every node of the swarm) hold it, and how many hold it
  in all: where a put landed. Put success: the announce returned and at least one of those 20
  holds the record (``in_k_closest_half_share``: at least half of them);
- ``get``: ``--reads`` cold reads of a random record from a random node that did not write it (its
  own copy, if it holds one, set aside for the read), each read by every read path this version
  has: ``library`` (libp2p's ``KadDHT.get_value``), ``product`` (``SwarmDHT._fresh_value``, the
  read ``read_records`` falls back to when a stage itself does not answer: the bootstrap nodes
  first) and ``lookup`` (``SwarmDHT.get_value``: the iterative Kademlia lookup, where present);
  success = a valid record of that PeerId came back within ``--read-timeout-s``;
- the same reads again after the bootstrap node is SIGKILLed (``bootstrap_down``): a swarm whose
  records live only where everyone asks first has them nowhere once that node is gone.

Lookup latency is wall time per read, p50/p99, on a 2-core machine running all N hosts (CPU, not
the network, is what it mostly measures at 200). Prints one JSON object (``--out FILE`` also
writes it). Every child process is reaped, also on failure.
Usage: python bench/dht_scale.py [--hosts 10,50,200] [--reads 200] [--per-process 25]
       [--announce-concurrency 2] [--announce-timeout-s 30] [--bootstrap-peers 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K_CLOSEST = 20  # libp2p's BUCKET_SIZE: the k of Kademlia, the nodes a put should reach
MODEL = hashlib.sha256(b"bench/dht_scale").hexdigest()
PATHS = ("library", "product", "lookup")


# ---------------------------------------------------------------- child process: some hosts


def _key(seed: int, n: int, index: int):
    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair(hashlib.sha256(f"dht_scale/{seed}/{n}/{index}".encode()).digest())


def _record(key_pair, addrs: list[str], ttl_s: float, now: float) -> bytes:
    from swarm.discovery.records import StageRecord, sign_record
    from swarm.transport.identity import peer_id_of

    rec = StageRecord(peer_id=peer_id_of(key_pair), model_id=MODEL, model_name="dht-scale", num_layers=32,
                      layers=(0, 4), addrs=tuple(addrs), seq=1, expires_at=now + ttl_s)
    return sign_record(key_pair, rec)


async def _read(node, path: str, peer_id: str, timeout_s: float) -> tuple[bool, float, str]:
    """One cold read of ``peer_id``'s record on ``node`` by ``path``: (valid record came back, seconds, why not)."""
    import trio

    from swarm.discovery.records import RecordInvalid, open_record, record_key

    key = record_key(peer_id)
    kb = key.encode()
    store = node.dht.value_store.store
    saved = store.pop(kb, None)  # cold: a read from the network, never this node's own copy
    start = time.perf_counter()
    value, why = None, "timeout"
    try:
        with trio.move_on_after(timeout_s):
            if path == "library":
                value = await node.dht.get_value(key)
            elif path == "product":
                value = await node._fresh_value(key)
            else:
                value = await node.get_value(key)
            why = "no value"
    except Exception as e:  # a failed read is a miss with a reason, not a crash of the bench
        why = repr(e)[:120]
    seconds = time.perf_counter() - start
    if kb not in store and saved is not None:
        store[kb] = saved
    if value is None:
        return False, seconds, why
    try:
        open_record(key, value, now=node.clock())
    except RecordInvalid as e:
        return False, seconds, f"invalid: {e}"
    return True, seconds, ""


async def _worker(args) -> None:
    """Run ``args.count`` DHT nodes; answer the parent's commands (JSON lines on stdin) on stdout."""
    import trio

    from swarm.discovery.dht import open_dht
    from swarm.transport.host import open_host
    from swarm.transport.identity import peer_id_of

    nodes: dict[str, object] = {}
    # nodes already joined (multiaddrs with /p2p/), this process's own added as they join
    pool: list[str] = json.loads(Path(args.pool).read_text()) if args.pool else []
    pick = random.Random(f"{args.seed}/{args.size}/{args.first}")
    stop = trio.Event()
    joins = trio.CapacityLimiter(2)  # joins at once in this process: the bootstrap answers them all
    put_stats: list[dict] = []
    failures: list[str] = []

    def say(kind: str, payload) -> None:
        sys.stdout.write(json.dumps({"kind": kind, "data": payload}) + "\n")
        sys.stdout.flush()

    async def node(index: int, up: trio.Event) -> None:
        key_pair = _key(args.seed, args.size, index)
        try:
            async with joins:
                host_cm = open_host(key_pair, ["/ip4/127.0.0.1/tcp/0"])
                host = await host_cm.__aenter__()
            try:
                async with AsyncExitStack() as running:
                    async with joins:
                        # the bootstrap node and --bootstrap-peers nodes already in the swarm, as a volunteer's
                        # list of bootstrap nodes or peer cache holds several; open_dht joins through any that
                        # answers and tries again while none does (the product's retries, not the bench's)
                        boot = [args.bootstrap] if args.bootstrap else []
                        others = [a for a in pool if a not in boot]
                        boot += pick.sample(others, min(args.bootstrap_peers, len(others)))
                        dht = await running.enter_async_context(
                            open_dht(host, server=True, bootstrap=boot, sync_clock=False))
                        # staggered joins: a node's background self-lookup (``fill_table``) ends,
                        # bounded by its own deadline, before this process starts the next join
                        await dht.table_filled.wait()
                    nodes[host.peer_id] = dht
                    pool.append(host.addrs()[0])
                    up.set()
                    await stop.wait()
            finally:
                await host_cm.__aexit__(None, None, None)
        except Exception as e:  # one node that cannot start is reported, the others go on
            failures.append(f"{peer_id_of(key_pair)}: {e!r}"[:200])
            up.set()

    announces = trio.CapacityLimiter(args.announce_concurrency)  # announces at once in this process

    async def announce(dht) -> None:
        key_pair = _key(args.seed, args.size, index_of[dht.host.peer_id])
        stored, why = 0, ""
        async with announces:
            start = time.perf_counter()
            value = _record(key_pair, dht.host.addrs(), args.ttl_s, dht.clock())
            try:
                with trio.fail_after(args.announce_timeout_s + 5):
                    stored = await dht.announce(value, MODEL, timeout_s=args.announce_timeout_s)
            except Exception as e:  # a refused or timed-out put is a figure, not a crash
                why = repr(e)[:160]
        put_stats.append({"peer": dht.host.peer_id, "stored": stored, "s": round(time.perf_counter() - start, 4),
                          "error": why})

    async def extra_node(bootstrap: str, report: dict, done: trio.Event) -> None:
        """One more server node joins as ``swarm stage`` does (clock sync included): the time ``open_dht``
        takes (what start-up waits for) and, apart, when its background self-lookup ended; it stays up,
        holding no record."""
        start = time.perf_counter()
        try:
            async with open_host(_key(args.seed, args.size, 10_000), ["/ip4/127.0.0.1/tcp/0"]) as host, \
                    open_dht(host, server=True, bootstrap=[bootstrap]) as dht:
                report["open_dht_ms"] = round(1000 * (time.perf_counter() - start), 1)
                with trio.move_on_after(120):
                    await dht.table_filled.wait()
                    report["self_lookup_done_ms"] = round(1000 * (time.perf_counter() - start), 1)
                report["table"] = dht.dht.routing_table.size()
                done.set()
                await stop.wait()
        except Exception as e:  # a figure missing, not a run lost
            report["error"] = repr(e)[:160]
        finally:
            done.set()

    index_of: dict[str, int] = {}
    for index in range(args.first, args.first + args.count):
        index_of[peer_id_of(_key(args.seed, args.size, index))] = index

    async with trio.open_nursery() as nursery:
        ups = []
        for index in range(args.first, args.first + args.count):
            up = trio.Event()
            ups.append(up)
            nursery.start_soon(node, index, up)
        for up in ups:
            await up.wait()
        say("up", {"peers": sorted(nodes), "addrs": {p: d.host.addrs()[0] for p, d in nodes.items()},
                   "failures": failures})
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break  # the parent is gone: stop
            cmd = json.loads(line)
            if cmd["op"] == "announce":
                if not args.bootstrap:
                    say("announced", [])
                    continue
                put_stats.clear()
                async with trio.open_nursery() as puts:
                    for dht in list(nodes.values()):
                        puts.start_soon(announce, dht)
                say("announced", put_stats)
            elif cmd["op"] == "join":
                report: dict = {}
                done = trio.Event()
                nursery.start_soon(extra_node, cmd["bootstrap"], report, done)
                with trio.move_on_after(150):  # always answer: the parent's next command must find its reply
                    await done.wait()
                say("joined", report or {"error": "no answer within 150 s"})
            elif cmd["op"] == "holders":
                from swarm.discovery.records import NAMESPACE

                prefix = f"/{NAMESPACE}/".encode()
                say("holders", {p: sorted(k.decode()[len(prefix):] for k in d.dht.value_store.store
                                          if k.startswith(prefix)) for p, d in nodes.items()})
            elif cmd["op"] == "read":
                results: list[dict] = []
                slots = trio.CapacityLimiter(args.read_concurrency)

                async def one(reader: str, target: str, path: str) -> None:
                    async with slots:
                        ok, seconds, why = await _read(nodes[reader], path, target, cmd["timeout_s"])
                    results.append({"reader": reader, "target": target, "path": path, "ok": ok,
                                    "s": round(seconds, 5), "why": why})

                for path in cmd["paths"]:  # one path at a time: paths do not slow each other down
                    async with trio.open_nursery() as reads:
                        for reader, target in cmd["tasks"]:
                            reads.start_soon(one, reader, target, path)
                say("read", results)
            elif cmd["op"] == "quit":
                break
        stop.set()


def worker_main(args) -> int:
    import trio

    logging.basicConfig(level=logging.CRITICAL)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    trio.run(_worker, args)
    return 0


# ---------------------------------------------------------------- parent: the swarm, the figures


class Child:
    """A worker process speaking JSON lines; killed and reaped by ``close``."""

    def __init__(self, argv: list[str], log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.buf = b""

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, kind: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker {self.proc.pid}: no {kind!r} within {timeout_s} s; log {self.log_path}")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    tail = self.log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"worker {self.proc.pid} exited (rc {self.proc.poll()}) before {kind!r}:\n{tail}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if msg["kind"] != kind:
            raise RuntimeError(f"worker {self.proc.pid}: expected {kind!r}, got {msg['kind']!r}")
        return msg["data"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.close()


def _distance(key: str, peer_id: str) -> int:
    from libp2p.peer.id import ID

    return int.from_bytes(hashlib.sha256(key.encode()).digest(), "big") ^ int.from_bytes(
        hashlib.sha256(ID.from_base58(peer_id).to_bytes()).digest(), "big")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _summary(results: list[dict], paths: list[str]) -> dict:
    out = {}
    for path in paths:
        rows = [r for r in results if r["path"] == path]
        ok = [r for r in rows if r["ok"]]
        seconds = [r["s"] for r in ok]
        whys: dict[str, int] = {}
        for r in rows:
            if not r["ok"]:
                whys[r["why"]] = whys.get(r["why"], 0) + 1
        out[path] = {
            "reads": len(rows), "ok": len(ok), "success": round(len(ok) / len(rows), 4) if rows else None,
            "p50_ms": round(1000 * _pct(seconds, 0.5), 1) if seconds else None,
            "p99_ms": round(1000 * _pct(seconds, 0.99), 1) if seconds else None,
            "max_ms": round(1000 * max(seconds), 1) if seconds else None,
            "misses": dict(sorted(whys.items(), key=lambda kv: -kv[1])[:4]),
        }
    return out


def run_size(n: int, args, tmp: Path) -> dict:
    from swarm.discovery.records import record_key

    rng = random.Random(f"{args.seed}/{n}")
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--seed", str(args.seed), "--size", str(n),
          "--ttl-s", str(args.ttl_s), "--read-concurrency", str(args.read_concurrency),
          "--announce-concurrency", str(args.announce_concurrency), "--announce-timeout-s", str(args.announce_timeout_s),
          "--bootstrap-peers", str(args.bootstrap_peers)]
    children: list[Child] = []
    t0 = time.monotonic()
    try:
        boot = Child(me + ["--first", "0", "--count", "1"], tmp / f"n{n}-boot.log")
        children.append(boot)
        boot_up = boot.recv("up", 60)
        boot_peer = boot_up["peers"][0]
        boot_addr = boot_up["addrs"][boot_peer]
        members = n - 1
        procs = max(1, math.ceil(members / args.per_process))
        share = [members // procs + (1 if i < members % procs else 0) for i in range(procs)]
        workers: list[Child] = []
        owner: dict[str, Child] = {}
        failures: list[str] = []
        pool_path = tmp / f"n{n}-pool.json"
        pool: list[str] = []

        def started(w: Child) -> None:
            up = w.recv("up", 60 + 15 * args.per_process)
            failures.extend(up["failures"])
            for p in up["peers"]:
                owner[p] = w
                pool.append(up["addrs"][p])

        first = 1
        for i, count in enumerate(share):
            pool_path.write_text(json.dumps(pool))
            w = Child(me + ["--first", str(first), "--count", str(count), "--bootstrap", boot_addr,
                            "--pool", str(pool_path)], tmp / f"n{n}-w{i}.log")
            children.append(w)
            workers.append(w)
            first += count
            if i == 0:
                # the first process joins alone, through the bootstrap node and its own nodes already in;
                # the others, at once, also through nodes of it (a swarm that has members)
                started(w)
        for w in workers[1:]:
            started(w)
        started_s = time.monotonic() - t0
        t1 = time.monotonic()
        for w in workers:
            w.send({"op": "announce"})
        rounds = math.ceil(max(share) / args.announce_concurrency)
        puts = [row for w in workers for row in w.recv("announced", 60 + rounds * (args.announce_timeout_s + 5))]
        announce_s = time.monotonic() - t1
        workers[0].send({"op": "join", "bootstrap": boot_addr})
        join = workers[0].recv("joined", 180)
        held: dict[str, list[str]] = {}
        for c in children:
            c.send({"op": "holders"})
            held.update(c.recv("holders", 30))
        servers = sorted(held)  # every node is a DHT server, the bootstrap too
        writers = sorted(p["peer"] for p in puts)
        in_closest, total_holders = [], []
        for w_peer in writers:
            key = record_key(w_peer)
            closest = sorted(servers, key=lambda p: _distance(key, p))[:K_CLOSEST]
            holders = {p for p, keys in held.items() if w_peer in keys and p != w_peer}
            in_closest.append(len(holders & set(closest) - {w_peer}))
            total_holders.append(len(holders))
        tasks = []
        readers = sorted(owner)
        for _ in range(args.reads):
            target = rng.choice(writers)
            reader = rng.choice([p for p in readers if p != target])
            tasks.append((reader, target))
        paths = list(args.paths)

        def read_all() -> list[dict]:
            by_worker: dict[int, list] = {}
            for reader, target in tasks:
                by_worker.setdefault(id(owner[reader]), []).append((reader, target))
            busy = [w for w in workers if id(w) in by_worker]
            for w in busy:
                w.send({"op": "read", "tasks": by_worker[id(w)], "paths": paths, "timeout_s": args.read_timeout_s})
            rows = []
            for w in busy:
                rows += w.recv("read", 60 + len(paths) * args.read_timeout_s * len(by_worker[id(w)]))
            return rows

        t2 = time.monotonic()
        up_rows = read_all()
        read_up_s = time.monotonic() - t2
        boot.kill()
        t3 = time.monotonic()
        down_rows = read_all()
        read_down_s = time.monotonic() - t3
        expired = sum(1 for r in up_rows + down_rows if "expired" in r["why"])
        return {
            "hosts": n, "processes": len(children), "start_failures": failures[:5],
            "start_failure_count": len(failures),
            # reads refused because the record's lifetime (--ttl-s) ran out before the read: the run was
            # slower than the record lifetime, so its get figures do not measure the DHT alone
            "reads_of_expired_records": expired,
            "start_s": round(started_s, 2), "announce_s": round(announce_s, 2), "read_s": round(read_up_s, 2),
            "read_down_s": round(read_down_s, 2),
            "join_one": join,
            "put": {
                "records": len(puts), "refused_or_failed": sum(1 for p in puts if p["error"]),
                # put success: the announce returned and at least one of the k closest nodes of the whole
                # swarm holds the record (where a reader's lookup converges); full: k/2 of them or more
                "success": round(sum(1 for p, c in zip(sorted(puts, key=lambda p: p["peer"]), in_closest)
                                     if not p["error"] and c >= 1) / len(puts), 4) if puts else None,
                "in_k_closest_half_share": round(sum(1 for c in in_closest if 2 * c >= min(K_CLOSEST, len(servers) - 1))
                                                 / len(in_closest), 4)
                if in_closest else None,
                "errors": sorted({p["error"] for p in puts if p["error"]})[:3],
                "stored_median": statistics.median([p["stored"] for p in puts]) if puts else None,
                "p50_ms": round(1000 * _pct([p["s"] for p in puts], 0.5), 1) if puts else None,
                "p99_ms": round(1000 * _pct([p["s"] for p in puts], 0.99), 1) if puts else None,
                "holders_median": statistics.median(total_holders) if total_holders else None,
                "in_k_closest_median": statistics.median(in_closest) if in_closest else None,
                "in_k_closest_min": min(in_closest) if in_closest else None,
            },
            "get": _summary(up_rows, paths),
            "get_bootstrap_down": _summary(down_rows, paths),
        }
    finally:
        for c in reversed(children):
            c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="10,50,200", help="comma-separated swarm sizes (the bootstrap node included)")
    ap.add_argument("--reads", type=int, default=200, help="cold reads per size and read path")
    ap.add_argument("--per-process", type=int, default=25, help="hosts per child process")
    ap.add_argument("--read-concurrency", type=int, default=2, help="reads in flight per child process")
    ap.add_argument("--read-timeout-s", type=float, default=10.0)
    ap.add_argument("--announce-concurrency", type=int, default=2, help="announces in flight per child process")
    ap.add_argument("--announce-timeout-s", type=float, default=30.0, help="SwarmDHT.announce's deadline")
    ap.add_argument("--bootstrap-peers", type=int, default=2,
                    help="nodes already joined that each joining node is also given as bootstrap addresses")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"read paths to measure, of {','.join(PATHS)}")
    ap.add_argument("--ttl-s", type=float, default=600.0,
                    help="record lifetime, at most swarm.discovery.records.MAX_TTL_S (a reader refuses more); the "
                         "bench does not re-announce as a stage does, so announces and reads must end within it")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pool", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    from swarm.discovery.records import MAX_TTL_S

    if not 0 < args.ttl_s <= MAX_TTL_S:
        ap.error(f"--ttl-s must be in (0, {MAX_TTL_S:.0f}] s (records.MAX_TTL_S), got {args.ttl_s}")
    args.paths = [p for p in args.paths.split(",") if p]
    from swarm.discovery.dht import SwarmDHT

    if "lookup" in args.paths and not hasattr(SwarmDHT, "get_value"):
        args.paths.remove("lookup")  # this version has no iterative lookup of its own
    sizes = [int(x) for x in args.hosts.split(",")]
    cpu0 = os.times()
    wall0 = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="dht_scale-") as tmpdir:
        for n in sizes:
            runs.append(run_size(n, args, Path(tmpdir)))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    cpu1 = os.times()
    out = {
        "bench": "dht_scale", "sizes": sizes, "reads_per_size": args.reads, "per_process": args.per_process,
        "read_concurrency_per_process": args.read_concurrency, "read_timeout_s": args.read_timeout_s,
        "announce_concurrency_per_process": args.announce_concurrency, "announce_timeout_s": args.announce_timeout_s,
        "bootstrap_peers": args.bootstrap_peers,
        "paths": args.paths, "k": K_CLOSEST, "cpus": os.cpu_count(),
        "wall_s": round(time.monotonic() - wall0, 1),
        "cpu_s_children": round((cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system), 1),
        "runs": runs,
    }
    text = json.dumps(out)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

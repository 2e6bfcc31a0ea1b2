"""Soak: thousands of distinct PeerIds visit a bootstrap node, a relay and a DHT-server stage, and leave.

Issue 45, item 1: libp2p's peer store (``max_peers=1000``) evicted a node's own entry after ~1,000
distinct visitors, identify then raised ``PeerStoreError`` and the process ended. This bench runs,
in one process on 127.0.0.1 (port 0), a bootstrap node (``open_dht(server=True)``), a relay
(``open_host(relay_hop=True)``) and a stage-like DHT server joined through the bootstrap node, then
``--visitors`` visitors, ``--concurrency`` at a time, each a fresh key that joins the DHT as a client
through the bootstrap node and the stage (as ``peers``, ``coordinate`` and stages do), pings the
relay, and leaves. Every ``--check-every`` visitors each node must still serve:
fresh clients join the DHT through the bootstrap node and through the stage, and every node answers
ping. A node's exception ends the run (the nursery), reported as ``"ok": false``.

Prints one JSON object: visitors done, failed visits (a visitor's own failure, counted, not fatal),
each node's peer-store size and whether it still holds its own key, checks passed, wall seconds.
``--max-peers`` sets the nodes' peer-store bound (default libp2p's 1000, so 5,000 visitors cross it
five times). Bounded by ``--deadline-s``.
Usage: python bench/peer_churn.py [--visitors 5000] [--concurrency 8] [--max-peers 1000]
       [--check-every 1000] [--deadline-s 2400]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from swarm.discovery.dht import open_dht  # noqa: E402
from swarm.transport import open_host  # noqa: E402


async def _ping(dht, addr: str) -> None:
    """One ping echo to ``addr`` through the DHT node's own RTT probe; raises when it gets no answer."""
    if await dht.rtt_ms(addr, rounds=1, timeout_s=10) is None:
        raise ConnectionError(f"no ping answer from {addr}")


async def _visit(servers: list[str], relay: str) -> None:
    """One distinct PeerId: join the DHT as a client (through the bootstrap node and the stage), ping
    the relay, leave."""
    async with open_host(create_new_key_pair()) as host, \
            open_dht(host, server=False, bootstrap=servers, sync_clock=False, join_attempts=1, timeout_s=10) as dht:
        await _ping(dht, relay)


async def _check(nodes: dict) -> None:
    """Fresh clients join the DHT through the bootstrap node and through the stage, and ping every node."""
    for server in ("bootstrap", "stage"):
        async with open_host(create_new_key_pair()) as host, \
                open_dht(host, server=False, bootstrap=[nodes[server].addrs()[0]], sync_clock=False,
                         join_attempts=1, timeout_s=10) as dht:
            for node in nodes.values():
                await _ping(dht, node.addrs()[0])


def _store_report(nodes: dict) -> dict:
    out = {}
    for name, node in nodes.items():
        store = node.libp2p_host.get_peerstore()
        own = node.libp2p_host.get_id()
        out[name] = {"entries": len(store.peer_ids()), "evicted": getattr(store, "evicted", None),
                     "own_key_kept": store.has_peer(own) and store.pubkey(own) == node.key_pair.public_key}
    return out


async def main(args: argparse.Namespace) -> dict:
    report = {"visitors": 0, "visit_failures": 0, "checks_passed": 0, "max_peers": args.max_peers, "ok": False}
    start = time.monotonic()
    with trio.move_on_after(args.deadline_s) as deadline:
        async with AsyncExitStack() as stack:
            opened = {}
            for name, kw in (("bootstrap", {}), ("relay", {"relay_hop": True}), ("stage", {})):
                opened[name] = await stack.enter_async_context(
                    open_host(create_new_key_pair(), max_peers=args.max_peers, **kw))
            boot = opened["bootstrap"].addrs()[0]
            await stack.enter_async_context(open_dht(opened["bootstrap"], server=True, sync_clock=False))
            await stack.enter_async_context(open_dht(opened["stage"], server=True, bootstrap=[boot], sync_clock=False))
            relay = opened["relay"].addrs()[0]
            limiter = trio.Semaphore(args.concurrency)

            async def one() -> None:
                try:
                    await _visit([boot, opened["stage"].addrs()[0]], relay)
                except Exception as exc:  # noqa: BLE001 - a visitor's failure is counted; a node's ends the run
                    report["visit_failures"] += 1
                    logging.getLogger("bench").info("visit.failed error=%r", exc)
                finally:
                    report["visitors"] += 1
                    limiter.release()

            done = 0
            while done < args.visitors:
                batch = min(args.check_every, args.visitors - done)
                async with trio.open_nursery() as nursery:
                    for _ in range(batch):
                        await limiter.acquire()
                        nursery.start_soon(one)
                done += batch
                await _check(opened)
                report["checks_passed"] += 1
                print(json.dumps({"progress": done, "wall_s": round(time.monotonic() - start, 1),
                                  **_store_report(opened)}), file=sys.stderr, flush=True)
            report["nodes"] = _store_report(opened)
            report["ok"] = (report["visit_failures"] <= args.visitors // 100
                            and all(n["own_key_kept"] for n in report["nodes"].values()))
    report["deadline_hit"] = deadline.cancelled_caught
    report["wall_s"] = round(time.monotonic() - start, 1)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--visitors", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-peers", type=int, default=1000)
    parser.add_argument("--check-every", type=int, default=1000)
    parser.add_argument("--deadline-s", type=float, default=2400.0)
    logging.basicConfig(level=logging.ERROR)
    try:
        result = trio.run(main, parser.parse_args())
    except BaseException as exc:  # noqa: BLE001 - a node's exception ended the run: that is the finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        logging.getLogger("bench").exception("a node failed")
        result = {"ok": False, "error": repr(exc)[:500]}
    print(json.dumps(result, sort_keys=True))
    sys.exit(0 if result["ok"] else 1)

"""The client side of the NAT lab test, run inside the lab's public namespace by
``tests/transport/test_nat_lab.py`` (``python -m tests.support.nat_client CONFIG.json``); prints one JSON line.

CONFIG: ``{"ring": ring file, "model": dir, "prompt": ids, "new": n, "mode": "punch" | "relayed",
"relay_pid": pid, "key": path}``. Both modes generate once through the ring (relayed at first).
Both wait until the client's streams to every relayed stage moved onto direct connections
(``moved_s``, from the start of connecting), report stage A's hops (``stage_hops``, from its
``info``: ``punch`` first waits up to 20 s for its hop to B to move) and wait ``settle_s``. ``punch``: SIGKILLs the relay,
generates again. ``relayed``: generates again, then SIGKILLs the relay in the middle of a third
generation and reports what happened (``after_relay_died``) and how soon (``failed_after_s``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import trio

from swarm.config import RingSpec, SpecConfig
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.model.block import model_num_layers
from swarm.model.resolve import model_manifest_digest
from swarm.coordinator.ring import RingClient
from swarm.transport import load_or_create_key, open_host
from swarm.transport.circuit import is_circuit


async def main(cfg: dict) -> dict:
    spec = RingSpec.load(cfg["ring"])
    out: dict = {}
    with trio.fail_after(240):
        async with open_host(load_or_create_key(cfg["key"]), [f"/ip4/{cfg['ip']}/tcp/0"]) as host, \
                trio.open_nursery() as nursery:
            client = RingClient(host, spec, hop_timeout_s=60.0, connect_timeout_s=20.0, heartbeat_s=1.0)
            start = time.monotonic()
            await client.connect(model_num_layers(cfg["model"]), model_manifest_digest(cfg["model"]), nursery)
            first = await decode(client, cfg["prompt"], DecodeOptions(cfg["new"], spec=SpecConfig()))
            out["first"] = first.output_ids
            relayed = [link for link in client.links if is_circuit(link.spec.addr)]
            # the client is public: a NATed stage reaches it directly by itself (DCUtR's unilateral
            # upgrade, through any NAT), and the client's streams to it move
            with trio.fail_after(60):
                while any(s.moves == 0 for link in relayed for s in (link.data, link.control)):
                    await trio.sleep(0.1)
            out["moved_s"] = round(time.monotonic() - start, 2)
            # the stages' own hop A -> B (both NATed): A opened it over the relay at the first
            # session; in the port-preserving lab it moves once DCUtR punched through
            with trio.move_on_after(20 if cfg["mode"] == "punch" else 0):
                while not [h for h in (await client.stage_info(0)).hops if h["moves"]]:
                    await trio.sleep(0.2)
            out["stage_hops"] = (await client.stage_info(0)).hops
            await trio.sleep(cfg.get("settle_s", 1.0))
            if cfg["mode"] == "punch":
                os.kill(cfg["relay_pid"], signal.SIGKILL)  # from here on only direct connections work
            out["moves"] = sum(s.moves for link in relayed for s in (link.data, link.control))
            t0 = time.monotonic()
            decoded = await decode(client, cfg["prompt"], DecodeOptions(cfg["new"], spec=SpecConfig()))
            out["again"], rec = decoded.output_ids, decoded.as_record()
            out["again_tokens_per_s"] = round(cfg["new"] / (time.monotonic() - t0), 2)
            out["heal_events"] = rec["heal_events"]
            if cfg["mode"] == "relayed":  # the stages' own hop still needs the relay: kill it mid-answer
                killed = []

                def kill_relay(ids):
                    if len(ids) >= 4 and not killed:
                        os.kill(cfg["relay_pid"], signal.SIGKILL)
                        killed.append(time.monotonic())

                try:
                    with trio.fail_after(30):
                        await decode(client, cfg["prompt"], DecodeOptions(cfg["new"], spec=SpecConfig()),
                                     on_ids=kill_relay)
                    out["after_relay_died"] = "answered"
                except Exception as e:  # noqa: BLE001 - reported to the test
                    out["after_relay_died"] = f"{type(e).__name__}: {e}"[:400]
                out["failed_after_s"] = round(time.monotonic() - killed[0], 2) if killed else None
            nursery.cancel_scope.cancel()
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        config = json.load(f)
    print(json.dumps(trio.run(main, config)), flush=True)

"""``swarm bootstrap`` and ``swarm relay``: nodes that hold no model, the addresses members join through.

Owns: ``run_bootstrap``: key, host, a server-mode DHT, the READY or FATAL line (docs/protocol.md) and a clean
stop on SIGTERM or Ctrl-C; a relay also relays circuits (``swarm.transport.circuit``). Several such nodes may
join each other (``--bootstrap``) for redundancy.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path

import trio

from swarm.errors import SwarmError, collapse

log = logging.getLogger(__name__)


def emit(kind: str, payload: dict, role: str = "bootstrap") -> None:
    """Print one lifecycle line (``SWARM_<ROLE>_<KIND> {json}``) to stdout and flush."""
    sys.stdout.write(f"SWARM_{role.upper()}_{kind} {json.dumps(payload, sort_keys=True)}\n")
    sys.stdout.flush()


def run_bootstrap(key_path: Path, listen: list[str], bootstrap: list[str] | None = None,
                  announce: list[str] | None = None, relay: bool = False) -> int:
    """Serve the DHT (and, with ``relay``, relay circuits) until SIGTERM/SIGINT. Returns 0 on a
    clean stop, 1 after printing FATAL.

    Args:
        key_path: the node key file (created 0600 if missing): a stable PeerId across restarts,
            so the address members were given stays valid.
        listen: TCP multiaddrs to listen on (e.g. ``/ip4/0.0.0.0/tcp/4001``).
        bootstrap: other bootstrap nodes to join (optional).
        announce: addresses to advertise instead of the bound ones (port forwards).
        relay: run as ``swarm relay`` (lines ``SWARM_RELAY_*``).
    """
    from swarm.discovery.dht import PROTOCOL_ID, open_dht
    from swarm.transport.identity import claim_key
    from swarm.transport.circuit import HOP_PROTOCOL
    from swarm.transport.host import check_listen_addrs, open_host

    role = "relay" if relay else "bootstrap"

    async def main() -> None:
        check_listen_addrs(listen, "--listen")  # a taken port is named before the key is touched
        key, _ = claim_key(key_path)  # its PeerId is the address handed out: never another's
        async with open_host(key, listen, announce_addrs=announce or (), relay_hop=relay) as host:
            async with open_dht(host, server=True, bootstrap=bootstrap or ()):
                ready = {"peer_id": host.peer_id, "addrs": host.addrs(), "protocol": PROTOCOL_ID}
                if relay:
                    ready["relay_protocol"] = HOP_PROTOCOL
                emit("READY", ready, role)
                with trio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        log.info("%s.stop reason=SIGTERM", role)
                        return

    try:
        try:
            trio.run(main)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    except KeyboardInterrupt:
        return 0
    except SwarmError as exc:
        emit("FATAL", {"reason": str(exc)}, role)
        return exc.exit_code
    return 0

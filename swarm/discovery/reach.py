"""Reachability: can the swarm dial this node? A dial-back asked of a bootstrap node.

Owns: the dial-back protocol ``/swarm/dialback/1.0.0`` (``serve_dialback``, on every DHT server node) and
``check_reachable``, which a joining stage asks before it picks its DHT mode. No torch. The protocol:
docs/protocol.md, "The swarm's DHT"; why not libp2p's AutoNAT: docs/architecture.md.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import multiaddr
import trio

from swarm.errors import ProtocolError, SwarmError

log = logging.getLogger(__name__)

PROTOCOL_ID = "/swarm/dialback/1.0.0"
MAX_PORTS = 8  # ports one request may ask about
DIAL_TIMEOUT_S = 3.0  # per port, on the server's side


@dataclass(frozen=True)
class Reachability:
    """What a dial-back found.

    Attributes:
        reachable: True when some announced port accepted a new connection from the swarm;
            None when no bootstrap node could be asked (the answer is unknown).
        observed_ip: the IP address the asking node's connection came from, as the server saw it.
        ports: port -> "ok" or why the dial failed ("refused", "timeout", an OS error).
        asked: the multiaddr of the node that answered (or the last one tried).
        reason: one line for the log when ``reachable`` is not True.
    """

    reachable: bool | None
    observed_ip: str = ""
    ports: tuple[tuple[int, str], ...] = ()
    asked: str = ""
    reason: str = ""


def tcp_ports(addrs: Sequence[str]) -> list[int]:
    """The distinct TCP ports of ``/ip4|ip6|dns*/H/tcp/P[...]`` multiaddrs, in order (others skipped)."""
    ports: list[int] = []
    for addr in addrs:
        try:
            port = int(multiaddr.Multiaddr(addr).value_for_protocol("tcp"))
        except Exception:  # not a multiaddr, or no /tcp/ part
            continue
        if 0 < port < 65536 and port not in ports:
            ports.append(port)
    return ports


async def _dial(ip: str, port: int, timeout_s: float) -> str:
    """"ok" when a new TCP connection to ``ip:port`` opens within ``timeout_s``, else why not."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with trio.socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            with trio.fail_after(timeout_s):
                await sock.connect((ip, port))
        except trio.TooSlowError:
            return "timeout"
        except ConnectionRefusedError:
            return "refused"
        except OSError as e:
            return e.strerror or type(e).__name__
    return "ok"


def serve_dialback(host, timeout_s: float = DIAL_TIMEOUT_S) -> None:
    """Answer dial-back requests on ``host`` (a running SwarmHost).

    Request ``{"type": "dialback", "ports": [int, ...]}`` (at most ``MAX_PORTS``); answer
    ``{"type": "dialback_ok", "ip": observed IP, "ports": {"<port>": "ok" | reason}}``, or
    ``{"type": "error", "reason"}`` for a malformed request. The dials are fresh TCP connections
    to the observed IP only, run in parallel, ``timeout_s`` each.
    """

    async def handle(stream) -> None:
        msg = await stream.recv(timeout_s=10.0)
        ports = msg.get("ports") if isinstance(msg, dict) and msg.get("type") == "dialback" else None
        if not (isinstance(ports, list) and 0 < len(ports) <= MAX_PORTS and all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)):
            await stream.send({"type": "error", "reason": f"a dialback request names 1 to {MAX_PORTS} TCP ports"})
            return
        remote = stream.raw.get_remote_address()
        if not remote:
            await stream.send({"type": "error", "reason": "cannot tell the address this request came from"})
            return
        ip = remote[0]
        results: dict[str, str] = {}

        async def one(port: int) -> None:
            results[str(port)] = await _dial(ip, port, timeout_s)

        async with trio.open_nursery() as nursery:
            for port in dict.fromkeys(ports):
                nursery.start_soon(one, port)
        log.info("dialback.answered peer=%s ip=%s ports=%s", stream.remote_peer_id, ip, results)
        await stream.send({"type": "dialback_ok", "ip": ip, "ports": results})

    host.set_handler(PROTOCOL_ID, handle)


async def check_reachable(host, bootstrap: Sequence[str], addrs: Sequence[str], *,
                          timeout_s: float = 10.0) -> Reachability:
    """Ask the bootstrap nodes, first to last until one answers, to dial ``addrs``' ports back.

    Args:
        host: this node's running SwarmHost.
        bootstrap: multiaddrs with ``/p2p/<PeerId>`` of nodes serving the dial-back.
        addrs: the multiaddrs this node announces (their TCP ports are asked about).
        timeout_s: deadline per bootstrap node, dial and answer together, in seconds.
    Returns:
        The Reachability; ``reachable`` None when no node answered (old nodes without the
        protocol, or none reachable): the caller decides its default.
    """
    ports = tcp_ports(addrs)[:MAX_PORTS]
    if not ports:
        return Reachability(None, reason=f"no TCP port among the announced addresses {list(addrs)}")
    reasons = []
    for addr in bootstrap:
        try:
            with trio.fail_after(timeout_s):
                stream = await host.open_stream(addr, PROTOCOL_ID, timeout_s=timeout_s)
                try:
                    await stream.send({"type": "dialback", "ports": ports})
                    msg = await stream.recv(timeout_s=timeout_s)
                finally:
                    await stream.aclose()
        except trio.TooSlowError:
            reasons.append(f"{addr}: no answer within {timeout_s:.0f} s")
            continue
        except ProtocolError:
            reasons.append(f"{addr}: does not serve the dial-back (an older swarm version)")
            continue
        except SwarmError as e:
            reasons.append(f"{addr}: {e}")
            continue
        got = msg.get("ports") if isinstance(msg, dict) and msg.get("type") == "dialback_ok" else None
        if not isinstance(got, dict):
            reasons.append(f"{addr}: answered {str(msg)[:120]}")
            continue
        results = tuple((p, str(got.get(str(p), "no answer"))) for p in ports)
        ip = str(msg.get("ip", ""))
        ok = any(r == "ok" for _, r in results)
        reason = "" if ok else (f"{addr} could not open a connection to this node at "
                                + ", ".join(f"{ip}:{p} ({r})" for p, r in results))
        return Reachability(ok, ip, results, addr, reason)
    return Reachability(None, reason="no bootstrap node answered the dial-back: " + "; ".join(reasons))

"""Host names in multiaddrs (``/dns4``, ``/dns6``, ``/dns``), resolved as the system resolves them.

Owns: ``resolve_tcp`` (such a multiaddr -> its ``/ip4`` / ``/ip6`` forms, by ``getaddrinfo``) and
``SystemResolvingTCP`` (libp2p's TCP transport dialing through it); ``/dnsaddr`` is left to libp2p. Why:
docs/architecture.md, "Notes by module".
"""

from __future__ import annotations

import logging
import socket

import multiaddr
import trio
from libp2p.transport.exceptions import OpenConnectionError
from libp2p.transport.tcp.tcp import TCP

log = logging.getLogger(__name__)

FAMILIES = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6, "dns": socket.AF_UNSPEC}
TO_FAMILY = {"dns4": " to an IPv4 address", "dns6": " to an IPv6 address", "dns": ""}  # for messages


class NameNotResolved(OpenConnectionError):
    """A multiaddr's host name does not resolve (getaddrinfo failed).

    Attributes:
        name: the host name. temporary: the resolver said to try again later (EAI_AGAIN), rather
            than that the name does not exist.
    """

    def __init__(self, name: str, reason: str, temporary: bool, family: str = "") -> None:
        super().__init__(f"cannot resolve {name}{family}: {reason}")
        self.name, self.temporary = name, temporary


async def resolve_tcp(maddr: multiaddr.Multiaddr) -> list[multiaddr.Multiaddr]:
    """The dialable forms of a TCP multiaddr: a ``/dns4``, ``/dns6`` or ``/dns`` name resolved as the
    system does (``trio.socket.getaddrinfo``), the rest of the address kept; any other address as it is.

    Args:
        maddr: e.g. ``/dns4/localhost/tcp/4001/p2p/12D3KooW...``.
    Returns:
        One multiaddr per distinct address, in the resolver's order (``/dns4`` gives ``/ip4`` only,
        ``/dns6`` ``/ip6`` only, ``/dns`` both).
    Raises:
        NameNotResolved: the name does not resolve (to an address of the asked family).
    """
    protocols = list(maddr.protocols())
    kind = protocols[0].name if protocols else ""
    if kind not in FAMILIES:
        return [maddr]
    name = maddr.value_for_protocol(kind)
    port = maddr.value_for_protocol("tcp") if "tcp" in [p.name for p in protocols] else None
    try:
        infos = await trio.socket.getaddrinfo(name, port, family=FAMILIES[kind], type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise NameNotResolved(name, e.strerror or str(e), temporary=e.errno == socket.EAI_AGAIN,
                              family=TO_FAMILY[kind]) from None
    rest = str(maddr)[len(f"/{kind}/{name}"):]
    out: list[multiaddr.Multiaddr] = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0].split("%", 1)[0]  # an IPv6 link-local scope is not part of /ip6
        proto = "ip4" if family == socket.AF_INET else "ip6"
        addr = multiaddr.Multiaddr(f"/{proto}/{ip}{rest}")
        if addr not in out:
            out.append(addr)
    if not out:
        raise NameNotResolved(name, "no address", temporary=False, family=TO_FAMILY[kind])
    log.debug("name.resolved name=%s addrs=%s", name, [str(a) for a in out])
    return out


class SystemResolvingTCP(TCP):
    """libp2p's TCP transport, its ``/dns4``, ``/dns6`` and ``/dns`` names resolved by ``resolve_tcp``:
    each address the name resolves to is dialed in turn until one connects."""

    async def dial(self, maddr: multiaddr.Multiaddr):
        return await self._each(maddr, super().dial)

    async def dial_with_source(self, maddr: multiaddr.Multiaddr, source: tuple[str, int]):
        return await self._each(maddr, lambda addr: super(SystemResolvingTCP, self).dial_with_source(addr, source))

    @staticmethod
    async def _each(maddr: multiaddr.Multiaddr, dial):
        addrs = await resolve_tcp(maddr)
        for addr in addrs[:-1]:
            try:
                return await dial(addr)
            except OpenConnectionError as e:
                log.debug("name.dial_failed addr=%s error=%s", addr, e)
        return await dial(addrs[-1])

"""A NAT lab in network namespaces for the relay / hole-punching tests (issue 15).

``NatLab`` builds, and always removes, five namespaces and their links; nothing in them can reach
any other network (no route out, no link to the root namespace)::

    h1 (192.168.1.2) -- r1 [NAT] --\\                    /-- r2 [NAT] -- h2 (192.168.2.2)
                       10.77.0.11  \\-- pub: br0 ------/  10.77.0.12
                                        10.77.0.1 (relay, public stages, the client)

Each router masquerades its LAN behind its WAN address and drops (never rejects) every inbound
packet that does not belong to a connection from inside, also one to its own address (a home
router). ``random_ports=False``: the NAT keeps the
source port (``MASQUERADE``; hole punching works); ``True``: it picks a random port per
connection (``--random-fully``; hole punching cannot work, the relay must carry everything).

Needs root, ``ip`` (iproute2) and ``iptables``; ``NatLab.unavailable()`` says in one line what is
missing (the tests skip with it). Command runner: ``ns_exec(name)`` gives the argv prefix that runs
a command inside a namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def _run(*argv: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")


class NatLab:
    """Context manager: the namespaces above; ``ns("pub")`` etc. are their names."""

    PUB_IP = "10.77.0.1"

    def __init__(self, random_ports: bool = False) -> None:
        self.random_ports = random_ports
        self.tag = f"sw{os.getpid() % 100000}{'r' if random_ports else 'p'}"
        self.names = {n: f"{self.tag}-{n}" for n in ("pub", "r1", "r2", "h1", "h2")}

    def ns(self, name: str) -> str:
        return self.names[name]

    def ns_exec(self, name: str) -> list[str]:
        """The argv prefix that runs a command inside namespace ``name``."""
        return ["ip", "netns", "exec", self.names[name]]

    def host_ip(self, i: int) -> str:
        return f"192.168.{i}.2"

    @staticmethod
    def unavailable() -> str | None:
        """Why the lab cannot be built here (one line), or None."""
        if os.geteuid() != 0:
            return "the NAT lab needs root (network namespaces, iptables)"
        for tool in ("ip", "iptables"):
            if shutil.which(tool) is None:
                return f"the NAT lab needs `{tool}` (install iproute2 / iptables)"
        probe = f"swprobe{os.getpid() % 100000}"
        try:
            _run("ip", "netns", "add", probe)
            _run("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n")
        except RuntimeError as e:
            return f"cannot make network namespaces with NAT here: {e}"
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def __enter__(self) -> NatLab:
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build(self) -> None:
        n = self.names
        for name in n.values():
            _run("ip", "netns", "add", name)
        for name in n.values():
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", n["pub"], "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", n["pub"], "addr", "add", f"{self.PUB_IP}/24", "dev", "br0")
        _run("ip", "-n", n["pub"], "link", "set", "br0", "up")
        for i in (1, 2):
            r, h = n[f"r{i}"], n[f"h{i}"]
            _run("ip", "-n", r, "link", "add", "wan", "type", "veth", "peer", "name", f"r{i}wan", "netns", n["pub"])
            _run("ip", "-n", n["pub"], "link", "set", f"r{i}wan", "master", "br0")
            _run("ip", "-n", n["pub"], "link", "set", f"r{i}wan", "up")
            _run("ip", "-n", r, "addr", "add", f"10.77.0.1{i}/24", "dev", "wan")
            _run("ip", "-n", r, "link", "set", "wan", "up")
            _run("ip", "-n", r, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", h)
            _run("ip", "-n", r, "addr", "add", f"192.168.{i}.1/24", "dev", "lan")
            _run("ip", "-n", r, "link", "set", "lan", "up")
            _run("ip", "-n", h, "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0")
            _run("ip", "-n", h, "link", "set", "eth0", "up")
            _run("ip", "-n", h, "route", "add", "default", "via", f"192.168.{i}.1")
            _run("ip", "netns", "exec", r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            masq = ["-j", "MASQUERADE"] + (["--random-fully"] if self.random_ports else [])
            _run("ip", "netns", "exec", r, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", *masq)
            _run("ip", "netns", "exec", r, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack",
                 "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _run("ip", "netns", "exec", r, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
            # a packet to the router's own WAN address that no connection expects is dropped, not
            # answered with a reset (a reset would tear down the other side's half of a punch)
            _run("ip", "netns", "exec", r, "iptables", "-A", "INPUT", "-i", "wan", "-m", "conntrack",
                 "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _run("ip", "netns", "exec", r, "iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP")

    def __exit__(self, *exc) -> None:
        for name in self.names.values():  # deleting a namespace removes its links (and their peers)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

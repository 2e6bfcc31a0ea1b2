"""A dial that fails because this process is out of file descriptors says so, instead of blaming the
peer with "nothing accepts connections there" (issue 45 item 2: a heal to a live spare, from a
``swarm serve`` whose descriptors slow clients held, was reported as the spare's fault)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.process

# a child process: a live TCP listener, then every descriptor taken (under a lowered RLIMIT_NOFILE),
# then libp2p's own TCP dial to the listener; what dial_failure makes of the error it raises
CHILD = textwrap.dedent("""
    import resource, socket, trio
    from multiaddr import Multiaddr
    from libp2p.transport.tcp.tcp import TCP
    from swarm.transport.host import dial_failure

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    async def main():
        held = []
        if FILL:
            try:
                while True:
                    held.append(socket.socket())
            except OSError:
                pass
        try:
            await TCP().dial(Multiaddr(f"/ip4/127.0.0.1/tcp/{port}"))
        except Exception as exc:
            for s in held:
                s.close()
            print("FAILED", dial_failure(exc, "12D3KooWAbcdefgh"))
        else:
            print("DIALED")

    trio.run(main)
""")


def run_child(fill: bool) -> str:
    out = subprocess.run([sys.executable, "-c", f"FILL = {fill}\n" + CHILD], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_a_dial_without_descriptors_blames_this_process_not_the_peer():
    said = run_child(fill=True)
    assert said.startswith("FAILED cannot be dialed from here: this process is out of file descriptors"), said
    assert "nothing accepts connections" not in said


def test_the_same_dial_with_descriptors_left_connects():
    assert run_child(fill=False) == "DIALED"

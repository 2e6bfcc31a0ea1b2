"""Import hygiene of swarm.transport, and the optional health monitor catching a frozen peer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm.errors import ConfigError, StreamClosed
from swarm.transport import open_host

from tests.support.transport import run, trio_test

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

CHILD = """
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from swarm.transport import open_host

async def main():
    async def echo(stream):
        while True:
            await stream.send(await stream.recv())
    async with open_host(create_new_key_pair()) as host:
        host.set_handler("/swarm-test/echo/1", echo)
        print(host.addrs()[0], flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@pytest.mark.process
def test_import_does_not_load_torch_or_numpy() -> None:
    code = (
        "import sys, swarm.transport\n"
        "bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, check=True, timeout=60)


@pytest.mark.ring
@pytest.mark.serial  # a child's start and the detection within 9.5 s
def test_health_monitor_turns_a_frozen_peer_into_stream_closed() -> None:
    run(_frozen_peer_scenario, timeout_s=9.5)  # child start ~1 s + detection ~2.5 s


async def _frozen_peer_scenario() -> None:
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", CHILD], cwd=REPO, env=ENV, stdout=subprocess.PIPE
    )
    try:
        line = b""
        with trio.fail_after(6):
            while not line.endswith(b"\n"):
                chunk = await child.stdout.receive_some(1024)
                assert chunk, "child host exited before printing its address"
                line += chunk
        async with open_host(create_new_key_pair(), health_check_interval_s=1.0) as host:
            stream = await host.open_stream(line.decode().strip(), "/swarm-test/echo/1", timeout_s=3)
            await stream.send({"n": 1})
            assert await stream.recv(timeout_s=3) == {"n": 1}
            os.kill(child.pid, signal.SIGSTOP)  # frozen: TCP stays up, nothing answers
            t0 = time.monotonic()
            with pytest.raises(StreamClosed):
                await stream.recv(timeout_s=6)
            assert time.monotonic() - t0 < 6
    finally:
        child.kill()
        with trio.CancelScope(shield=True):
            await child.wait()


@pytest.mark.ring
@trio_test
async def test_health_interval_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        async with open_host(create_new_key_pair(), health_check_interval_s=0):
            pass

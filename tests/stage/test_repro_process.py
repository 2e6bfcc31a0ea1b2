"""One reproducibility class, one set of bits: two separate stage processes of the same range of the real
stories260k model, fed the same session, sign the same output digests and window roots and report the
same class id (in their ``info`` and their receipts). In the fma kernel mode the second runs at another
thread count, which the class does not name because it changes no bit."""

from __future__ import annotations

import pytest
import trio

from swarm import receipts, wire
from swarm.cli.launch import LocalRing
from swarm.config import RingSpec
from swarm.errors import collapse
from swarm.kernels import fma
from swarm.ranges import LayerRange
from swarm.transport import load_or_create_key, open_host
from tests.support.ring import LOOPBACK, ring_generate

pytestmark = [pytest.mark.process, pytest.mark.slow]

PROMPT = [1, 403, 407, 261, 378, 259, 402, 88, 17, 300]
NEW = 24


async def _info(host, addr: str) -> dict:
    stream = await host.open_stream(addr, wire.PROTOCOL_ID, timeout_s=10)
    try:
        await stream.send(wire.frame("info"), timeout_s=10)
        return await stream.recv(timeout_s=10)
    finally:
        await stream.aclose()


def test_two_processes_of_one_class_give_the_same_bits(stories_dir, tmp_path):
    fused = fma.available()[0]  # in the rows mode the thread count is part of the class: keep it equal
    ranges = [LayerRange(0, 2), LayerRange(0, 2), LayerRange(2, 5)]
    got: dict = {}
    with LocalRing(str(stories_dir), ranges, tmp_path / "keys", threads=1, extra_args=["--dtype", "float32"],
                   per_stage_args={1: ["--threads", "2"]} if fused else None) as ring:
        a, b, tail = ring.stages

        async def main():
            with trio.fail_after(120):
                async with open_host(load_or_create_key(tmp_path / "probe.key"), [LOOPBACK]) as host:
                    got["info"] = [await _info(host, sp.addr) for sp in (a, b)]
                for name, head in (("a", a), ("b", b)):
                    spec = RingSpec(model=str(stories_dir), stages=(
                        ring.ring_spec().stages[ring.stages.index(head)], ring.ring_spec().stages[2]))
                    info: dict = {}
                    job = {"id": f"job-{name}", "nonce": receipts.new_nonce()}
                    got[name] = await ring_generate(spec, stories_dir, 5, PROMPT, NEW, tmp_path, info=info, job=job)
                    got[name + "_receipt"] = info["receipt_parts"]["stage_receipts"][0]

        try:
            trio.run(main)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    ra, rb = got["a_receipt"], got["b_receipt"]
    assert ra["peer_id"] != rb["peer_id"]  # two processes, two identities
    assert got["a"] == got["b"]
    assert ra["repro"]["id"] == rb["repro"]["id"] == got["info"][0]["repro"]["id"] == got["info"][1]["repro"]["id"]
    assert ra["repro"]["facts"]["kernel"]["mode"] == ("fma" if fused else "rows")
    # the same hidden states, bit for bit: the rolling digest of every frame sent, and the window root
    assert ra["output"] == rb["output"] and ra["input"] == rb["input"]
    assert ra["windows"] == rb["windows"] and ra["windows"]["positions"] == len(PROMPT) + NEW - 1

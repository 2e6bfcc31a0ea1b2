"""The order of a heal's repair frames (swarm.coordinator.repair.RingRepair.repair_session), with the
ring's links faked: a shadow is promoted only once its successor takes frames from it (a promoted
shadow sends on the mirrored frames it still computes; a successor that still expected the lost stage
refused them as "forbidden": the likely cause of the one request the chaos soak of issue 31 lost)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from swarm.coordinator.repair import RingRepair
from swarm.frames import Repair, RepairOk
from swarm.transport import load_or_create_key


class FakeLink:
    def __init__(self, i: int, sent: list):
        self.spec = SimpleNamespace(addr=f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/peer{i}")
        self.info = SimpleNamespace(peer_id=f"peer{i}", layers=(i, i + 1))
        self.data = SimpleNamespace(send=self._send)
        self.i, self.sent = i, sent

    async def _send(self, frame: Repair, timeout_s: float) -> None:
        wire_map = frame.to_wire()
        self.sent.append((self.i, {k: wire_map[k] for k in ("prev", "next", "resend", "mirror") if k in wire_map}))


class FakeNet:
    hop_timeout_s = 5.0

    def __init__(self, n: int):
        self.sent: list = []
        self.links = [FakeLink(i, self.sent) for i in range(n)]

    async def expect(self, index: int, kind: type, session: str | None = None) -> RepairOk:
        assert kind is RepairOk
        return RepairOk(session=session, kv_len=100, resent=0, mirrored=100)


@pytest.mark.parametrize("index", [1, 2, 0], ids=["middle", "tail", "head"])
def test_a_shadow_is_promoted_after_its_successor_takes_its_frames(tmp_path, index):
    net = FakeNet(4)
    host = SimpleNamespace(key_pair=load_or_create_key(tmp_path / "c.key"))
    repair = RingRepair(net, host, [], open_at=None, books={})
    if index == 2:  # make it the tail: a ring of 3
        net.links.pop()
    repair.head_mirrors["s"] = SimpleNamespace(promote=_true, end=100, digest=None)

    async def main():
        return await repair.repair_session("s", index, 1, epoch=1, keep=50, tokens=list(range(60)), replaced="lost",
                                           max_len=128, shadow=True)

    assert trio.run(main) is None
    order = [i for i, _ in net.sent]
    promoted = order.index(index)
    assert net.sent[promoted][1] == ({"next": net.links[index + 1].spec.addr} if index + 1 < len(net.links) else {})
    if index + 1 < len(net.links):  # its successor first: it takes frames from the shadow from now on
        assert net.sent[0] == (index + 1, {"prev": f"peer{index}"}) and promoted == 1
    else:
        assert promoted == 0  # a new tail has no successor: promoted at once
    assert sorted(order) == list(range(len(net.links)))  # every survivor repaired once
    if index > 0:  # the predecessor last: it promotes its mirror
        assert net.sent[-1][0] == index - 1 and net.sent[-1][1]["mirror"] is True


async def _true() -> bool:
    return True

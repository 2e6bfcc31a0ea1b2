"""Stand-ins for a stage driven directly by a test: an in-memory FramedStream, a host with no network."""

from __future__ import annotations

from swarm.frames import Frame
from swarm.transport.framing import encode_frame


class MemStream:
    """An in-memory stand-in for a FramedStream: remembers what the stage sends."""

    def __init__(self, peer: str):
        self.remote_peer_id = peer
        self.sent: list[dict] = []
        self.closed = False

    async def send(self, msg, timeout_s=None):
        encode_frame(msg)  # what the stage sends must be a valid frame
        self.sent.append(msg.to_wire() if isinstance(msg, Frame) else msg)  # as the wire carries it

    async def aclose(self):
        self.closed = True


class NoNetwork:
    """A stage's host that has no network: every dial fails with StageLost."""

    def __init__(self, peer_id):
        self.peer_id = peer_id

    def addrs(self) -> list[str]:
        return []  # listens nowhere (a stage's info lists its addresses)

    async def open_stream(self, *a, **k):
        from swarm.errors import StageLost

        raise StageLost("no network in the fuzz test")

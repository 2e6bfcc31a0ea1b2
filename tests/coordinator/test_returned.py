"""The coordinator's books for the heal's probes: a result counts as returned when it arrives.

A heal probes the ring while nothing reads the tail's frames; a result that arrived then waits in the
queue. Counting it only once read made the re-check blame the healthy tail ("it sent result 5, the
coordinator got only 4") when a paused head resumed during the heal (CI, stop 54).
"""

from types import SimpleNamespace

import trio

from swarm.config import RingSpec
from swarm.coordinator.ring import RingClient
from swarm.errors import StreamClosed
from swarm.heal import Probe, StageReport, locate_failure


class _Frames:
    """A stream that yields the given frames, then closes."""

    def __init__(self, frames):
        self.frames = list(frames)

    async def recv(self):
        if not self.frames:
            raise StreamClosed("closed")
        return self.frames.pop(0)


def _client() -> RingClient:
    spec = RingSpec.from_dict({"model": "m", "stages": [{"addr": "/ip4/127.0.0.1/tcp/1/p2p/A", "layers": "0:2"},
                                                        {"addr": "/ip4/127.0.0.1/tcp/2/p2p/B", "layers": "2:4"}]})
    client = RingClient(None, spec, 30.0, 10.0)
    client.net.links = [SimpleNamespace(generation=10), SimpleNamespace(generation=11)]
    client.returned["s"], client.sent["s"] = 4, 5
    return client


def _pump(client: RingClient, index: int, gen: int, frames) -> None:
    trio.run(client.net._pump, index, gen, _Frames(frames))


def test_a_result_from_the_tail_counts_as_returned_before_anyone_reads_it():
    client = _client()
    result = {"type": "result", "session": "s", "chunk": 5, "epoch": 0, "ids": [7]}
    _pump(client, 1, 11, [result])
    assert client.returned["s"] == 5
    queued = client.net._recv_ch.receive_nowait()
    assert queued == (1, 11, result)  # still there for next_result, unread
    # the heal's re-check of a ring whose tail sent result 5 blames nobody
    reports = (StageReport(0, True, 5, 5), StageReport(1, True, 5, 5))
    earlier = Probe(reports, 5, 4)
    assert locate_failure(reports, client.sent["s"], client.returned["s"], earlier) is None


def test_only_the_current_tails_results_for_an_open_session_count():
    client = _client()
    _pump(client, 0, 10, [{"type": "result", "session": "s", "chunk": 9}])  # not the tail
    _pump(client, 1, 99, [{"type": "result", "session": "s", "chunk": 9}])  # a replaced connection
    _pump(client, 1, 11, [{"type": "result", "session": "other", "chunk": 9},  # no such session
                          {"type": "result", "session": "s", "chunk": "9"},  # malformed: validation reports it
                          {"type": "result", "session": "s", "chunk": 3}])  # older than what came back
    assert client.returned == {"s": 4}

"""The coordinator's books for the heal's probes: a result counts as returned when it arrives.

A heal probes the ring while nothing reads the tail's frames; a result that arrived then waits in the
queue. Counting it only once read made the re-check blame the healthy tail ("it sent result 5, the
coordinator got only 4") when a paused head resumed during the heal (CI, stop 54).
"""

from types import SimpleNamespace

import trio

from swarm.config import RingSpec
from swarm.coordinator.books import SessionBook
from swarm.coordinator.ring import RingClient
from swarm.errors import StreamClosed
from swarm.frames import LinkLost, Result
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
    client.books["s"] = SessionBook(sent=5, returned=4)
    return client


def _pump(client: RingClient, index: int, gen: int, frames) -> None:
    trio.run(client.net._pump, index, gen, _Frames(frames))


def _result(session: str, chunk) -> dict:
    result = Result(session=session, epoch=0, pos=chunk if type(chunk) is int else 0, chunk=0, token_ids=[7])
    return {**result.to_wire(), "chunk": chunk}


def test_a_result_from_the_tail_counts_as_returned_before_anyone_reads_it():
    client = _client()
    _pump(client, 1, 11, [_result("s", 5)])
    assert client.books["s"].returned == 5
    queued = client.net._recv_ch.receive_nowait()
    assert queued == (1, 11, Result("s", 0, 5, 5, [7]))  # still there for next_result, unread
    # the heal's re-check of a ring whose tail sent result 5 blames nobody
    reports = (StageReport(0, True, 5, 5), StageReport(1, True, 5, 5))
    earlier = Probe(reports, 5, 4)
    assert locate_failure(reports, client.books["s"].sent, client.books["s"].returned, earlier) is None


def test_only_the_current_tails_results_for_an_open_session_count():
    client = _client()
    _pump(client, 0, 10, [_result("s", 9)])  # not the tail
    _pump(client, 1, 99, [_result("s", 9)])  # a replaced connection
    _pump(client, 1, 11, [_result("other", 9),  # no such session
                          _result("s", 3)])  # older than what came back
    assert client.books["s"].returned == 4 and set(client.books) == {"s"}


def test_a_malformed_frame_from_a_stage_counts_as_its_link_lost_and_nothing_returned():
    client = _client()
    _pump(client, 1, 11, [_result("s", "9"), _result("s", 5)])  # the second is never read
    assert client.books["s"].returned == 4 and set(client.books) == {"s"}
    index, gen, lost = client.net._recv_ch.receive_nowait()
    assert (index, gen) == (1, 11) and isinstance(lost, LinkLost) and "chunk" in lost.reason
    assert 11 in client.net.lost_gens

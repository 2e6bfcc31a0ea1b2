"""A stage whose successor stream ends tells the coordinator at once (``swarm.stage.outbox``), driven
directly with in-memory streams: no model, no network."""

from __future__ import annotations

import trio

from swarm import wire
from swarm.errors import StreamClosed
from swarm.ranges import LayerRange
from swarm.stage.outbox import Outboxes
from swarm.stage.session import Session
from tests.support.streams import MemStream

NEXT = "/ip4/10.0.0.2/tcp/4001/p2p/12D3KooWSuccessor"


class EndingStream(MemStream):
    """A successor stream whose peer (or the connection under it) goes away when ``end`` is called:
    from then on ``recv`` raises StreamClosed and ``closed`` is true, as a FramedStream's are."""

    def __init__(self, peer: str):
        super().__init__(peer)
        self._ended = trio.Event()

    def end(self) -> None:
        self.closed = True
        self._ended.set()

    async def recv(self, timeout_s=None):
        await self._ended.wait()
        raise StreamClosed("peer 12D3KooWSuccessor reset the stream")


def _outboxes(sessions: dict, nursery, successor) -> Outboxes:
    async def dial(addr):
        return successor

    return Outboxes(sessions, LayerRange(0, 2), 4, {"frames_out": 0, "outbox_s": 0.0, "send_s": 0.0},
                    hop_timeout_s=5.0, dial=dial, spawn=nursery.start_soon,
                    error=wire.error_frame)


def _session(sid: str, reply, next_stream) -> Session:
    return Session(session_id=sid, cache=None, reply=reply, next_addr=NEXT, next_stream=next_stream,
                   span=LayerRange(0, 2), epoch=3)


async def _first_error(reply: MemStream) -> dict:
    with trio.fail_after(2):
        while not reply.sent:
            await trio.sleep(0.01)
    return reply.sent[0]


def test_a_successor_stream_that_ends_between_chunks_fails_its_sessions_at_once():
    """The stream ends while no frame is queued on it (a relayed hop whose relay died between two
    decode steps): every session sending on it gets an ``unavailable`` error naming the successor,
    stamped with its epoch; the sessions themselves (and their KV caches) stay for a heal's repair,
    and a frame computed afterwards goes nowhere. Before, the end was noticed only by the task that
    reads the stream, which dropped it in silence: the next frames vanished and the coordinator
    found the gap seconds later by probing."""

    async def main():
        succ, other = EndingStream("12D3KooWSuccessor"), MemStream("12D3KooWElsewhere")
        replies = {sid: MemStream("12D3KooWCoordinator") for sid in ("a", "b", "c")}
        sessions: dict[str, Session] = {}
        async with trio.open_nursery() as nursery:
            out = _outboxes(sessions, nursery, succ)
            assert await out.successor(NEXT) is succ
            sessions.update({"a": _session("a", replies["a"], succ), "b": _session("b", replies["b"], succ),
                             "c": _session("c", replies["c"], other)})
            await trio.sleep(0.05)
            assert all(not r.sent for r in replies.values())
            succ.end()
            errs = {sid: await _first_error(replies[sid]) for sid in ("a", "b")}
            await trio.sleep(0.1)
            assert NEXT not in out.successors
            assert not replies["c"].sent and sessions["c"].next_stream is other  # another successor: untouched
            for sid, err in errs.items():
                assert err["type"] == "error" and err["code"] == "unavailable" and err["session"] == sid, err
                assert "lost its successor" in err["reason"] and NEXT in err["reason"] and err["epoch"] == 3, err
                assert sid in sessions and sessions[sid].next_stream is None
            out.post(sessions["a"].next_stream, sessions["a"], wire.frame("receipt", session="a"))
            await trio.sleep(0.05)
            assert succ.sent == [] and len(replies["a"].sent) == 1
            nursery.cancel_scope.cancel()

    trio.run(main)


class _PromotedMirror:
    """A mirror whose shadow was promoted to successor and whose stream then ended: what
    ``swarm.mirror.Mirror.run`` does at that point is call ``on_end`` with its stream."""

    addr = NEXT

    def __init__(self, stream):
        self.stream = stream

    async def run(self, dial, alive, on_error, on_end):
        await on_end(self.stream)


def test_a_promoted_shadow_whose_stream_ends_fails_the_session_at_once():
    async def main():
        shadow, reply = MemStream("12D3KooWShadow"), MemStream("12D3KooWCoordinator")
        sessions: dict[str, Session] = {}
        async with trio.open_nursery() as nursery:
            out = _outboxes(sessions, nursery, shadow)
            sess = sessions["a"] = _session("a", reply, shadow)  # a heal made the shadow its successor
            await out.run_mirror(sess, _PromotedMirror(shadow))
            err = await _first_error(reply)
            assert err["code"] == "unavailable" and "lost its successor" in err["reason"], err
            assert sess.next_stream is None
            nursery.cancel_scope.cancel()

    trio.run(main)

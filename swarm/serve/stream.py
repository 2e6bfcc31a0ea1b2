"""Streaming answers of ``swarm serve``: server-sent events over a generation running in the server's nursery.

Owns: ``stream`` (the response status waits for the ring's decision: 200 once the session is open,
the error's status if it was refused first), the SSE chunks in OpenAI's shapes, keep-alive comments
while a stream waits, and ending a stream whose client left.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import trio

from swarm.errors import SwarmError
from swarm.serve.completion import Detok, finish_reason, generate_ids, map_error, usage
from swarm.serve.lifecycle import cancel_after, shutting_down
from swarm.serve.requests import Request, error_response

if TYPE_CHECKING:
    from starlette.requests import Request as HttpRequest
    from starlette.responses import Response

    from swarm.serve.state import ServeState

log = logging.getLogger(__name__)

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: every SSE parser skips it, every proxy sees bytes


async def stream(state: ServeState, req: Request, rid: str, created: int, request: HttpRequest) -> Response:
    """A streaming request: its generation starts in the server's nursery, and the response status
    waits for the ring's decision. Admitted (the session is open at every stage): 200 and server-sent
    events. Refused before that (the ring is busy or unavailable): the error's status (503 with
    Retry-After), not a 200 with an error inside. Still waiting after ``state.config.lifecycle.keepalive_s``
    (queued for a ring client behind ``--max-concurrency`` requests): 200 then, with keep-alive
    comments until it runs; a refusal after that can only be an error event.

    While a stream waits (queue, prefill, a heal) it sends an SSE comment every ``keepalive_s``, so
    proxies that cut idle connections keep it. A client that leaves stops the generation after its
    next result (a prefill chunk's): the session closes at every stage the normal way (cancelled
    if that takes more than 10 s); one still queued leaves the queue at once.
    """
    from starlette.responses import Response, StreamingResponse

    send, recv = trio.open_memory_channel(math.inf)
    scope = trio.CancelScope()
    gone = trio.Event()  # the client left (or the stream ended): stop at the next result
    opened = trio.Event()  # every stage admitted the session

    async def work():
        try:
            with scope:
                try:
                    got = await generate_ids(state, req, lambda t: send.send_nowait(("text", t)), gone, opened.set)
                    send.send_nowait(("done", got))
                except SwarmError as exc:
                    log.warning("request.failed id=%s reason=%s", rid, exc)
                    send.send_nowait(("error", map_error(exc)))
        finally:
            state.requests.pop(rid, None)

    def stop() -> None:  # stop at the next result; cancel if that takes too long
        gone.set()
        state.nursery.start_soon(cancel_after, scope, 10.0)

    state.requests[rid] = lambda: send.send_nowait(("error", shutting_down()))
    state.nursery.start_soon(work)
    what, first = await _admission(request, opened, recv, state.config.lifecycle.keepalive_s)
    if what == "gone":  # left before an answer: a queued request leaves the queue, an open session closes
        stop()
        log.info("request.abandoned id=%s", rid)
        return Response(status_code=499)
    if first is not None and first[0] == "error":  # refused, failed or shut down before anything was sent
        stop()
        return error_response(first[1])
    chunks = Chunks(state, req, rid, created)
    return StreamingResponse(_events(chunks, first, recv, state.config.lifecycle.keepalive_s, stop),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class Chunks:
    """The server-sent events of one streamed answer, in OpenAI's chunk shapes
    (``chat.completion.chunk`` or ``text_completion``)."""

    def __init__(self, state: ServeState, req: Request, rid: str, created: int):
        self.state, self.req, self.rid, self.created = state, req, rid, created
        self.obj = "chat.completion.chunk" if req.chat else "text_completion"

    def chunk(self, text: str | None = None, reason: str | None = None, role: bool = False) -> str:
        """A chunk with a choice: text (a chat's ``delta``), the finish reason, or a chat's role."""
        if self.req.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return self._event({"choices": [choice]})

    def done(self, out: list[int], record: dict, detok: Detok) -> list[str]:
        """The last chunks: the finish reason, and the usage when the request asked for it."""
        events = [self.chunk(reason=finish_reason(out, self.req, self.state, detok, record))]
        if self.req.include_usage:
            events.append(self._event({"choices": [], "usage": usage(self.req, out, record)}))
        return events

    def _event(self, fields: dict) -> str:
        return "data: " + json.dumps({"id": self.rid, "object": self.obj, "created": self.created,
                                      "model": self.state.model_id, **fields}) + "\n\n"


async def _events(chunks: Chunks, first: tuple | None, recv: trio.MemoryReceiveChannel, keepalive_s: float,
                  stop: Callable[[], None]) -> AsyncIterator[str]:
    """The stream's events: the generation's messages from ``recv`` (``first`` already taken) as
    chunks, an SSE comment each ``keepalive_s`` without one, then ``[DONE]``. However it ends (the
    client left too), ``stop()`` ends the generation."""
    pending = first
    try:
        if chunks.req.chat:
            yield chunks.chunk(role=True)
        while True:
            if pending is None:
                with trio.move_on_after(keepalive_s or math.inf):
                    pending = await recv.receive()
                if pending is None:  # idle (queued, a long prefill, a heal): bytes for the proxies
                    yield KEEPALIVE
                    continue
            (kind, value), pending = pending, None
            if kind == "text":
                yield chunks.chunk(value)
            elif kind == "error":
                yield "data: " + json.dumps(value.body()) + "\n\n"
                break
            else:
                for event in chunks.done(*value):
                    yield event
                break
        yield "data: [DONE]\n\n"
    finally:
        # a client that left: generation stops at its next result and closes the session at every
        # stage, keeping the ring client's streams (closing streams under load is what py-libp2p
        # 0.8.1 handles worst: it can drop the connection other requests share); cancel only if
        # that takes too long
        stop()


async def _admission(request: HttpRequest, opened: trio.Event, recv: trio.MemoryReceiveChannel,
                     wait_s: float) -> tuple[str, tuple | None]:
    """Wait for the first of: the session opened (``"opened"``), a message from the generation
    (``"message"``: an error, or text of a fast one), ``wait_s`` (> 0) passed (``"waited"``), the
    client hung up (``"gone"``). Returns (which, the message received meanwhile or None)."""
    box: dict = {}

    async with trio.open_nursery() as nursery:
        def decided(what: str) -> None:
            box.setdefault("what", what)
            nursery.cancel_scope.cancel()

        async def on_open():
            await opened.wait()
            decided("opened")

        async def on_message():
            box["message"] = await recv.receive()  # a cancelled receive takes nothing from the channel
            decided("message")

        async def on_wait():
            await trio.sleep(wait_s)
            decided("waited")

        async def on_hang_up():
            while (await request.receive()).get("type") != "http.disconnect":
                pass
            decided("gone")

        for task in (on_open, on_message, on_hang_up) + ((on_wait,) if wait_s > 0 else ()):
            nursery.start_soon(task)
    return box["what"], box.get("message")

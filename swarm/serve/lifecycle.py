"""The lifecycle of ``swarm serve`` and of its requests: hang-ups, the drain, signals.

Owns: ``until_hang_up`` (a generation stops when its client hangs up or a drain's deadline passes), ``Shutdown``
and ``drain_on_signals`` (SIGTERM drains, Ctrl-C ends the streams now), ``drain`` and the 503 a request gets
while the server shuts down.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from swarm.serve.config import DEFAULT_DRAIN_TIMEOUT_S
from swarm.serve.requests import ApiError

if TYPE_CHECKING:
    from starlette.requests import Request as HttpRequest

    from swarm.serve.state import ServeState

log = logging.getLogger(__name__)


async def until_hang_up(request: HttpRequest, work: Callable[[trio.Event], Awaitable[Any]], grace_s: float = 10.0,
                        ended: trio.Event | None = None) -> Any:
    """Run ``work(gone)`` (a request's generation) while watching the client's connection: when the
    client hangs up (or ``ended`` is set: a drain's deadline passed), ``gone`` is set, so the
    generation stops after its next result and closes its sessions the normal way; it is
    cancelled if it has not ended ``grace_s`` later.

    Returns:
        what ``work`` returned, or None if the client hung up.
    Raises:
        what ``work`` raised (not wrapped in an exception group).
    """
    gone = trio.Event()
    box: dict = {}

    async def stop_then_cancel(scope):
        gone.set()
        await trio.sleep(grace_s)
        scope.cancel()

    async def watch(scope):
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                box["hung_up"] = True
                await stop_then_cancel(scope)
                return

    async def end(scope):
        await ended.wait()
        await stop_then_cancel(scope)

    async def run(scope):
        try:
            box["result"] = await work(gone)
        except Exception as exc:  # handed to the caller below, outside the nursery
            box["error"] = exc
        finally:
            scope.cancel()  # stop watching

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        if ended is not None:
            nursery.start_soon(end, nursery.cancel_scope)
        nursery.start_soon(run, nursery.cancel_scope)
    if box.get("hung_up"):
        return None
    if "error" in box:
        raise box["error"]
    return box.get("result")


async def cancel_after(scope: trio.CancelScope, seconds: float) -> None:
    """Cancel ``scope`` ``seconds`` from now (a stopped generation that did not end by itself)."""
    await trio.sleep(seconds)
    scope.cancel()


@dataclass
class Shutdown:
    """Asks a running ``serve_api`` to drain and return: ``request(timeout_s)`` (SIGTERM: the drain
    timeout; Ctrl-C: 0, end the open streams now). ``serving`` is set once the API listens."""

    requested: trio.Event = field(default_factory=trio.Event)
    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    serving: bool = False

    def request(self, timeout_s: float) -> None:
        if not self.requested.is_set():
            self.timeout_s = timeout_s
            self.requested.set()


async def drain_on_signals(shutdown: Shutdown, drain_timeout_s: float,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The process's signals (main thread only), as ``swarm stage`` treats SIGTERM: SIGTERM drains
    with ``drain_timeout_s`` (again: logged and ignored, the drain has its deadline); Ctrl-C (SIGINT)
    drains with 0 s (open streams end now, with an error event and ``[DONE]``); a second Ctrl-C,
    or one before the API listens, raises KeyboardInterrupt (stop at once)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGINT and (shutdown.requested.is_set() or not shutdown.serving):
                raise KeyboardInterrupt
            if shutdown.requested.is_set():
                log.warning("drain.sigterm_again: already draining (--drain-timeout-s bounds it)")
                continue
            log.warning("drain.%s", "sigterm" if signum == signal.SIGTERM else "sigint")
            shutdown.request(drain_timeout_s if signum == signal.SIGTERM else 0.0)


async def drain(state: ServeState, timeout_s: float) -> dict:
    """Refuse new requests (503, Retry-After), let the ones in flight finish for up to ``timeout_s``,
    then end the rest: a stream gets an error event (``server_shutting_down``) and ``[DONE]``, a
    non-streaming request a 503; their sessions close at every stage. Returns what happened:
    ``requests_finished``, ``requests_ended``, ``waited_s``."""
    state.draining = True
    t0 = trio.current_time()
    before = len(state.requests)
    log.warning("serve.draining requests=%d timeout_s=%g", before, timeout_s)

    async def until_idle():
        while state.requests:
            await trio.sleep(0.05)

    with trio.move_on_after(timeout_s):
        await until_idle()
    ended = list(state.requests.items())
    for rid, end in ended:
        log.warning("request.ending id=%s reason=the drain deadline passed", rid)
        end()
    with trio.move_on_after(15.0):  # each stops after its next result, or is cancelled 10 s later
        await until_idle()
    done = {"requests_finished": before - len(ended), "requests_ended": len(ended),
            "waited_s": round(trio.current_time() - t0, 3)}
    log.warning("serve.drained finished=%d ended=%d waited_s=%.2f", done["requests_finished"],
                done["requests_ended"], done["waited_s"])
    return done


def shutting_down() -> ApiError:
    """The 503 of a request refused or ended because the server is draining (Retry-After 5 s)."""
    return ApiError(503, "the server is shutting down (draining): send the request to another server or retry",
                    None, "server_shutting_down", "server_error", retry_after_s=5)

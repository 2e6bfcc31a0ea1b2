"""``swarm.serve.completion``: a request waiting for a ring client gets the pool's own error."""

from __future__ import annotations

import pytest
import trio

from swarm.errors import StageLost
from swarm.serve.completion import _acquire_unless, map_error


class _NoRoute:
    """A client pool whose ring is gone: every acquire fails as a reroute that found no route does."""

    async def acquire(self):
        await trio.sleep(0)
        raise StageLost("stage 1 [2, 4) is unreachable; and no new route: no online holder covers [2, 4)")


@pytest.mark.parametrize("with_stop", [False, True], ids=["plain", "leavable"])
def test_a_request_waiting_for_a_client_gets_the_pools_stage_lost(with_stop):
    """Before: with a stop event (every HTTP request has one) the pool's StageLost came out of the
    waiting nursery as an ExceptionGroup, which serve answered as a 500 "internal server error"
    instead of a 503 naming the lost stage."""

    async def main():
        return await _acquire_unless(_NoRoute(), trio.Event() if with_stop else None)

    with pytest.raises(StageLost, match="no new route") as got:
        trio.run(main)
    err = map_error(got.value)
    assert err.status == 503 and err.code == "ring_unavailable" and "no online holder" in err.message

"""providers.gather_settled: a fan-out returns after a quorum plus a grace period, in virtual time."""

from __future__ import annotations

import trio
import trio.testing

from swarm.discovery.providers import gather_settled


def run(delays, **kw):
    done: list[float] = []

    async def main():
        start = trio.current_time()

        def job(d):
            async def one():
                await trio.sleep(d)
                done.append(d)
            return one

        n = await gather_settled([job(d) for d in delays], **kw)
        return n, trio.current_time() - start

    n, took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return n, took, done


def test_a_crashed_member_does_not_set_the_time():
    # 19 answer within 0.2 s, one never does (a crashed owner): back at 0.2 + grace, not at its deadline
    n, took, done = run([0.01 * i for i in range(1, 20)] + [1000.0], quorum=0.9, grace_s=0.3)
    assert n == 19 and abs(took - (0.18 + 0.3)) < 1e-6 and 1000.0 not in done


def test_all_finishing_before_the_grace_returns_at_once():
    n, took, _ = run([0.1, 0.2, 0.25], quorum=0.5, grace_s=5.0)
    assert n == 3 and abs(took - 0.25) < 1e-6


def test_stragglers_within_the_grace_are_kept():
    n, took, done = run([0.1] * 9 + [0.35], quorum=0.9, grace_s=0.3)
    assert n == 10 and abs(took - 0.35) < 1e-6


def test_no_jobs():
    assert run([])[0] == 0

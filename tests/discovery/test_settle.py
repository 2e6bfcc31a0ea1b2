"""providers.gather_settled: a fan-out returns after a quorum plus a grace period, in virtual time."""

from __future__ import annotations

import trio
import trio.testing

from swarm.discovery.providers import gather_settled, lookup_providers


def run(delays, enough_after: int | None = None, **kw):
    """gather_settled over jobs sleeping ``delays`` (virtual seconds); ``enough_after``: the fan-out has
    enough once that many finished. Returns (finished count, virtual seconds taken, delays finished)."""
    done: list[float] = []
    if enough_after is not None:
        kw["enough"] = lambda: len(done) >= enough_after

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


def test_enough_starts_the_grace_before_the_quorum():
    # a route has enough once 3 stages answered (say, they cover every layer): back at 0.3 + grace, not at 0.9's
    delays = [0.1, 0.2, 0.3] + [1.0 + i for i in range(7)]
    n, took, _ = run(delays, enough_after=3, quorum=0.9, grace_s=0.2)
    assert n == 3 and abs(took - 0.5) < 1e-6


class _Store:
    """A provider store whose GET_PROVIDERS answers arrive after a delay per node."""

    def __init__(self, answers):
        self.answers = answers  # peer -> (delay_s, [provider names])

    def get_providers(self, key):
        return []

    async def _get_providers_from_peer_with_closers(self, peer, key):
        delay, names = self.answers[peer]
        await trio.sleep(delay)
        return [_Info(n) for n in names], []


class _Info:
    def __init__(self, peer_id):
        self.peer_id, self.addrs = peer_id, ["/ip4/1.2.3.4/tcp/1"]


async def _slow_lookup(key, on_answer):
    await trio.sleep(4.0)  # a lookup waiting on slow dials, naming no node before its end
    return ["far"]


class _Host:
    def get_id(self):
        return "me"


class _Kad:
    def __init__(self, answers):
        self.provider_store, self.host = _Store(answers), _Host()


def test_a_provider_lookup_settles_after_the_first_answer_naming_providers():
    answers = {"boot1": (0.3, ["a", "b"]), "boot2": (0.4, ["b", "c"]), "boot3": (2.0, ["d"]), "far": (0.1, ["e"])}

    async def main(settle_s):
        found: dict = {}
        start = trio.current_time()
        await lookup_providers(_Kad(answers), b"k", found, _slow_lookup, first=["boot1", "boot2", "boot3"],
                               settle_s=settle_s)
        return sorted(found), trio.current_time() - start

    got, took = trio.run(main, 0.25, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == ["a", "b", "c"] and abs(took - 0.55) < 1e-6  # not waiting for the network lookup's 4 s
    got, took = trio.run(main, None, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == ["a", "b", "c", "d", "e"] and abs(took - 4.1) < 1e-6  # without settle_s: every answer


def test_a_provider_read_asks_each_node_of_the_lookup_as_it_answers():
    """With a lookup that reports nodes as they answer (``SwarmDHT.closest_nodes``' ``on_answer``), a node
    holding providers is asked at once: the read settles without waiting for the lookup's end (issue
    31: joined through a peer cache, no bootstrap node names providers first)."""
    answers = {"cached": (0.1, []), "near": (0.2, ["a", "b"]), "far": (0.1, ["e"])}

    async def find_closest(key, on_answer):
        await trio.sleep(0.5)
        on_answer("near")  # the lookup reached a node near the key
        await trio.sleep(6.0)  # then waits out departed nodes
        return ["near", "far"]

    async def main():
        found: dict = {}
        start = trio.current_time()
        await lookup_providers(_Kad(answers), b"k", found, find_closest, first=["cached"], settle_s=0.25)
        return sorted(found), trio.current_time() - start

    got, took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == ["a", "b"] and abs(took - 0.95) < 1e-6, (got, took)  # 0.5 + 0.2 + 0.25, not 6.5

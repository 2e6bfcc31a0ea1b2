"""Prefix reuse scoped by a salt (``DecodeOptions.prefix_salt``, issue 45 item 16): a generation reuses
only blocks kept by earlier generations of the same salt, at every stage, a heal's replacement included;
the output bits do not depend on the salt (resumed == fresh).

In-process rings of a synthetic Llama (float64, loopback); each stage's prefix-cache ``hits`` show
whether it reused anything, not only ``cached_tokens`` (the fewest any stage reused).
"""

from __future__ import annotations

import pytest
import trio

from swarm.config import RingSpec
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.ring import RingClient
from swarm.errors import collapse
from swarm.model.resolve import model_manifest_digest
from swarm.transport import load_or_create_key, open_host
from tests.support.ring import LOOPBACK, start_stages

pytestmark = pytest.mark.ring

RANGES = [(0, 1), (1, 3), (3, 4)]
PROMPT = [1, 5, 9, 3, 7, 2, 8, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18]
NEW = 6
BLOCK = 4


def _run(main):
    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def test_a_salt_reuses_only_its_own_blocks_at_every_stage(synthetic, tmp_path):
    model = synthetic("llama")

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                stages = await start_stages(nursery, model, RANGES, tmp_path, "s", prefix_block=BLOCK)
                spec = RingSpec(model=str(model), stages=tuple(s for s, _, _ in stages))
                servers = [srv for _, srv, _ in stages]
                async with open_host(load_or_create_key(tmp_path / "c.key"), [LOOPBACK]) as host, \
                        trio.open_nursery() as inner:
                    ring = RingClient(host, spec, 30.0, 10.0)
                    await ring.connect(4, model_manifest_digest(model), inner)
                    assert ring.prefix_namespace(1, None, "") == ring.prefix_namespace(1, None)
                    assert ring.prefix_namespace(1, None, "a") not in (ring.prefix_namespace(1, None),
                                                                       ring.prefix_namespace(1, None, "b"))
                    got = []
                    for salt in ("a", "b", "", "a", "", "b"):
                        before = [s.prefix_stats()["hits"] for s in servers]
                        decoded = await decode(ring, PROMPT, DecodeOptions(NEW, prefix_cache=True, prefix_salt=salt))
                        hits = [s.prefix_stats()["hits"] - b for s, b in zip(servers, before)]
                        got.append((salt, decoded.output_ids, decoded.cached_tokens, hits))
                    inner.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        return got

    got = _run(main)
    assert len({tuple(out) for _, out, _, _ in got}) == 1  # the same ids, reused or not
    want = (len(PROMPT) - 1) // BLOCK * BLOCK
    # the first generation of each salt reuses nothing at any stage, a later one of the same salt all it can
    assert [(salt, cached) for salt, _, cached, _ in got] == [("a", 0), ("b", 0), ("", 0), ("a", want), ("", want),
                                                              ("b", want)]
    for salt, _, cached, hits in got:
        assert hits == ([want // BLOCK] * 3 if cached else [0, 0, 0]), (salt, hits)


def test_a_heals_replacement_keeps_the_blocks_under_the_sessions_salt(synthetic, tmp_path):
    """A stage dies during a salted generation; the spare that replaces it keeps the session's blocks
    under the same salt: an unsalted generation of the prompt then reuses nothing there, a salted one does."""
    model = synthetic("llama")

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                ring = await start_stages(nursery, model, RANGES, tmp_path, "s", prefix_block=BLOCK)
                ((spare_spec, spare, _),) = await start_stages(nursery, model, [RANGES[1]], tmp_path, "spare",
                                                               prefix_block=BLOCK)
                spec = RingSpec(model=str(model), stages=tuple(s for s, _, _ in ring), spares=(spare_spec,))
                async with open_host(load_or_create_key(tmp_path / "c.key"), [LOOPBACK]) as host, \
                        trio.open_nursery() as inner:
                    client = RingClient(host, spec, 30.0, 10.0, heartbeat_s=1.0)
                    await client.connect(4, model_manifest_digest(model), inner)
                    fired = []

                    def on_ids(out):
                        if len(out) >= 2 and not fired:
                            ring[1][2].cancel()  # the middle stage is gone
                            fired.append(len(out))

                    first = await decode(client, PROMPT, DecodeOptions(NEW, prefix_cache=True, prefix_salt="a"),
                                         on_ids=on_ids)
                    seen = []
                    for salt in ("", "a"):
                        before = spare.prefix_stats()["hits"]
                        decoded = await decode(client, PROMPT, DecodeOptions(NEW, prefix_cache=True, prefix_salt=salt))
                        seen.append((decoded.output_ids, decoded.cached_tokens, spare.prefix_stats()["hits"] - before))
                    inner.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        assert fired
        return first, seen

    first, [(unsalted, cached_u, hits_u), (salted, cached_a, hits_a)] = _run(main)
    assert len(first.heal_events) == 1 and unsalted == salted == first.output_ids
    assert (cached_u, hits_u) == (0, 0)
    # the spare reuses its salted blocks (cached_tokens, the fewest any stage reused, is not checked: the
    # tail kept its blocks under the path it had when the session opened, its namespace names the stages
    # before it, so after the heal it reuses nothing, salt or not)
    assert hits_a == (len(PROMPT) - 1) // BLOCK, (cached_a, hits_a)

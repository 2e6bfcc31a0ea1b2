"""Heals onto a warm spare that shadowed the stage live (in-process stages, real libp2p on loopback).

With shadowing on, the session is also opened at the spare as a shadow; the lost stage's
predecessor (the coordinator, for a head) mirrors every forward frame to it as refill frames, so at
the heal it is promoted with (almost) nothing to refill. The ids equal an uninterrupted run, the
heal event says ``shadow``, and the job receipt verifies (the mirrored frames are in the chain).
A shadow whose mirror was dropped, or that stopped answering, falls back to the refill path.
Real processes: tests/coordinator/test_heal_ring.py.
"""

from __future__ import annotations

import json
import math

import pytest
import trio

from swarm import receipts
from swarm.config import RingSpec, SamplingParams, SpecConfig
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.jobs import write_job_receipt
from swarm.coordinator.ring import RingClient
from swarm.coordinator.drafters import NgramDrafter
from swarm.errors import ReceiptInvalid, StreamClosed, collapse
from swarm.mirror import Mirror
from swarm.model.resolve import model_manifest_digest
from swarm.transport import load_or_create_key, open_host
from tests.coordinator.test_heal_kept import PROMPT, RANGES
from tests.support.ring import start_stages
from tests.support.models import reference_greedy

pytestmark = pytest.mark.ring

NEW = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.support.models import make_synthetic

    return make_synthetic("llama", tmp_path_factory.mktemp("llama-shadow"))


@pytest.fixture(scope="module")
def reference(model):
    return reference_greedy(model, PROMPT, NEW, "float64")


def shadow_run(model_dir, tmp_path, victim: int | None, *, kill_at: int = 8, spec_config=None, shadow=True,
               before_kill=None, spares: int = 1, stop_shadow_at: int | None = None, sampling=None):
    """Generate on 3 stages + ``spares`` spares for the victim's range (shadowing on), stop the
    victim after ``kill_at`` committed tokens (``before_kill(servers, spares)`` first; ``victim``
    None: nobody), and the shadow (the first spare) after ``stop_shadow_at``; return (ids, record,
    job receipt, commit times)."""
    spare_range = RANGES[victim if victim is not None else 1]

    async def main():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                ring = await start_stages(nursery, model_dir, RANGES, tmp_path, "s")
                spare_stages = []
                for k in range(spares):
                    spare_stages += await start_stages(nursery, model_dir, [spare_range], tmp_path, f"spare{k}-")
                spec = RingSpec(model=str(model_dir), stages=tuple(s for s, _, _ in ring),
                                spares=tuple(s for s, _, _ in spare_stages))
                servers = [srv for _, srv, _ in ring]
                fired, times = [], []

                def on_ids(out):
                    times.append(trio.current_time())
                    if stop_shadow_at is not None and len(out) >= stop_shadow_at and "shadow" not in fired:
                        spare_stages[0][2].cancel()
                        fired.append("shadow")
                    if victim is not None and len(out) >= kill_at and "victim" not in fired:
                        if before_kill is not None:
                            before_kill(servers, [srv for _, srv, _ in spare_stages])
                        ring[victim][2].cancel()
                        fired.append("victim")

                key = load_or_create_key(tmp_path / "c.key")
                async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as inner:
                    client = RingClient(host, spec, 30.0, 10.0, heartbeat_s=1.0)
                    digest = model_manifest_digest(model_dir)
                    await client.connect(4, digest, inner)
                    job = {"id": "shadow-job", "nonce": receipts.new_nonce()}
                    options = DecodeOptions(NEW, spec=spec_config, drafter=NgramDrafter() if spec_config else None,
                                            sampling=sampling, job=job, shadow=shadow)
                    decoded = await decode(client, PROMPT, options, on_ids=on_ids)
                    out, rec = decoded.output_ids, decoded.as_record()
                    res = write_job_receipt(tmp_path / "receipts", key, job, rec.pop("receipt_parts"),
                                            model=model_dir.name, model_digest=digest, num_layers=4,
                                            prompt_ids=PROMPT, output_ids=out,
                                            ring=[i.entry() for i in client.infos], record=rec)
                    rec["spare_servers"] = [srv for _, srv, _ in spare_stages]
                    inner.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        return out, rec, json.loads(open(res["path"]).read()), times

    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


@pytest.mark.parametrize("victim", [1, 0, 2], ids=["middle", "head", "tail"])
def test_heal_onto_a_shadow_refills_nothing_and_is_token_identical(model, tmp_path, reference, victim):
    out, rec, job, _ = shadow_run(model, tmp_path, victim)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["stage"] == victim and event["replay"] == "shadow", event
    # the shadow had every committed position already: nothing was refilled, each survivor
    # recomputed one position (the driver check)
    assert event["refill_tokens"] == 0 and event["survivor_tokens"] == 1, event
    assert event["replay_tokens"] >= len(PROMPT) + 7
    v = receipts.verify_job(job)
    assert v.healed == 1
    assert job["stage_receipts"][victim]["peer_id"] == event["spare"]
    # the shadow's receipt covers every position it computed, the mirrored ones included
    assert job["stage_receipts"][victim]["positions"] >= len(PROMPT) + NEW - 1


def test_heal_onto_a_shadow_with_speculation_depth(model, tmp_path, reference):
    out, rec, job, _ = shadow_run(model, tmp_path, 1, spec_config=SpecConfig(draft="ngram", k=4, depth=3))
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "shadow" and event["refill_tokens"] == 0, event
    receipts.verify_job(job)


def test_a_sampled_generation_healed_onto_the_tails_shadow_equals_the_uninterrupted_one(model, tmp_path):
    """Sampling keyed by (seed, position) at the tail: the tail's shadow got the sampling settings at
    its open, so after the heal it draws the same tokens."""
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=11)
    plain, rec, _, _ = shadow_run(model, tmp_path / "plain", None, shadow=False, sampling=sampling)
    assert not rec["heal_events"]
    out, rec, job, _ = shadow_run(model, tmp_path / "healed", 2, sampling=sampling)
    assert out == plain
    (event,) = rec["heal_events"]
    assert event["replay"] == "shadow" and event["refill_tokens"] == 0, event
    receipts.verify_job(job)


def test_without_shadowing_the_heal_refills_everything(model, tmp_path, reference):
    """The same run with shadowing off: the spare is refilled for every committed position."""
    out, rec, job, _ = shadow_run(model, tmp_path, 1, shadow=False)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "survivors_kept" and event["refill_tokens"] == event["replay_tokens"] - 1, event
    receipts.verify_job(job)


def test_a_dropped_mirror_falls_back_to_refilling_the_shadow(model, tmp_path, reference):
    """The predecessor's mirror is dropped (as when the shadow was too slow) just before the
    victim is stopped: the spare is opened afresh and refilled in full, still exact and verified."""

    def drop_mirror(servers, spares):
        (sess,) = servers[0].sessions.values()
        sess.heal.mirror.drop("dropped by the test")

    out, rec, job, _ = shadow_run(model, tmp_path, 1, before_kill=drop_mirror)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "survivors_kept" and event["refill_tokens"] == event["replay_tokens"] - 1, event
    assert "dropped by the test" in event["shadow_fallback"], event
    receipts.verify_job(job)


def test_a_shadow_that_dropped_the_session_is_refilled_as_a_plain_spare(model, tmp_path, reference):
    """The shadow no longer holds the session (as when it fell too far behind) but answers: the heal
    still takes it, by the refill path, and needs no other spare."""

    def forget_at_shadow(servers, spares):
        spares[0].sessions.clear()

    out, rec, job, _ = shadow_run(model, tmp_path, 1, before_kill=forget_at_shadow)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "survivors_kept" and event["refill_tokens"] == event["replay_tokens"] - 1, event
    assert "no longer held the session" in event["shadow_fallback"], event
    assert event["spare"] == rec["spare_servers"][0].host.peer_id
    receipts.verify_job(job)


def test_a_dead_shadow_changes_nothing_and_the_heal_takes_the_next_spare(model, tmp_path, reference):
    """The shadow is stopped after 3 tokens: the ring goes on at its pace, the mirror is dropped;
    the heal after it takes the second spare by the refill path."""
    out, rec, job, times = shadow_run(model, tmp_path, 1, spares=2, stop_shadow_at=3)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "survivors_kept" and event["refill_tokens"] == event["replay_tokens"] - 1, event
    assert "did not answer" in event["shadow_fallback"], event
    receipts.verify_job(job)
    gaps = [b - a for a, b in zip(times[:8], times[1:8])]  # before the victim's heal
    assert max(gaps) < 2.0, gaps


def test_the_receipt_chain_covers_the_mirrored_frames(model, tmp_path):
    """The predecessor's output digest continues its mirror's digest, which the shadow's input
    digest began with: one chain of every frame the shadow got, before and after the heal (and a
    receipt that drops a frame from it fails closed)."""
    _, rec, job, _ = shadow_run(model, tmp_path, 1)
    (event,) = rec["heal_events"]
    assert event["replay"] == "shadow"
    pred, shadow = job["stage_receipts"][0], job["stage_receipts"][1]
    closed = [s for s in pred["segments"] if s["side"] == "output"]
    assert len(closed) == 1 and closed[0]["peer"] == event["replaced"][0]
    # the prefill and the >= 8 decode steps before the heal were mirrored, then the rest was sent
    assert shadow["input"]["frames"] == pred["output"]["frames"] >= NEW
    assert shadow["input"]["frames"] > NEW - 8 + 1
    bad = json.loads(json.dumps(job))
    bad["stage_receipts"][0]["output"]["frames"] -= 1
    with pytest.raises(ReceiptInvalid):
        receipts.verify_job(bad)


class _StuckStream:
    """A stream whose sends never finish (a frozen shadow whose windows are full)."""

    closed = False

    async def send(self, msg, timeout_s=None):
        await trio.sleep(math.inf)

    async def recv(self, timeout_s=None):
        await trio.sleep(math.inf)

    async def aclose(self):
        pass


def test_a_mirror_whose_shadow_is_stuck_drops_itself_without_blocking():
    """Posting never blocks: past the bounded queue the mirror is dropped, and promote says so."""

    async def main():
        mirror = Mirror("s", "/ip4/127.0.0.1/tcp/1/p2p/x", 4, queue_frames=4)
        async with trio.open_nursery() as nursery:
            async def dial(_addr):
                return _StuckStream()

            nursery.start_soon(mirror.run, dial, lambda: True)
            await trio.sleep(0.05)
            t0 = trio.current_time()
            for pos in range(10):
                mirror.post(0, pos, tokens=[1])
            assert trio.current_time() - t0 < 0.01
            assert mirror.broken and "frames waiting" in mirror.broken
            assert not await mirror.promote()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_mirror_writes_in_order_and_promotes_when_flushed():
    async def main():
        sent = []

        class _Stream:
            closed = False

            async def send(self, msg, timeout_s=None):
                sent.append((msg.pos, len(msg.tokens)))

            async def recv(self, timeout_s=None):
                await trio.sleep(math.inf)

            async def aclose(self):
                raise StreamClosed("closed")

        mirror = Mirror("s", "/ip4/127.0.0.1/tcp/1/p2p/x", 4)
        async with trio.open_nursery() as nursery:
            async def dial(_addr):
                return _Stream()

            nursery.start_soon(mirror.run, dial, lambda: True)
            for pos, n in ((0, 5), (5, 1), (4, 3)):  # the last rolls back to 4
                mirror.post(1, pos, tokens=[7] * n)
            assert await mirror.promote()
            assert sent == [(0, 5), (5, 1), (4, 3)] and mirror.end == 7 and mirror.digest.frames == 3
            nursery.cancel_scope.cancel()

    trio.run(main)

"""Mid-generation healing with real stage processes and libp2p on loopback.

A stage is SIGKILLed (or SIGSTOPped) after some tokens are committed; the coordinator swaps in the
warm spare listed for that layer range, replays, and the final ids equal the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import trio

from swarm import receipts
from swarm.config import RingSpec, SpecConfig, StageSpec
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.jobs import write_job_receipt
from swarm.coordinator.drafters import NgramDrafter
from swarm.errors import StageLost, collapse
from swarm.heal import NoSpare
from swarm.cli.launch import LocalRing
from swarm.model.resolve import model_manifest_digest
from swarm.ranges import LayerRange
from swarm.coordinator.ring import RingClient
from swarm.transport import load_or_create_key, open_host
from tests.support.models import reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.ring, pytest.mark.process]
# `serial` below: tests that hold a stage to a clock (a 3 s pause that must not count as lost, commit
# gaps under 2 s, survivors closing sessions within 10 s) run alone in `make test`

RANGES = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
PROMPT = [1, 403, 407, 261, 378]
NEW = 40


class StagePool:
    """Stage processes kept across this module's tests, since starting one costs ~10 s of CPU
    (importing torch and transformers). A test takes a ring and its spares from the idle live
    stages (the pool starts only what is missing, side by side); afterwards the victim is
    retired (killed and reaped) and the rest go back idle: a spare that healed in serves as a
    plain stage later. A test that failed retires every stage it used. Every process is reaped
    when the module ends (``LocalRing.stop``)."""

    def __init__(self, model_dir, key_root):
        self.model_dir, self.key_root = model_dir, key_root
        self.rings: list[LocalRing] = []  # every LocalRing started, stopped at the end
        self.idle: list = []  # live StageProcesses no test holds

    def take(self, ranges: list[LayerRange]) -> list:
        """A distinct live stage for each of ``ranges``, in order."""
        self.idle = [sp for sp in self.idle if sp.proc.poll() is None]
        taken = []
        for r in ranges:
            sp = next((sp for sp in self.idle if sp.layers == r), None)
            if sp is not None:
                self.idle.remove(sp)
            taken.append(sp)
        missing = [r for r, sp in zip(ranges, taken) if sp is None]
        started = []
        while missing:  # a LocalRing names its key files by range: one of each range per ring
            batch = list(dict.fromkeys(missing))
            for r in batch:
                missing.remove(r)
            ring = LocalRing(str(self.model_dir), batch, self.key_root / f"ring-{len(self.rings)}", threads=1,
                             extra_args=["--dtype", "float32"])
            self.rings.append(ring)
            ring.start()  # from this thread: a stage gets SIGTERM when the thread that started it ends
            started += ring.stages
        for i, r in enumerate(ranges):
            if taken[i] is None:
                taken[i] = next(sp for sp in started if sp.layers == r)
                started.remove(taken[i])
        return taken

    def give_back(self, stages) -> None:
        self.idle += [sp for sp in stages if sp.proc.poll() is None]

    @staticmethod
    def retire(stages) -> None:
        for sp in stages:
            if sp.proc.poll() is None:
                os.killpg(sp.proc.pid, signal.SIGKILL)
            sp.proc.wait()

    def close(self) -> None:
        for ring in self.rings:
            ring.stop()


@pytest.fixture(scope="module")
def pool(stories_dir, tmp_path_factory):
    stages = StagePool(stories_dir, tmp_path_factory.mktemp("stage-keys"))
    try:
        yield stages
    finally:
        stages.close()


def heal_run(pool: StagePool, tmp_path, victim: int, sig: int, spare: bool = True, spec_config=None,
             kill_at: int = 10, resume_after_s: float | None = None, spare_every_range: bool = False,
             shadow: bool = False):
    """Run a generation on 3 stages (+1 spare for the victim's range, or for every range), signal
    the victim after ``kill_at`` committed tokens (and SIGCONT it ``resume_after_s`` later); return
    (ids, record, ids of a second request). The generation runs as a job: ``record["job_receipt"]``
    is the signed job receipt. The victim is retired afterwards."""
    spare_ranges = RANGES if spare_every_range else [RANGES[victim]] if spare else []
    stages = pool.take(RANGES + spare_ranges)
    healthy = False
    try:
        result = _heal_run(pool.model_dir, tmp_path, stages[:len(RANGES)], stages[len(RANGES):], victim, sig,
                           spec_config, kill_at, resume_after_s, shadow=shadow)
        healthy = True
        return result
    except NoSpare:
        healthy = True  # the expected failure: the survivors were checked to still answer
        raise
    finally:
        pool.retire([stages[victim]] if healthy else stages)
        if healthy:
            pool.give_back(stages[:victim] + stages[victim + 1:])


def _heal_run(model_dir, tmp_path, ring_stages, spare_stages, victim, sig, spec_config, kill_at, resume_after_s,
              shadow=False, shadow_sig_at=None, commit_times=None):
    """One healing generation (see ``heal_run``); with ``shadow`` the spares shadow their stages,
    and with ``shadow_sig_at`` = (signal, tokens) the first spare gets that signal after so many
    committed tokens (a frozen one is resumed at the end); ``commit_times`` collects when each
    commit arrived (time.monotonic)."""
    import threading
    import time

    spec = RingSpec(model=str(model_dir),
                    stages=tuple(StageSpec(s.addr, s.layers) for s in ring_stages),
                    spares=tuple(StageSpec(s.addr, s.layers) for s in spare_stages))
    pid = ring_stages[victim].proc.pid
    fired, timers, fired_shadow = [], [], []

    def on_ids(out):
        if commit_times is not None:
            commit_times.append(time.monotonic())
        if shadow_sig_at is not None and len(out) >= shadow_sig_at[1] and not fired_shadow:
            os.kill(spare_stages[0].proc.pid, shadow_sig_at[0])
            fired_shadow.append(len(out))
        if len(out) >= kill_at and not fired:
            os.kill(pid, sig)
            fired.append(len(out))
            if resume_after_s is not None:
                timers.append(threading.Timer(resume_after_s, os.kill, (pid, signal.SIGCONT)))
                timers[-1].start()

    async def main():
        with trio.fail_after(90):
            async with open_host(load_or_create_key(tmp_path / "c.key"), ["/ip4/127.0.0.1/tcp/0"]) as host, \
                    trio.open_nursery() as nursery:
                client = RingClient(host, spec, hop_timeout_s=30.0, connect_timeout_s=10.0, heartbeat_s=1.0)
                digest = model_manifest_digest(model_dir)
                await client.connect(5, digest, nursery)
                drafter = NgramDrafter() if spec_config else None
                job = {"id": "heal-job", "nonce": receipts.new_nonce()}
                decoded = await decode(client, PROMPT, DecodeOptions(NEW, spec=spec_config, drafter=drafter, job=job,
                                                                     shadow=shadow), on_ids=on_ids)
                out, rec = decoded.output_ids, decoded.as_record()
                ring = [i.entry() for i in client.infos]
                res = write_job_receipt(tmp_path / "receipts", load_or_create_key(tmp_path / "c.key"), job,
                                        rec.pop("receipt_parts"), model="stories260k", model_digest=digest,
                                        num_layers=5, prompt_ids=PROMPT, output_ids=out, ring=ring, record=rec)
                rec["job_receipt"] = json.loads(open(res["path"]).read())
                # the healed ring keeps serving: a second request on the same client
                again = (await decode(client, PROMPT, DecodeOptions(8))).output_ids
                nursery.cancel_scope.cancel()
        return out, rec, again

    try:
        try:
            out, rec, again = trio.run(main)
        except BaseExceptionGroup as group:
            raise collapse(group) from None
    except NoSpare:
        # nothing hangs, and the surviving stages are still up and answering
        survivors = [sp for i, sp in enumerate(ring_stages) if i != victim]
        assert all(sp.proc.poll() is None for sp in survivors)
        assert _answers_info(survivors[0].addr, tmp_path)
        raise
    finally:
        for timer in timers:  # the victim is killed next: no SIGCONT may come after that
            timer.cancel()
            timer.join()
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
        if fired_shadow and shadow_sig_at[0] == signal.SIGSTOP:
            os.kill(spare_stages[0].proc.pid, signal.SIGCONT)
    assert fired, "the victim was never signalled"
    return out, rec, again


def _answers_info(addr: str, tmp_path) -> bool:
    from swarm import wire
    from swarm.wire import PROTOCOL_ID

    async def ask():
        with trio.fail_after(20):
            async with open_host(load_or_create_key(tmp_path / "probe.key"), ["/ip4/127.0.0.1/tcp/0"]) as host:
                s = await host.open_stream(addr, PROTOCOL_ID, timeout_s=10)
                await s.send(wire.frame("info"))
                return (await s.recv(timeout_s=10))["type"] == "info_ok"

    return trio.run(ask)


@pytest.fixture(scope="module")
def reference(stories_dir):
    return reference_greedy(stories_dir, PROMPT, NEW, "float32")


@pytest.mark.parametrize("victim", [1, 0, 2], ids=["middle", "head", "tail"])
def test_sigkill_heals_token_identical(pool, tmp_path, reference, victim):
    out, rec, again = heal_run(pool, tmp_path, victim, signal.SIGKILL)
    assert out == reference
    assert again == reference[:8]
    (event,) = rec["heal_events"]
    assert event["stage"] == victim and tuple(event["layers"]) == (RANGES[victim].start, RANGES[victim].end)
    assert event["replay_tokens"] >= len(PROMPT) + 9 and event["total_s"] < 15
    # the survivors kept their KV caches: only the spare rebuilt the committed positions, each
    # survivor recomputed one (the last replayed position, whose result checks the driver token)
    assert event["replay"] == "survivors_kept" and event["survivor_tokens"] == 1, event
    assert event["refill_tokens"] == event["replay_tokens"] - 1
    # the job receipt holds the spare's receipt for the victim's slot, and verifies across the heal
    job = rec["job_receipt"]
    receipts.verify_job(job)
    assert job["stage_receipts"][victim]["peer_id"] == event["spare"] == job["ring"][victim]["peer_id"]
    assert all(r["positions"] >= len(PROMPT) + NEW - 1 for r in job["stage_receipts"])
    survivors = [r for i, r in enumerate(job["stage_receipts"]) if i != victim]
    assert all(r["positions"] < len(PROMPT) + NEW + 4 for r in survivors), [r["positions"] for r in survivors]


def test_sigkill_heals_with_speculation_depth(pool, tmp_path, reference):
    out, rec, _ = heal_run(pool, tmp_path, 1, signal.SIGKILL, spec_config=SpecConfig(draft="ngram", k=4, depth=3))
    assert out == reference and len(rec["heal_events"]) == 1
    assert rec["heal_events"][0]["replay"] == "survivors_kept"
    receipts.verify_job(rec["job_receipt"])


def test_a_predecessor_that_kept_no_states_falls_back_to_full_replay(pool, tmp_path, reference):
    """The victim's predecessor runs with --heal-log-mb 0 (it keeps none of what it sent): the heal
    says why it cannot keep the survivors and replays through every stage, still exact."""
    victim = 1
    with LocalRing(str(pool.model_dir), [RANGES[0]], tmp_path / "pred-keys", threads=1,
                   extra_args=["--dtype", "float32", "--heal-log-mb", "0"]) as pred:
        stages = pool.take(RANGES[1:] + [RANGES[victim]])
        healthy = False
        try:
            out, rec, again = _heal_run(pool.model_dir, tmp_path, [pred.stages[0]] + stages[:2], stages[2:], victim,
                                        signal.SIGKILL, None, 10, None)
            healthy = True
        finally:
            pool.retire([stages[0]] if healthy else stages)
            if healthy:
                pool.give_back(stages[1:])
    assert out == reference and again == reference[:8]
    (event,) = rec["heal_events"]
    assert event["replay"] == "full" and event["survivor_tokens"] == event["replay_tokens"], event
    assert "holds the hidden states it sent for 0 positions" in event["fallback"], event["fallback"]
    receipts.verify_job(rec["job_receipt"])


def test_sigstop_frozen_stage_heals(pool, tmp_path, reference):
    out, rec, _ = heal_run(pool, tmp_path, 1, signal.SIGSTOP)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["stage"] == 1 and "heartbeat" in event["errors"][0]


@pytest.mark.serial
@pytest.mark.parametrize("pause_s", [3.0])  # the reported case; tests/test_heal.py tables the sequences
def test_a_short_pause_never_swaps_out_a_healthy_stage(pool, tmp_path, reference, pause_s):
    """SIGSTOP the head for a few seconds, then SIGCONT it, with a spare for every range: either the
    paused head is replaced (it was still silent when re-checked) or nothing is; a healthy stage
    never is, and the answer is the uninterrupted one."""
    out, rec, again = heal_run(pool, tmp_path, 0, signal.SIGSTOP, kill_at=5, resume_after_s=pause_s,
                               spare_every_range=True)
    assert out == reference and again == reference[:8]
    assert all(e["stage"] == 0 for e in rec["heal_events"]), rec["heal_events"]


def test_no_spare_fails_clearly(pool, tmp_path):
    with pytest.raises(NoSpare, match=r"stage 1 holding layers \[2, 4\) is lost"):
        heal_run(pool, tmp_path, 1, signal.SIGKILL, spare=False)


@pytest.mark.parametrize("victim", [1, 0, 2], ids=["middle", "head", "tail"])
def test_sigkill_heals_onto_a_shadow_without_refilling(pool, tmp_path, reference, victim):
    """With shadowing on, the spare follows the victim's session live (its predecessor mirrors every
    frame to it, the coordinator the token ids for a head): the heal promotes it with nothing to
    refill, the ids equal the uninterrupted run and the job receipt verifies."""
    out, rec, again = heal_run(pool, tmp_path, victim, signal.SIGKILL, shadow=True)
    assert out == reference and again == reference[:8]
    (event,) = rec["heal_events"]
    assert event["stage"] == victim and event["replay"] == "shadow", event
    assert event["refill_tokens"] == 0 and event["survivor_tokens"] == 1, event
    job = rec["job_receipt"]
    receipts.verify_job(job)
    assert job["stage_receipts"][victim]["peer_id"] == event["spare"]


def test_sigkill_heals_onto_a_shadow_with_speculation_depth(pool, tmp_path, reference):
    out, rec, _ = heal_run(pool, tmp_path, 1, signal.SIGKILL, spec_config=SpecConfig(draft="ngram", k=4, depth=3),
                           shadow=True)
    assert out == reference
    (event,) = rec["heal_events"]
    assert event["replay"] == "shadow" and event["refill_tokens"] == 0, event
    receipts.verify_job(rec["job_receipt"])


@pytest.mark.serial
@pytest.mark.parametrize("shadow_sig", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_a_lost_shadow_changes_nothing_and_the_heal_falls_back_to_refill(pool, tmp_path, reference, shadow_sig):
    """The shadow is frozen (or killed) after 3 tokens, before the middle stage is killed: the ring
    keeps its pace (no commit waits on the shadow), and the heal finds the shadow not answering and
    refills the second spare instead; the ids equal the uninterrupted run, the receipt verifies."""
    victim = 1
    stages = pool.take(RANGES + [RANGES[victim], RANGES[victim]])
    times: list[float] = []
    healthy = False
    try:
        out, rec, again = _heal_run(pool.model_dir, tmp_path, stages[:3], stages[3:], victim, signal.SIGKILL, None,
                                    10, None, shadow=True, shadow_sig_at=(shadow_sig, 3), commit_times=times)
        healthy = True
    finally:
        pool.retire([stages[victim], stages[3]] if healthy else stages)
        if healthy:
            pool.give_back([sp for i, sp in enumerate(stages) if i not in (victim, 3)])
    assert out == reference and again == reference[:8]
    (event,) = rec["heal_events"]
    assert event["replay"] == "survivors_kept" and event["refill_tokens"] == event["replay_tokens"] - 1, event
    assert "did not answer" in event["shadow_fallback"], event
    assert event["spare"] == stages[4].ready["peer_id"]
    receipts.verify_job(rec["job_receipt"])
    # from the shadow's loss to the victim's: every token as quick as before it (a mirror that
    # waited on the shadow would stall the ring for the mirror's 5 s send deadline, or the hop timeout)
    gaps = [b - a for a, b in zip(times[:9], times[1:9])]
    assert max(gaps) < 2.0, gaps


# ---- a stage lost between two requests: the next request's session open meets it ------------------

FOLLOW = [263, 292, 271]  # a next turn: the second request's prompt is PROMPT + the first answer + these
FOLLOW_NEW = 24


@pytest.fixture(scope="module")
def follow_reference(stories_dir, reference):
    return reference_greedy(stories_dir, PROMPT + reference + FOLLOW, FOLLOW_NEW, "float32")


def open_heal_run(pool: StagePool, tmp_path, spare: bool = True, spec_config=None, shadow: bool = False,
                  prefix_cache: bool = False, victim: int = 1, sig: int = signal.SIGKILL) -> dict:
    """Serve a first request on a connected ring of 3 stages (+1 spare for the victim's range), then
    SIGKILL the victim and reap it (or SIGSTOP it: frozen), then run the next turn (a job) on the
    same client: its session open meets the lost stage; a third request checks the healed client. Without a spare, the next
    turn runs with ``heal=False`` (StageLost), healing (NoSpare, raised) and with ``heal=False`` again,
    and the survivors must hold no session after.
    Returns {first, out, rec (with ``job_receipt``), again, tail_prefix (the tail's prefix counters
    before and after the next turn)}. The victim is retired afterwards."""
    stages = pool.take(RANGES + ([RANGES[victim]] if spare else []))
    healthy = False
    try:
        result = _open_heal_run(pool.model_dir, tmp_path, stages[:len(RANGES)], stages[len(RANGES):], victim,
                                spec_config, shadow, prefix_cache, sig)
        healthy = True
        return result
    except NoSpare:
        healthy = True  # the expected failure: the survivors were checked to hold no session
        raise
    finally:
        pool.retire([stages[victim]] if healthy else stages)
        if healthy:
            pool.give_back(stages[:victim] + stages[victim + 1:])


def _open_heal_run(model_dir, tmp_path, ring_stages, spare_stages, victim, spec_config, shadow, prefix_cache,
                   sig=signal.SIGKILL):
    spec = RingSpec(model=str(model_dir),
                    stages=tuple(StageSpec(s.addr, s.layers) for s in ring_stages),
                    spares=tuple(StageSpec(s.addr, s.layers) for s in spare_stages))
    key = load_or_create_key(tmp_path / "c.key")
    got: dict = {}

    async def main():
        with trio.fail_after(90):
            async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
                client = RingClient(host, spec, hop_timeout_s=30.0, connect_timeout_s=10.0, heartbeat_s=1.0)
                digest = model_manifest_digest(model_dir)
                await client.connect(5, digest, nursery)
                got["first"] = (await decode(client, PROMPT, DecodeOptions(NEW, prefix_cache=prefix_cache))).output_ids
                prompt = PROMPT + got["first"] + FOLLOW
                before = (await client.stage_info(len(RANGES) - 1)).prefix_cache
                proc = ring_stages[victim].proc
                os.kill(proc.pid, sig)
                if sig == signal.SIGKILL:
                    await trio.to_thread.run_sync(proc.wait)
                drafter = NgramDrafter() if spec_config else None
                job = {"id": "open-heal-job", "nonce": receipts.new_nonce()}

                async def next_turn(heal=True):
                    return await decode(client, prompt, DecodeOptions(FOLLOW_NEW, spec=spec_config, drafter=drafter,
                                                                      heal=heal, job=job, shadow=shadow,
                                                                      prefix_cache=prefix_cache))

                if not spare_stages:
                    # every request fails clearly, the last one after the lost stage's end-of-stream frames
                    # were read (it meets the closed stream itself), and the sessions opened at the survivors
                    # before the lost stage was met are closed there
                    with pytest.raises(StageLost, match=rf"stage {victim} "):
                        await next_turn(heal=False)
                    with pytest.raises(NoSpare) as no_spare:
                        await next_turn()
                    with pytest.raises(StageLost, match=rf"stage {victim} "):
                        await next_turn(heal=False)
                    with trio.fail_after(10):
                        for i in range(len(RANGES)):
                            while i != victim and (await client.stage_info(i)).sessions:
                                await trio.sleep(0.05)
                    raise no_spare.value
                decoded = await next_turn()
                out, rec = decoded.output_ids, decoded.as_record()
                got["tail_prefix"] = (before, (await client.stage_info(len(RANGES) - 1)).prefix_cache)
                res = write_job_receipt(tmp_path / "receipts", key, job, rec.pop("receipt_parts"), model="stories260k",
                                        model_digest=digest, num_layers=5, prompt_ids=prompt, output_ids=out,
                                        ring=[i.entry() for i in client.infos], record=rec)
                rec["job_receipt"] = json.loads(open(res["path"]).read())
                got["out"], got["rec"] = out, rec
                got["again"] = (await decode(client, prompt, DecodeOptions(8, prefix_cache=prefix_cache))).output_ids
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    return got


@pytest.mark.parametrize("mode", ["speculative", "shadow"])
def test_a_stage_lost_between_requests_heals_at_the_next_open(pool, tmp_path, reference, follow_reference, mode):
    """The middle stage dies between two requests of one client: the next request's session open
    finds it gone, heals onto the spare (nothing committed: the prefill runs from the start on a
    fresh session) and answers exactly; the healed client serves another request. (Greedy decoding
    takes the same path after the heal; the frozen-stage and prefix tests below run it.)"""
    spec_config = SpecConfig(draft="ngram", k=4, depth=2) if mode == "speculative" else None
    got = open_heal_run(pool, tmp_path, spec_config=spec_config, shadow=mode == "shadow")
    assert got["first"] == reference
    assert got["out"] == follow_reference and got["again"] == follow_reference[:8]
    rec = got["rec"]
    (event,) = rec["heal_events"]
    assert event["stage"] == 1 and tuple(event["layers"]) == (RANGES[1].start, RANGES[1].end), event
    assert event["replay"] == "full" and "nothing committed" in event["fallback"], event
    assert event["detect_s"] >= 0 and event["swap_s"] > 0 and event["total_s"] < 15, event
    assert rec["cached_tokens"] == 0 and 0 < rec["ttft_s"] < rec["total_s"]
    job = rec["job_receipt"]
    receipts.verify_job(job)
    assert job["stage_receipts"][1]["peer_id"] == event["spare"] == job["ring"][1]["peer_id"]


def test_a_stage_frozen_between_requests_heals_at_the_next_open_in_seconds(pool, tmp_path, follow_reference):
    """The middle stage is frozen (SIGSTOP) between two requests: its connection stays up, so the
    open is sent but never answered; the probes during the wait find it silent, and the open heals
    onto the spare in seconds instead of failing with a HopTimeout after hop_timeout_s (30 s)."""
    got = open_heal_run(pool, tmp_path, sig=signal.SIGSTOP)
    assert got["out"] == follow_reference and got["again"] == follow_reference[:8]
    (event,) = got["rec"]["heal_events"]
    assert event["stage"] == 1 and event["replay"] == "full", event
    assert event["total_s"] + event["detect_s"] < 15 and got["rec"]["total_s"] < 20, (event, got["rec"]["total_s"])


def test_a_stage_lost_between_requests_heals_at_an_open_that_offered_a_prefix(pool, tmp_path, follow_reference):
    """With prefix reuse the next turn's open offers the prompt, and a stage opened before the lost
    one was met may already hold cached positions: the heal reopens without them (a replacement holds
    no prefix), the prefill runs from position 0, and the ids are exact."""
    got = open_heal_run(pool, tmp_path, prefix_cache=True)
    assert got["out"] == follow_reference and got["again"] == follow_reference[:8]
    before, after = got["tail_prefix"]
    assert after["lookups"] == before["lookups"] + 1  # the open carried the prompt to the tail
    rec = got["rec"]
    assert len(rec["heal_events"]) == 1 and rec["heal_events"][0]["stage"] == 1
    assert rec["cached_tokens"] == 0
    receipts.verify_job(rec["job_receipt"])


@pytest.mark.serial
def test_a_stage_lost_between_requests_without_a_spare_fails_clearly(pool, tmp_path):
    with pytest.raises(NoSpare, match=r"stage 1 holding layers \[2, 4\) is lost .*no warm spare"):
        open_heal_run(pool, tmp_path, spare=False)

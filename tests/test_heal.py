"""heal.py: table-driven decisions and heal paths over a scripted SwarmOps (no network)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from swarm.errors import StageLost
from swarm.heal import (Failure, HealError, NoSpare, Probe, ReplayMismatch, StageReport, locate_failure,
                        plan_replay, run_heal)

R = StageReport


@pytest.mark.parametrize("reports,sent,returned,expected", [
    # healthy: every chunk went round
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, True, 5, 5)], 5, 5, None),
    # middle death: unreachable
    ([R(0, True, 5, 5), R(1, False), R(2, True, 4, 4)], 5, 4, Failure(1, "unreachable")),
    # head and tail death
    ([R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], 5, 4, Failure(0, "unreachable")),
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, False)], 5, 4, Failure(2, "unreachable")),
    # the first unreachable wins
    ([R(0, True, 5, 5), R(1, False), R(2, False)], 5, 4, Failure(1, "unreachable")),
    # a gap: stage 1 forwarded chunk 5, stage 2 never received it (it stopped reading)
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, True, 4, 4)], 5, 4,
     Failure(2, "silent: it never got chunk 5 sent to it (the last was 4)")),
    # the coordinator sent chunk 6, the head got only 5
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, True, 5, 5)], 6, 5,
     Failure(0, "silent: it never got chunk 6 sent to it (the last was 5)")),
    # the tail sent result 5, the coordinator never got it
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, True, 5, 5)], 5, 4,
     Failure(2, "silent: it sent result 5, the coordinator got only 4")),
    # stage 0 lost its stream to stage 1 while sending chunk 6: no counter shows a gap (chunk 6 was
    # received and never sent, as a stale one is), its report names the cut-off successor
    ([R(0, True, 6, 5, lost_successor=True), R(1, True, 5, 5), R(2, True, 5, 5)], 6, 5,
     Failure(1, "cut off: stage 0 lost its stream to it (the last chunk sent on was 5; it got chunk 6)")),
    # a gap before the stage that lost its successor is blamed first (ring order)
    ([R(0, True, 5, 5), R(1, True, 5, 5, lost_successor=True), R(2, True, 5, 5)], 6, 5,
     Failure(0, "silent: it never got chunk 6 sent to it (the last was 5)")),
    # the tail has no successor to lose: the flag means nothing there
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, True, 5, 5, lost_successor=True)], 5, 5, None),
    # stale chunks dropped at stage 0 are not a gap downstream
    ([R(0, True, 7, 5), R(1, True, 5, 5), R(2, True, 5, 5)], 7, 5, None),
    # a stage stuck on chunk 6, which stage 0 forwarded to it
    ([R(0, True, 6, 6), R(1, True, 6, 5, busy=True), R(2, True, 5, 5)], 6, 5, Failure(1, "stalled on chunk 6")),
])
def test_locate_failure(reports, sent, returned, expected):
    assert locate_failure(reports, sent, returned) == expected


def test_a_stage_draining_without_the_session_is_blamed_after_the_unreachable_ones():
    """A stage that began to drain after the route was chosen refuses the open but answers every
    probe: without blame the heal found nothing to replace and the request failed (bench/chaos.py)."""
    refusing = [R(0, True), R(1, True, refusing=True), R(2, True)]
    assert locate_failure(refusing, -1, -1) == Failure(1, "draining: it refuses the session")
    earlier = P(refusing, -1, -1)
    assert locate_failure(refusing, -1, -1, earlier) == Failure(1, "draining: it refuses the session")
    assert locate_failure([R(0, True), R(1, True, refusing=True), R(2, False)], -1, -1) == Failure(2, "unreachable")
    # draining while holding the session is no fault: its running sessions may finish
    assert locate_failure([R(0, True, 3, 3), R(1, True, 3, 3), R(2, True, 3, 3)], 3, 3) is None


def P(reports, sent, returned):
    return Probe(tuple(reports), sent, returned)


# What a pause of one stage (SIGSTOP, then SIGCONT) looks like to two probes a heartbeat apart.
@pytest.mark.parametrize("earlier,later,expected", [
    # stage 0 paused through both probes: it is the one blamed
    (P([R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], 6, 4),
     P([R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], 6, 4), Failure(0, "unreachable")),
    # stage 0 resumed between the probes and forwarded its backlog: chunks 5 and 6 are in flight to
    # stage 1, which has not read them yet. Nobody is blamed (stage 1 used to be swapped out here)
    (P([R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], 6, 4),
     P([R(0, True, 6, 6), R(1, True, 4, 4), R(2, True, 4, 4)], 6, 4), None),
    # stage 0 resumed, stage 1 is computing chunk 5 (busy, but it moved since the earlier probe)
    (P([R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], 6, 4),
     P([R(0, True, 6, 6), R(1, True, 5, 4, busy=True), R(2, True, 4, 4)], 6, 4), None),
    # stage 0 answered both probes, one frame from it to stage 1 in flight at the later one only
    (P([R(0, True, 5, 5), R(1, True, 5, 5), R(2, True, 5, 5)], 6, 5),
     P([R(0, True, 6, 6), R(1, True, 5, 5), R(2, True, 5, 5)], 6, 5), None),
    # a result in flight from the tail at the later probe
    (P([R(0, True, 6, 6), R(1, True, 6, 6), R(2, True, 6, 5, busy=True)], 6, 5),
     P([R(0, True, 6, 6), R(1, True, 6, 6), R(2, True, 6, 6)], 6, 5), None),
    # stage 1 really stopped reading: chunk 6 was sent to it before the earlier probe, still not received
    (P([R(0, True, 6, 6), R(1, True, 5, 5), R(2, True, 5, 5)], 6, 5),
     P([R(0, True, 6, 6), R(1, True, 5, 5), R(2, True, 5, 5)], 6, 5),
     Failure(1, "silent: it never got chunk 6 sent to it (the last was 5)")),
    # stage 1 stuck on the same chunk in both probes
    (P([R(0, True, 6, 6), R(1, True, 6, 5, busy=True), R(2, True, 5, 5)], 6, 5),
     P([R(0, True, 6, 6), R(1, True, 6, 5, busy=True), R(2, True, 5, 5)], 6, 5), Failure(1, "stalled on chunk 6")),
    # a stage that answered the earlier probe and not the later one is blamed
    (P([R(0, True, 6, 6), R(1, True, 6, 6), R(2, True, 6, 6)], 6, 6),
     P([R(0, True, 6, 6), R(1, False), R(2, True, 6, 6)], 6, 6), Failure(1, "unreachable")),
])
def test_a_pause_blames_the_stage_that_stopped_answering_or_nobody(earlier, later, expected):
    assert locate_failure(later.reports, later.sent, later.returned, earlier) == expected


@pytest.mark.parametrize("prompt,committed,prefix,driver", [
    ([1, 2, 3], [7, 8, 9], (1, 2, 3, 7, 8), 9),
    ([1, 2, 3], [7], (1, 2, 3), 7),
    ([1, 2, 3], [], (1, 2, 3), None),
])
def test_plan_replay(prompt, committed, prefix, driver):
    r = plan_replay(prompt, committed)
    assert r.prefix == prefix and r.driver == driver


class FakeOps:
    """A scripted ring of 3 stages, with spares by range and faults on demand."""

    def __init__(self, reports, spares=None, replay_token=9, fail_swaps=0, fail_replays=0):
        self.reports = reports
        self.spares = dict(spares or {})
        self.replay_token = replay_token
        self.fail_swaps, self.fail_replays = fail_swaps, fail_replays
        self.clock = 100.0
        self.log: list = []

    def now(self):
        self.clock += 0.25
        return self.clock

    def range_of(self, index):
        return [(0, 10), (10, 20), (20, 30)][index]

    async def probe(self):
        self.log.append("probe")
        if not isinstance(self.reports[0], list):
            return self.reports, 5, 4
        return (self.reports.pop(0) if len(self.reports) > 1 else self.reports[0]), 5, 4  # the last one stays

    async def settle(self):
        self.log.append("settle")

    async def pick_spare(self, layers):
        self.log.append(("pick", layers))
        return self.spares.pop(layers, None)

    async def swap(self, index, spare):
        self.log.append(("swap", index, spare))
        if self.fail_swaps:
            self.fail_swaps -= 1
            raise StageLost("the spare died too")

    async def reset(self):
        self.log.append("reset")

    async def replay(self, prefix):
        self.log.append(("replay", len(prefix)))
        if self.fail_replays:
            self.fail_replays -= 1
            raise StageLost("lost during replay")
        return self.replay_token


DEAD_MIDDLE = [R(0, True, 5, 5), R(1, False), R(2, True, 4, 4)]
REPLAY = plan_replay([1, 2, 3], [7, 8, 9])


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("reports,stage,layers", [
    (DEAD_MIDDLE, 1, (10, 20)),
    ([R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], 0, (0, 10)),
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, False)], 2, (20, 30)),
    ([R(0, True, 5, 5), R(1, True, 5, 5), R(2, True, 4, 4)], 2, (20, 30)),  # frozen tail: a gap
])
def test_heal_steps_in_order(reports, stage, layers):
    ops = FakeOps(reports, spares={layers: "spare-A"})
    event = run(run_heal(ops, REPLAY, detected_at=100.0, cause="hop timeout"))
    assert ops.log == ["probe", "settle", "probe", ("pick", layers), ("swap", stage, "spare-A"), "reset", ("replay", 5)]
    assert event.stage == stage and event.layers == layers and event.spare == "spare-A"
    assert event.replay_tokens == 5 and event.total_s > 0 and event.attempts == 1


def test_no_spare_names_the_range():
    with pytest.raises(NoSpare, match=r"layers \[10, 20\) is lost \(unreachable\) and no warm spare holds"):
        run(run_heal(FakeOps(DEAD_MIDDLE, spares={(0, 10): "x"}), REPLAY, 100.0, "timeout"))
    routed = FakeOps(DEAD_MIDDLE)  # a ring routed over the DHT says where else it looked
    routed.no_spare = "no warm spare or stage announcing on the swarm can take over that range now"
    with pytest.raises(NoSpare, match=r"is lost \(unreachable\) and no warm spare or stage announcing on the swarm"):
        run(run_heal(routed, REPLAY, 100.0, "timeout"))


def test_replay_mismatch_aborts_loudly():
    ops = FakeOps(DEAD_MIDDLE, spares={(10, 20): "s"}, replay_token=4)
    with pytest.raises(ReplayMismatch, match="gave token 4, but 9 was already committed"):
        run(run_heal(ops, REPLAY, 100.0, "timeout"))


def test_nothing_to_blame_replaces_nothing():
    """The ring stopped answering for a moment (a paused stage) and answers again: no swap, no
    replay, the session goes on (run_heal returns None)."""
    paused = [R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)]
    resumed = [R(0, True, 5, 5), R(1, True, 4, 4), R(2, True, 4, 4)]
    ops = FakeOps([paused, resumed], spares={(0, 10): "s", (10, 20): "t"})
    assert run(run_heal(ops, REPLAY, 100.0, "stage 0 stopped answering heartbeats")) is None
    assert ops.log == ["probe", "settle", "probe"]


def test_a_closed_connection_is_blamed_without_waiting():
    dead = [R(0, True, 5, 5), R(1, False, gone=True), R(2, True, 4, 4)]
    ops = FakeOps(dead, spares={(10, 20): "s"})
    event = run(run_heal(ops, REPLAY, 100.0, "stream closed"))
    assert event.stage == 1 and ops.log[:2] == ["probe", ("pick", (10, 20))]


async def _coro(value):
    return value


@pytest.mark.parametrize("fault", ["swap", "replay"])
def test_second_failure_during_a_heal_retries(fault):
    # the first spare dies during the swap (or the replay); a second spare of the range is used
    ops = FakeOps([DEAD_MIDDLE, DEAD_MIDDLE], spares={(10, 20): "s1"},
                  fail_swaps=int(fault == "swap"), fail_replays=int(fault == "replay"))
    orig_pick = ops.pick_spare
    backups = ["s2"]

    async def pick(layers):
        got = await orig_pick(layers)
        return got or (backups.pop() if backups else None)

    ops.pick_spare = pick
    event = run(run_heal(ops, REPLAY, 100.0, "timeout"))
    assert event.attempts == 2 and event.spare == "s2"
    assert event.errors[0] == "timeout" and ("died" in event.errors[1] or "lost during replay" in event.errors[1])


def test_every_attempt_failing_gives_up():
    ops = FakeOps([DEAD_MIDDLE] * 3, fail_replays=3)
    ops.pick_spare = lambda layers: _coro("s")
    with pytest.raises(HealError, match="the heal failed 3 times"):
        run(run_heal(ops, REPLAY, 100.0, "timeout"))


def test_first_failure_during_prefill_replays_the_prompt():
    ops = FakeOps(DEAD_MIDDLE, spares={(10, 20): "s"}, replay_token=123)
    event = run(run_heal(ops, plan_replay([1, 2, 3], []), 100.0, "timeout"))
    assert event.replay_tokens == 3  # no driver to check


@pytest.mark.process
def test_heal_imports_no_torch_trio_or_libp2p():
    code = "import sys, swarm.heal; bad = [m for m in ('torch', 'trio', 'libp2p') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class KeepingOps(FakeOps):
    """FakeOps that can keep the survivors' session (``repair`` / ``resume``), or say why not."""

    def __init__(self, *args, why=None, peers=("p0", "p1", "p2"), **kwargs):
        super().__init__(*args, **kwargs)
        self.why, self.peers = why, list(peers)

    def peer_of(self, index):
        return self.peers[index]

    async def repair(self, index, count, replay):
        self.log.append(("repair", index, count, len(replay.prefix)))
        return self.why

    async def resume(self):
        self.log.append("resume")
        if self.fail_replays:
            self.fail_replays -= 1
            raise StageLost("lost during the refill")
        return self.replay_token


def test_a_heal_keeps_the_survivors_when_the_engine_can():
    ops = KeepingOps(DEAD_MIDDLE, spares={(10, 20): "spare-A"})
    event = run(run_heal(ops, REPLAY, detected_at=100.0, cause="lost"))
    assert ops.log[-3:] == [("swap", 1, "spare-A"), ("repair", 1, 1, 5), "resume"]
    assert "reset" not in ops.log
    assert (event.replay, event.replay_tokens, event.refill_tokens, event.survivor_tokens) == ("survivors_kept", 5, 4, 1)
    assert event.replaced == ["p1"] and event.fallback == ""


def test_a_heal_falls_back_to_a_full_replay_and_says_why():
    ops = KeepingOps(DEAD_MIDDLE, spares={(10, 20): "spare-A"}, why="stage 0 holds 0 positions")
    event = run(run_heal(ops, REPLAY, detected_at=100.0, cause="lost"))
    assert ops.log[-4:] == [("swap", 1, "spare-A"), ("repair", 1, 1, 5), "reset", ("replay", 5)]
    assert (event.replay, event.survivor_tokens, event.refill_tokens) == ("full", 5, 0)
    assert event.fallback == "stage 0 holds 0 positions"


def test_a_heal_with_nothing_committed_replays_in_full_without_repair():
    ops = KeepingOps(DEAD_MIDDLE, spares={(10, 20): "s"})
    event = run(run_heal(ops, plan_replay([1, 2, 3], []), 100.0, "timeout"))
    assert not any(isinstance(x, tuple) and x[0] == "repair" for x in ops.log)
    assert event.replay == "full" and "nothing committed" in event.fallback


def test_a_kept_heal_that_fails_again_retries_and_records_every_replaced_stage():
    ops = KeepingOps([DEAD_MIDDLE] * 2, spares={(10, 20): "s"}, fail_replays=1, peers=("p0", "p1", "p2"))
    orig_pick, orig_swap = ops.pick_spare, ops.swap

    async def pick(layers):
        return await orig_pick(layers) or "s2"

    async def swap(index, spare):
        await orig_swap(index, spare)
        ops.peers[index] = spare  # the spare now sits there: the retry replaces it

    ops.pick_spare, ops.swap = pick, swap
    event = run(run_heal(ops, REPLAY, 100.0, "lost"))
    assert event.attempts == 2 and event.replay == "survivors_kept"
    assert event.replaced == ["p1", "s"] and event.spare == "s2"


def test_a_replacement_chain_longer_than_the_ring_is_dialed_without_an_index_error():
    """A lost tail (or only) stage replaced by a chain of two: the chain's second stage sits at a
    ring position the ring file never had. Its hello answer must be read, and its errors named,
    not fail with IndexError (a routed one-stage ring whose stage died mid-answer got a 500)."""
    from swarm.config import RingSpec, StageSpec
    from swarm.errors import RemoteError
    from swarm.ranges import LayerRange
    from swarm.coordinator.ring import RingClient
    from swarm.frames import Error, LinkLost, Progress

    ring = RingSpec(model="m", stages=(StageSpec("/ip4/127.0.0.1/tcp/1/p2p/X", LayerRange(0, 5)),))
    client = RingClient(None, ring, 1.0, 1.0)
    client.net.raise_for(1, Progress("s"))  # a good answer: nothing to raise
    with pytest.raises(StageLost, match=r"stage 1 \(of a replacement chain\) at \? closed the connection: gone"):
        client.net.raise_for(1, LinkLost("gone"))
    with pytest.raises(RemoteError, match=r"stage 1 \(of a replacement chain\) refused: busy"):
        client.net.raise_for(1, Error(code="busy", reason="busy"))
    with pytest.raises(StageLost, match=r"stage 0 \[0, 5\) refused"):
        client.net.raise_for(0, Error(code="unavailable", reason="draining"))


class WideningOps(KeepingOps):
    """KeepingOps whose lost range has no spare, but a window of positions around it can be re-routed."""

    def __init__(self, *args, window=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = window

    async def pick_wider(self, index):
        self.log.append(("wider", index))
        return self.window

    async def repair(self, index, count, replay):
        self.log.append(("repair", index, count, len(replay.prefix)))
        return "the replacement took over 2 ring positions"


def test_no_spare_for_the_lost_range_re_routes_a_window_and_replays_in_full():
    """Stage 1 [10, 20) is lost and nothing outside the ring holds it: the engine re-routes positions
    0 and 1 ([0, 20)) onto one stage; the event names the window, the lost position and the fallback."""
    ops = WideningOps(DEAD_MIDDLE, window=(0, 2, "wide"))
    event = run(run_heal(ops, REPLAY, detected_at=100.0, cause="lost"))
    assert ops.log[-6:] == [("pick", (10, 20)), ("wider", 1), ("swap", 0, "wide"), ("repair", 0, 1, 5), "reset",
                            ("replay", 5)]
    assert (event.stage, event.layers, event.positions, event.lost_stage) == (0, (0, 20), 2, 1)
    assert event.replay == "full" and "2 ring positions" in event.fallback
    assert event.replaced == ["p1"] and event.spares == ["wide"]


def test_no_spare_and_no_window_still_names_the_lost_range():
    ops = WideningOps(DEAD_MIDDLE, window=None)
    with pytest.raises(NoSpare, match=r"stage 1 holding layers \[10, 20\) is lost"):
        run(run_heal(ops, REPLAY, 100.0, "timeout"))
    assert ("wider", 1) in ops.log and not any(isinstance(x, tuple) and x[0] == "swap" for x in ops.log)


def test_a_pause_during_the_rebuild_replays_in_full_on_the_ring_as_it_is():
    """Issue 31's chaos soak: the spare was swapped in, then a survivor paused (SIGSTOP) during the
    replay; the next probe blames nobody. Before: "the heal failed ... and then no stage could be
    blamed" (the request lost); now the session is replayed in full on the ring as it is."""
    paused, resumed = [R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], [R(0, True, 5, 5), R(1, True, 4, 4),
                                                                       R(2, True, 4, 4)]  # then nothing stuck
    ops = FakeOps([DEAD_MIDDLE, DEAD_MIDDLE, paused, resumed], spares={(10, 20): "spare-A"}, fail_replays=1)
    event = run(run_heal(ops, REPLAY, detected_at=100.0, cause="lost"))
    # the replay failed, the re-check blamed nobody, the replay ran again in full
    assert ops.log[-7:] == ["reset", ("replay", 5), "probe", "settle", "probe", "reset", ("replay", 5)]
    assert ops.log.count(("swap", 1, "spare-A")) == 1
    assert (event.stage, event.spare, event.attempts, event.replay) == (1, "spare-A", 2, "full")
    assert "paused during the rebuild" in event.fallback and "lost during replay" in event.fallback
    assert event.total_s > 0 and event.replay_tokens == 5


def test_a_pause_before_anything_was_swapped_still_fails_loudly():
    paused, resumed = [R(0, False), R(1, True, 4, 4), R(2, True, 4, 4)], [R(0, True, 5, 5), R(1, True, 4, 4),
                                                                       R(2, True, 4, 4)]
    ops = FakeOps([DEAD_MIDDLE, DEAD_MIDDLE, paused, resumed], spares={(10, 20): "spare-A"}, fail_swaps=1)
    with pytest.raises(HealError, match="then no stage could be blamed"):
        run(run_heal(ops, REPLAY, 100.0, "lost"))

"""swarm.stage.auditor_role, the auditor role of ``swarm stage --audit-rate``: on a real in-process ring (libp2p
loopback, a DHT bootstrap node), an auditor-role stage announced on the DHT is found by the coordinator's
offer (swarm.auditor.offers), refuses offers from the wrong sender or of a bad receipt with the reason, waits
while it has a live session of its own, then catches the cheating stage, publishes the proof on the DHT,
keeps it and its tally (info, --audit-tally), and passes the honest stages."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm import proofs, wire
from swarm.auditor.judge import Blocks, verify_proof
from swarm.frames import AuditOffer
from swarm.auditor.offers import auditor_targets, offer_job
from swarm.config import StageSpec
from swarm.coordinator.jobs import offer_for_audit
from swarm.coordinator.routing import RouteContext
from swarm.discovery.dht import open_dht
from swarm.errors import collapse
from swarm.ranges import LayerRange
from swarm.stage.auditor_role import AuditorRole
from swarm.transport import load_or_create_key, open_host
from tests.support.cheats import cheat
from tests.support.models import make_synthetic
from tests.support.ring import LOOPBACK, open_bootstrap, signed_job, start_announced, start_ring

RANGES = [(0, 1), (1, 3), (3, 4)]
PROMPT = [1 + (i * 7) % 50 for i in range(70)]  # 70 positions: windows 0 and 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic("llama", tmp_path_factory.mktemp("auditing-model"), "float64")


async def _until(cond, what: str, within_s: float = 60.0) -> None:
    """Wait (polling the stage's state under a deadline) until ``cond()`` holds."""
    with trio.fail_after(within_s):
        while not cond():
            await trio.sleep(0.02)


async def _ask(host, addr: str, msg: dict) -> dict:
    stream = await host.open_stream(addr, wire.PROTOCOL_ID, timeout_s=10)
    try:
        await stream.send(msg, timeout_s=10)
        return await stream.recv(timeout_s=30)
    finally:
        await stream.aclose()


@pytest.mark.ring
@pytest.mark.slow
def test_an_auditor_role_stage_audits_offered_jobs_when_idle_and_catches_the_cheater(model_dir, tmp_path):
    from swarm.config import cache_root
    from swarm.weights.identify import model_id as weights_model_id

    weights_id = weights_model_id(model_dir, cache_root() / "manifests")
    tally_file = tmp_path / "tally.json"
    got: dict = {}

    async def main():
        with trio.fail_after(300):
            async with AsyncExitStack() as stack:
                boot = await open_bootstrap(stack)
                nursery = await stack.enter_async_context(trio.open_nursery())
                spec, servers = await start_ring(nursery, model_dir, RANGES, tmp_path)
                cheat(servers[1].block, "ulp", position=5)  # in window 0: every pick opens it
                ready, auditor, _ = await start_announced(nursery, model_dir, (0, 4), tmp_path / "auditor.key", boot,
                                                          weights_id, 10.0, dtype="float64", audit_rate=1.0,
                                                          audit_tally=tally_file)
                role, aud_addr = auditor.auditing, ready["addrs"][0]
                res = await signed_job(spec, model_dir, tmp_path, PROMPT, tmp_path / "r", 6)
                assert res["verified"], res
                job = res["doc"]
                got["peers"] = [r["peer_id"] for r in job["stage_receipts"]]

                coord_key = load_or_create_key(tmp_path / "coord.key")
                async with open_host(coord_key, [LOOPBACK]) as host, \
                        open_dht(host, server=False, bootstrap=[boot]) as dht:
                    # a one-stage session of the auditor's own (it holds every layer): the role must wait for it
                    live = await host.open_stream(aud_addr, wire.PROTOCOL_ID, timeout_s=10)
                    await live.send(wire.open_frame(coord_key, "live-1", None, 16), timeout_s=10)
                    assert (await live.recv(timeout_s=30))["type"] == "open_ok"
                    records = await dht.find_records(weights_id)
                    targets = auditor_targets(job, records, ())
                    got["targets"] = targets
                    offered = await offer_for_audit(host, {"verified": True, "path": res["path"]},
                                                    RouteContext(dht, weights_id, tuple(records)))
                    got["offered"] = offered
                    got["again"] = await offer_job(host, job, [aud_addr])  # offered twice: audited once
                    await _until(lambda: role.paused, "the role to pause for the live session")
                    got["paused_jobs"] = role.jobs  # nothing audited while its own session is open
                    got["paused_info"] = (await _ask(host, aud_addr, wire.frame("info")))["auditor"]
                    await live.send(wire.frame("close", session="live-1"), timeout_s=10)
                    assert (await live.recv(timeout_s=30))["type"] == "close_ok"
                    await live.aclose()
                    await _until(lambda: role.jobs == 1, "the audit of the offered job", 120)
                    await _until(lambda: tally_file.exists(), "the tally file")
                    got["info"] = (await _ask(host, aud_addr, wire.frame("info")))["auditor"]
                    got["dht_proof"] = await dht.proofs.read_one(got["peers"][1])
                # refusals: another sender than the job's coordinator, a receipt that does not verify
                async with open_host(load_or_create_key(tmp_path / "stranger.key"), [LOOPBACK]) as other:
                    got["stranger"] = await _ask(other, aud_addr, wire.frame("audit_offer", job=job))
                    got["forged"] = await _ask(other, aud_addr, wire.frame("audit_offer", job={**job, "sig": "00"}))
                    got["junk"] = await _ask(other, aud_addr, wire.frame("audit_offer", job={"x": [1, 2]}))
                    got["not_role"] = await _ask(other, spec.stages[0].addr, wire.frame("audit_offer", job=job))
                    got["still_up"] = (await _ask(other, aud_addr, wire.frame("info")))["type"]
                got["proofs"] = list(role.proofs)
                from prometheus_client import generate_latest

                from swarm.stage.metrics import StageMetrics

                got["metrics"] = generate_latest(StageMetrics(auditor).registry).decode()
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    head, cheater, tail = got["peers"]
    assert len(got["targets"]) == 1 and got["offered"] == {got["targets"][0]: "queued"}
    assert list(got["again"].values()) == ["known"]
    assert got["paused_jobs"] == 0 and got["paused_info"]["paused"] and got["paused_info"]["waiting"] == 1
    info = got["info"]
    assert info["tally"] == {head: {"audited": 1, "passed": 1, "failed": 0},
                             cheater: {"audited": 1, "passed": 0, "failed": 1},
                             tail: {"audited": 1, "passed": 1, "failed": 0}}, info
    assert info["audited"] == 3 and info["failed"] == 1 and info["pauses"] >= 1 and info["proofs"] == 1
    assert json.loads(tally_file.read_text()) == info["tally"]  # the format of `swarm audit run --tally`
    (proof,) = got["proofs"]
    assert proof["accused"] == cheater and proof["position"] == 5
    assert verify_proof(proofs.decode(proofs.encode(proof)), Blocks(model_dir)).accused == cheater
    assert got["dht_proof"] is not None and proofs.decode(got["dht_proof"])["accused"] == cheater
    assert got["stranger"]["code"] == "forbidden" and "offers only its own jobs" in got["stranger"]["reason"]
    assert got["forged"]["code"] == "bad_request" and "does not verify" in got["forged"]["reason"]
    assert got["junk"]["code"] == "bad_request" and "does not verify" in got["junk"]["reason"]
    assert got["not_role"]["code"] == "unavailable" and "--audit-rate 0" in got["not_role"]["reason"]
    assert got["still_up"] == "info_ok"
    for line in ("swarm_stage_auditor_audited_total 3.0", "swarm_stage_auditor_failed_total 1.0",
                 "swarm_stage_auditor_passed_total 2.0", "swarm_stage_auditor_waiting 0.0"):
        assert line in got["metrics"], got["metrics"]


def _role(**kw) -> AuditorRole:
    from swarm import wire as w

    return AuditorRole(kw.pop("rate", 1.0), LayerRange(1, 3), "digest", live=kw.pop("live", lambda: 0),
                       error=lambda reason, code, session=None: w.error_frame(reason, code, session), **kw)


def test_the_role_waits_while_the_stage_has_live_sessions():
    """wait_idle returns at once when idle; with sessions open it pauses until the last one ends."""
    import trio.testing

    state = {"sessions": 1}

    async def main():
        role = _role(live=lambda: state["sessions"])
        done = []

        async def waiter():
            await role.wait_idle()
            done.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(30)
            assert not done and role.paused and role.pauses == 1
            state["sessions"] = 0
        assert done and 30 <= done[0] < 30.2 and not role.paused
        t0 = trio.current_time()
        await role.wait_idle()
        assert trio.current_time() == t0 and role.pauses == 1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class _Stream:
    remote_peer_id = "12D3KooWsender"

    def __init__(self):
        self.sent = []

    async def send(self, msg, timeout_s=None):
        self.sent.append(msg.to_wire())  # as the wire carries it


def test_offers_are_bounded_dropped_oldest_and_rate_limited_per_sender(monkeypatch):
    from swarm.stage.openings import RateLimit

    role = _role(queue_len=2, limit=RateLimit(rate_per_s=0.001, burst=4))

    async def accept(sender, job, me):  # the receipt checks are the ring test's: here, the queue alone
        return None if role.limit.allow(sender, trio.current_time()) else ("too many audit offers", "rate_limited")

    monkeypatch.setattr(role, "_check", accept)

    async def main():
        stream = _Stream()
        for n in range(5):
            await role.offer(stream, AuditOffer({"job_id": f"j{n}"}), "me")
        assert [m.get("waiting", m.get("code")) for m in stream.sent] == [1, 2, 2, 2, "rate_limited"]
        assert [j["job_id"] for j in role.queue] == ["j2", "j3"] and role.dropped == 2 and role.offers == 4
        assert role.refused == 1

    trio.run(main)


def test_a_stage_without_the_role_refuses_offers_and_targets_cover_the_jobs_ranges():
    async def main():
        role = _role(rate=0.0)
        stream = _Stream()
        await role.offer(stream, AuditOffer({"job_id": "j"}), "me")
        assert stream.sent[0]["code"] == "unavailable" and not role.queue

    trio.run(main)
    from tests.support.dht import signed_record

    def rec(layers, rate=1.0, state="online"):
        from swarm.discovery.records import open_record, record_key
        import time

        key = create_new_key_pair()
        from swarm.transport.identity import peer_id_of

        return open_record(record_key(peer_id_of(key)), signed_record(key, layers=layers, audit_rate=rate,
                                                                      state=state), now=time.time())

    job = {"ring": [{"peer_id": "A", "layers": [0, 2]}, {"peer_id": "B", "layers": [2, 5]}]}
    inside, whole, none, off, draining, elsewhere = (rec((2, 5)), rec((0, 5), 0.5), rec((2, 5), 0.0), rec((1, 4)),
                                                     rec((0, 5), state="draining"), rec((3, 5)))
    got = auditor_targets(job, [none, off, elsewhere, whole, inside, draining])
    assert got == [inside.addrs[0], whole.addrs[0]]  # the highest rate first; no role, no cover, draining: out
    spare = StageSpec(addr="/ip4/127.0.0.1/tcp/9/p2p/12D3KooWspare", layers=LayerRange(0, 2))
    served = StageSpec(addr="/ip4/127.0.0.1/tcp/9/p2p/A", layers=LayerRange(0, 2))
    assert auditor_targets(job, [], [spare, served]) == [spare.addr]

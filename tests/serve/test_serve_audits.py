"""``swarm serve --bootstrap`` and fraud proofs (issue 29): serve's routing, its reroutes and its heals
leave out a stage against which a proof on the DHT held when re-run on serve's own weights; a forged
proof (a lying auditor framing the honest tail) is refused with the reason and excludes nobody; the
dashboard's ``/dashboard/state`` shows per stage the proof as serve judged it and ``--audits``' counts.

One swarm on loopback, in this process: a DHT bootstrap node and stories260k stages announcing on it
(head [0, 2), tail [4, 5), and for [2, 4): a cheater C that skips a layer and claims the highest
throughput, so routing would pick it first; honest H2, H3, and later H4). The server runs in a thread
(tests/support/serve.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack

import httpx
import openai
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from swarm import proofs
from swarm.auditor.judge import Blocks
from swarm.auditor.run import Auditor
from swarm.auditor.tally import add_tally
from swarm.config import RingSpec, StageSpec, cache_root
from swarm.discovery.dht import open_dht
from swarm.errors import collapse
from swarm.ranges import LayerRange
from swarm.transport import load_or_create_key, open_host
from swarm.weights.identify import model_id as weights_model_id
from tests.support.cheats import cheat
from tests.support.ring import LOOPBACK, open_bootstrap, signed_job, start_announced

PROMPT = [1, 403, 407, 261, 378, 300, 290]
ASK = dict(prompt="Once upon a time", max_tokens=12, temperature=0)


class _LyingBlocks(Blocks):
    """A lying auditor's blocks: its tail block computes garbage, so its 'proof' against the tail frames it."""

    def get(self, layers, dtype):
        block = super().get(layers, dtype)
        if tuple(layers) == (4, 5) and not hasattr(block, "_lies"):
            block._lies = cheat(block, "garbage")
        return block


def _complete(server, model: str, within_s: float = 30.0) -> str:
    """A completion's text; a 503 (the swarm is healing or rerouting) is retried, as OpenAI's clients do."""
    end = time.monotonic() + within_s
    while True:
        try:
            return server.client.completions.create(model=model, **ASK).choices[0].text
        except openai.InternalServerError as exc:
            if exc.status_code != 503 or time.monotonic() > end:
                raise
            time.sleep(1)


def _route_until(server, want: list[str], within_s: float = 20.0) -> list[str]:
    """serve's route (PeerIds, from /health) once it is ``want``, or the last one after ``within_s``: a
    reroute or heal may update the route just after the answer streamed."""
    end = time.monotonic() + within_s
    while True:
        route = [s["peer_id"] for s in server.health()["stages"]]
        if route == want or time.monotonic() > end:
            return route
        time.sleep(0.5)


def _dashboard_until(server, done, within_s: float = 20.0) -> dict:
    """``/dashboard/state`` once ``done(state)`` holds, or the last one after ``within_s``."""
    end = time.monotonic() + within_s
    while True:
        state = httpx.get(server.url + "/dashboard/state", timeout=30).json()
        if done(state) or time.monotonic() > end:
            return state
        time.sleep(0.5)


@pytest.mark.ring
@pytest.mark.slow
def test_serve_routes_reroutes_and_heals_around_a_proven_cheater_and_shows_audits(stories_dir, tmp_path, caplog):
    from tests.support.serve import Server

    caplog.set_level(logging.WARNING, logger="swarm.auditor.exclusions")
    weights_id = weights_model_id(stories_dir, cache_root() / "manifests")
    tally = tmp_path / "tally.json"
    got: dict = {"peers": {}}
    p = got["peers"]

    async def stage(nursery, boot, name, layers, tps):
        ready, server, scope = await start_announced(nursery, stories_dir, layers, tmp_path / f"{name}.key", boot,
                                                     weights_id, tps)
        p[name] = ready["peer_id"]
        return {"peer": ready["peer_id"], "spec": StageSpec(addr=ready["addrs"][0], layers=LayerRange(*layers)),
                "server": server, "scope": scope}

    async def in_thread(fn, *args):
        return await trio.to_thread.run_sync(fn, *args)

    async def main():
        with trio.fail_after(400):
            async with AsyncExitStack() as stack:
                boot = await open_bootstrap(stack)
                pub_host = await stack.enter_async_context(open_host(create_new_key_pair(), [LOOPBACK]))
                pub = await stack.enter_async_context(open_dht(pub_host, server=False, bootstrap=[boot]))
                nursery = await stack.enter_async_context(trio.open_nursery())
                stack.callback(nursery.cancel_scope.cancel)  # runs first on the way out
                head = await stage(nursery, boot, "head", (0, 2), 100.0)
                tail = await stage(nursery, boot, "tail", (4, 5), 100.0)
                c = await stage(nursery, boot, "c", (2, 4), 10000.0)
                h2 = await stage(nursery, boot, "h2", (2, 4), 100.0)
                h3 = await stage(nursery, boot, "h3", (2, 4), 1.0)
                double = cheat(c["server"].block, "skip", layer=1)
                # one job through the cheater, audited by an honest auditor and by a liar framing the tail
                ring = RingSpec(model=str(stories_dir), stages=(head["spec"], c["spec"], tail["spec"]))
                res = await signed_job(ring, stories_dir, tmp_path, PROMPT, tmp_path / "receipts", 6)
                key = load_or_create_key(tmp_path / "auditor.key")
                async with open_host(key, [LOOPBACK]) as host:
                    honest = Auditor(host, key, Blocks(stories_dir), rate=1.0)
                    verdicts = await honest.audit_job(res["doc"])
                    liar = await Auditor(host, key, _LyingBlocks(stories_dir), rate=1.0).audit_job(res["doc"])
                assert [v.outcome for v in verdicts] == ["passed", "failed", "passed"], [v.line() for v in verdicts]
                assert [v.outcome for v in liar] == ["passed", "failed", "failed"], [v.line() for v in liar]
                add_tally(tally, honest.tally)
                assert await pub.proofs.publish(proofs.encode(verdicts[1].proof), c["peer"]) >= 1
                got["c_sessions"] = double.sessions
                (tmp_path / "serve").mkdir()  # its own key: not the job's coordinator's
                swarm_of = RingSpec(model=str(stories_dir), stages=())
                server = await in_thread(lambda: Server(swarm_of, tmp_path / "serve", bootstrap=(boot,),
                                                        audit_tally=tally))
                try:
                    model = server.box["info"]["model"]
                    got["routed"] = [e["peer_id"] for e in server.box["info"]["ring"]]
                    # a forgery published after routing: the dashboard's reader judges it (and refuses it)
                    assert await pub.proofs.publish(proofs.encode(liar[2].proof), tail["peer"]) >= 1
                    got["framed"] = await in_thread(_dashboard_until, server, lambda s: s["stages"][2]["audit"]
                                                    ["proof"] is not None)
                    h2["scope"].cancel()  # before any request: the first one's client reroutes over the DHT
                    got["first"] = await in_thread(_complete, server, model)
                    got["rerouted"] = await in_thread(_route_until, server, [p["head"], p["h3"], p["tail"]])
                    await stage(nursery, boot, "h4", (2, 4), 1000.0)  # slower than C: only C's proof keeps C out
                    h3["scope"].cancel()  # between requests: the kept client heals (from the DHT)
                    got["second"] = await in_thread(_complete, server, model)
                    got["healed"] = await in_thread(_route_until, server, [p["head"], p["h4"], p["tail"]])
                    got["state"] = await in_thread(_dashboard_until, server, lambda s: True)
                finally:
                    await in_thread(server.stop)
                got["c_after"] = double.sessions

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None
    assert got["routed"] == [p["head"], p["h2"], p["tail"]]  # C, the fastest holder, is shut out
    assert got["rerouted"] == [p["head"], p["h3"], p["tail"]]
    assert got["healed"] == [p["head"], p["h4"], p["tail"]]
    assert got["second"] == got["first"] and got["first"]  # honest stages: the same text
    assert got["c_after"] == got["c_sessions"]  # the cheater never saw one of serve's sessions
    assert "audit.proof_refused" in caplog.text and "honest stage framed" in caplog.text
    framed = got["framed"]["stages"][2]["audit"]
    assert framed["proof"] == "refused" and "honest stage framed" in framed["why"], framed
    state = got["state"]
    audits = {s["peer_id"]: s["audit"] for s in state["stages"]}
    assert audits[p["head"]] == {"proof": None, "why": None, "audited": 1, "passed": 1, "failed": 0}
    assert audits[p["h4"]] == {"proof": None, "why": None, "audited": None, "passed": None, "failed": None}
    assert audits[p["tail"]]["proof"] == "refused" and (audits[p["tail"]]["audited"], audits[p["tail"]]["passed"]) \
        == (1, 1)
    (out,) = state["shut_out"]
    assert out["peer_id"] == p["c"] and out["layers"] == [2, 4]
    assert out["why"].startswith(f"VALID proof: stage {p['c']}")
    assert state["audits"] == str(tally) and state["audits_error"] is None


def test_an_unreadable_tally_fails_before_serve_listens(stories_dir, tmp_path):
    from swarm.errors import ConfigError
    from swarm.serve.app import serve_api
    from swarm.serve.config import ServeConfig

    bad = tmp_path / "tally.json"
    bad.write_text("[1, 2]")
    config = ServeConfig.of(port=0, key_path=tmp_path / "coord.key", audit_tally=bad)
    with pytest.raises(ConfigError, match="--audits: .* is not an audit tally"):
        trio.run(serve_api, RingSpec(model=str(stories_dir), stages=()), config)


def test_swarm_serve_audits_names_the_flag_of_a_file_that_is_no_tally(stories_dir, tmp_path):
    from tests.support.cli import run_cli

    bad = tmp_path / "tally.json"
    bad.write_text('{"A": 3}')
    ring = tmp_path / "ring.yaml"  # never dialled: the tally is read with the model, before the ring
    ring.write_text(f"model: {stories_dir}\nstages:\n- {{addr: /ip4/127.0.0.1/tcp/9/p2p/12D3KooWx, layers: '0:5'}}\n")
    out = run_cli("serve", "--ring", str(ring), "--port", "0", "--key", str(tmp_path / "k.key"), "--audits", str(bad))
    assert out.returncode != 0 and f"--audits: {bad} is not an audit tally" in out.stderr, out.stderr[-2000:]

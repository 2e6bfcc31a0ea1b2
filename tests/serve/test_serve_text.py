"""What a client of ``swarm serve`` (and ``swarm coordinate``) reads: the text of a completion as a
continuation of its prompt, stop strings (a special token's text too), usage and receipts that end
where the text ends under speculation, the default length, a client hanging up during its upload.

One in-process ring of stories260k (float32, loopback) serves two ``serve_api`` in a thread: plain
and with n-gram speculation, both writing receipts. The model is a copy whose generation config
stops at ``</s>`` only (the shipped one stops at ``<s>`` too), with a chat template.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio

from swarm.config import CoordinatorConfig, SpecConfig
from swarm.serve.app import serve_api
from swarm.serve.config import ServeConfig
from tests.support.models import reference_greedy
from tests.support.ring import start_ring
from tests.support.serve import LoopThread, stories_with_chat_template

pytestmark = [pytest.mark.ring]

RANGES = [(0, 3), (3, 5)]


class Served(LoopThread):
    """The ring and both servers, in a thread with its own trio loop."""

    def __init__(self, model_dir: Path, work: Path):
        super().__init__()
        self.work = work  # receipts-<server>/ lie there

        async def main(nursery, box):
            spec, _ = await start_ring(nursery, model_dir, RANGES, work / "keys", "float32")
            box["spec"] = spec
            for name, spec_config in (("plain", SpecConfig()), ("speculative", SpecConfig(draft="ngram", k=4))):
                config = ServeConfig.of(host="127.0.0.1", port=0, key_path=work / f"{name}.key", spec=spec_config,
                                     receipt_dir=work / f"receipts-{name}")
                box[name] = await nursery.start(lambda task_status, c=config: serve_api(
                    spec, c, task_status=task_status))

        box = self.start(main)
        self.spec = box["spec"]
        self.plain, self.spec_url = box["plain"]["url"], box["speculative"]["url"]

    def client(self, url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(stories_dir, tmp_path_factory) -> Path:
    """stories260k, stopping at ``</s>`` only, with a Llama-2-style chat template."""
    return stories_with_chat_template(stories_dir, tmp_path_factory.mktemp("stories"),
                                      generation_config={"bos_token_id": 1, "eos_token_id": 2})


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    s = Served(model, tmp_path_factory.mktemp("served"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def continuation(tok, prompt_ids: list[int], out: list[int]) -> str:
    """The text ``out`` adds to the prompt's text."""
    full = tok.decode(prompt_ids + out, skip_special_tokens=True)
    before = tok.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(before)
    return full[len(before):]


def complete(served, url, stream=False, **fields):
    """A completion's (text, finish_reason, completion_tokens), streamed or not."""
    client = served.client(url)
    if not stream:
        r = client.completions.create(model="stories260k", temperature=0, **fields)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(client.completions.create(model="stories260k", temperature=0, stream=True,
                                            stream_options={"include_usage": True}, **fields))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(c.choices[0].text for c in chunks if c.choices), reasons[-1], chunks[-1].usage.completion_tokens


# ---- 5: the text continues the prompt ------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Once upon a time,", "The dog"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_reads_on_from_its_prompt(served, model, tok, prompt, stream):
    ids = tok(prompt)["input_ids"]
    ref = reference_greedy(model, ids, 8, "float32")
    want = continuation(tok, ids, ref)
    assert want.startswith(" ")  # SentencePiece: the first word's space belongs to the text
    for url in (served.plain, served.spec_url):
        assert complete(served, url, stream, prompt=prompt, max_tokens=8) == (want, "length", 8)
    first = want.split()[0]
    got = complete(served, served.plain, stream, prompt=prompt, max_tokens=8, stop=[" " + first])
    assert got == ("", "stop", 1)  # the stop string with its space matches at once


def test_swarm_coordinate_prints_the_continuation(served, model, tok, tmp_path):
    from swarm.coordinator.generation import generate

    pieces: list[str] = []
    config = CoordinatorConfig(ring=served.spec, max_new_tokens=8, key_path=tmp_path / "c.key", receipt_dir=None)
    result = trio.run(generate, config, "Once upon a time,", pieces.append)
    ids = tok("Once upon a time,")["input_ids"]
    want = continuation(tok, ids, reference_greedy(model, ids, 8, "float32"))
    assert result["text"] == "".join(pieces) == want and want.startswith(" there")


# ---- 6: a stop string that is a special token's text -------------------------------------------


@pytest.mark.slow  # ~190 tokens a request; tests/coordinator/test_text.py has the fast cases
def test_a_stop_string_naming_a_special_token_stops_where_the_model_writes_it(served, model, tok):
    ids = tok("The dog")["input_ids"]
    ref = reference_greedy(model, ids, 200, "float32")
    at = ref.index(tok.bos_token_id)  # the model begins the next story with <s>; </s> alone stops here
    want = continuation(tok, ids, ref[:at])
    for url, stream in ((served.plain, False), (served.spec_url, True)):
        assert complete(served, url, stream, prompt="The dog", max_tokens=200, stop=["<s>"]) == (want, "stop", at + 1)
    # the special token's text after the text before it: one stop string across both
    got = complete(served, served.plain, False, prompt="The dog", max_tokens=200, stop=[want[-4:] + "<s>"])
    assert got == (want[:-4], "stop", at + 1)


# ---- 7: under speculation, usage and receipts end with the text ----------------------------------


def receipts_of(directory: Path) -> list[dict]:
    """The job receipts in ``directory``, oldest first."""
    docs = [json.loads(p.read_text()) for p in directory.glob("*.json")]
    return sorted((d.get("body", d) for d in docs), key=lambda b: b["created_ms"])


@pytest.mark.parametrize("prompt, stop, max_tokens", [
    ("The dog", "his ball.", 40),  # n-gram drafts of "He liked to play with his ball." run past the stop
    ("The dog", "his ball.", 20),  # ... and the limit is reached in the chunk the stop ends in
    ("The dog", "liked to play with his ball. He liked", 60),  # a stop inside the repeated sentence
    ("Once upon a time,", ". She", 40)])
def test_speculation_counts_the_tokens_of_the_text_not_of_the_last_chunk(served, tok, prompt, stop, max_tokens):
    got = {}
    for name, url in (("plain", served.plain), ("speculative", served.spec_url)):
        for stream in (False, True):
            got[name, stream] = complete(served, url, stream, prompt=prompt, max_tokens=max_tokens, stop=[stop])
        receipt = receipts_of(served.work / f"receipts-{name}")[-1]
        text, reason, n = got[name, True]
        assert reason == "stop" and len(receipt["output_ids"]) == n
        assert tok.decode(receipt["output_ids"], skip_special_tokens=True).endswith(stop.split()[-1])
    assert len(set(got.values())) == 1, got


# ---- 8: no max_tokens: what the context leaves ---------------------------------------------------


@pytest.mark.slow  # ~480 tokens; test_serve_requests.py has the fast case
def test_a_chat_without_max_tokens_runs_to_the_context(served, tok):
    client = served.client(served.plain)
    r = client.chat.completions.create(model="stories260k", temperature=0,
                                       messages=[{"role": "user", "content": "Tell me a story"}])
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 512  # stories260k's context
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens > 256


# ---- 10: a body starting with a UTF-8 BOM --------------------------------------------------------


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Once upon a time,", "max_tokens": 4}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                  "max_tokens": 4})])
def test_a_body_with_a_utf8_bom_is_answered(served, path, body):
    raw = json.dumps(body | {"temperature": 0}).encode()
    with_bom, without = (httpx.post(served.plain + path, content=b, timeout=60,
                                    headers={"content-type": "application/json"}) for b in (b"\xef\xbb\xbf" + raw, raw))
    assert with_bom.status_code == 200, with_bom.text
    assert with_bom.json()["choices"] == without.json()["choices"]


# ---- 13: a client hanging up during its upload -------------------------------------------------


def metric(url: str, status: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f'swarm_serve_requests_total{{status="{status}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no request counter for {status}")


@pytest.mark.parametrize("sent", [b"", b'{"prompt": "Once upon', b'{"prompt": "x"}'])
def test_a_client_hanging_up_during_its_upload_is_one_info_line_counted_abandoned(served, caplog, sent):
    host, port = served.plain.removeprefix("http://").split(":")
    before = {s: metric(served.plain, s) for s in ("abandoned", "error")}
    caplog.set_level(logging.INFO)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + sent)
        time.sleep(0.3)
    end = time.monotonic() + 10
    while metric(served.plain, "abandoned") == before["abandoned"]:
        assert time.monotonic() < end, "the hang-up was not counted as abandoned"
        time.sleep(0.05)
    assert metric(served.plain, "error") == before["error"]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()] == \
        ["request.abandoned path=/v1/completions during=upload"]

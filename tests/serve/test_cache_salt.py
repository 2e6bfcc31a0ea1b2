"""What one client of ``swarm serve`` can learn of another's prompt through the prefix caches (issue 45
item 16, the kind of vLLM's CVE-2025-46570): ``usage.prompt_tokens_details.cached_tokens`` and the
stages' reuse must not cross ``cache_salt`` scopes (or, without a salt, ``user`` scopes).

One in-process ring of stories260k (float32, loopback, two stages) serves one ``serve_api`` in a
thread. Each test sends its own prompt, so the tests share the ring but not its prefix blocks. The
stages' prefix-cache counters (``hits``) show whether a request reused KV, not only what ``usage``
says. The model is a copy with a Llama-2-style chat template (stories260k has none).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from swarm.serve.app import serve_api
from swarm.serve.config import ServeConfig
from swarm.serve.requests import MAX_CACHE_SALT_CHARS, MAX_USER_CHARS, cache_scope
from tests.support.ring import start_ring
from tests.support.serve import LoopThread, stories_with_chat_template

pytestmark = [pytest.mark.ring]

RANGES = [(0, 3), (3, 5)]
BLOCK = 16  # --prefix-block of the stages
# the name comes first, so every test's prompt differs in its first block: no two share a block
STORY = ("{name} was a little girl who lived in a small house. She liked to play in the park with her friends. "
         "One day she found a shiny red ball under a big tree, and she ran to show her mom.")


class Served(LoopThread):
    """The ring and one server, in a thread with its own trio loop; ``stages``: the StageServers."""

    def __init__(self, model_dir: Path, work: Path):
        super().__init__()

        async def main(nursery, box):
            spec, box["stages"] = await start_ring(nursery, model_dir, RANGES, work / "keys", "float32",
                                                   prefix_block=BLOCK)
            config = ServeConfig.of(host="127.0.0.1", port=0, key_path=work / "serve.key")
            box["info"] = await nursery.start(lambda task_status: serve_api(spec, config, task_status=task_status))

        box = self.start(main)
        self.stages, self.url = box["stages"], box["info"]["url"]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def hits(self) -> list[int]:
        """Each stage's prefix-cache hits (blocks reused) so far. Read from the test thread: an int read
        between requests (no request in flight) is what the stage counted."""
        return [s.prefix.stats["hits"] for s in self.stages]


@pytest.fixture(scope="module")
def model(stories_dir, tmp_path_factory) -> Path:
    """stories260k with a Llama-2-style chat template."""
    return stories_with_chat_template(stories_dir, tmp_path_factory.mktemp("stories"))


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    s = Served(model, tmp_path_factory.mktemp("served"))
    try:
        yield s
    finally:
        s.stop()


def ask(served: Served, chat: bool, stream: bool, prompt: str, **fields) -> int:
    """Send ``prompt`` (a completion, or a chat's one user message), 4 greedy tokens; returns the
    ``cached_tokens`` of its usage (a streamed answer's last chunk). ``fields``: ``user``, ``cache_salt``."""
    extra = {"extra_body": {"cache_salt": fields.pop("cache_salt")}} if "cache_salt" in fields else {}
    opts = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    if chat:
        r = served.client.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=4, temperature=0, **opts, **fields, **extra)
    else:
        r = served.client.completions.create(model="stories260k", prompt=prompt, max_tokens=4, temperature=0,
                                             **opts, **fields, **extra)
    usage = list(r)[-1].usage if stream else r.usage
    assert usage is not None and usage.prompt_tokens > 2 * BLOCK
    return usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_another_salt_learns_nothing_of_a_prompt_and_the_same_salt_shares_it(served, chat, stream):
    prompt = STORY.format(name=f"Salty{int(chat)}{int(stream)}")
    assert ask(served, chat, stream, prompt, cache_salt="alice-0f3a") == 0
    before = served.hits()
    # the right guess of alice's prompt, under another salt, under none, and under alice's salt as `user`
    assert ask(served, chat, stream, prompt, cache_salt="mallory") == 0
    assert ask(served, chat, stream, prompt) == 0
    assert ask(served, chat, stream, prompt, user="alice-0f3a") == 0
    assert served.hits() == before  # no stage reused a block: no prefill was shortened either
    # the same salt shares (whatever the user says); so does the one pool of requests with neither field
    assert ask(served, chat, stream, prompt, cache_salt="alice-0f3a", user="someone") >= 2 * BLOCK
    assert ask(served, chat, stream, prompt) >= 2 * BLOCK
    assert all(now > was for now, was in zip(served.hits(), before)), (served.hits(), before)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_without_a_salt_each_user_shares_only_with_itself(served, chat):
    """The default: a request without ``cache_salt`` is scoped by its ``user`` (before, ``user`` was
    ignored and every client learned every other's prompt: ``cached_tokens`` 32 for a right guess)."""
    prompt = STORY.format(name=f"User{int(chat)}")
    assert ask(served, chat, False, prompt, user="alice") == 0
    before = served.hits()
    assert ask(served, chat, True, prompt, user="mallory") == 0
    assert served.hits() == before
    assert ask(served, chat, True, prompt, user="alice") >= 2 * BLOCK


@pytest.mark.parametrize("field, value", [
    ("cache_salt", 7), ("cache_salt", ""), ("cache_salt", ["s"]), ("cache_salt", {"s": 1}), ("cache_salt", True),
    ("cache_salt", "s" * (MAX_CACHE_SALT_CHARS + 1)), ("user", 7), ("user", "u" * (MAX_USER_CHARS + 1)),
    ("user", ["u"])])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_cache_salt_or_user_is_a_400_naming_it(served, field, value, path):
    body = {"model": "stories260k", "max_tokens": 2, field: value}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    r = httpx.post(served.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"'{field}'" in err["message"], err


def test_the_longest_salt_and_an_empty_user_are_taken(served):
    for fields in ({"cache_salt": "s" * MAX_CACHE_SALT_CHARS}, {"user": ""}, {"user": "u" * MAX_USER_CHARS}):
        r = httpx.post(served.url + "/v1/completions", json={"model": "stories260k", "prompt": "Hi", "max_tokens": 2,
                                                             **fields}, timeout=60)
        assert r.status_code == 200, (fields, r.text)


def test_cache_scope_table():
    assert cache_scope(None, None) == cache_scope(None, "") == ""  # the one shared pool, as before salts
    assert cache_scope("s", None) == cache_scope("s", "u1") == cache_scope("s", "u2") != ""  # a salt wins
    assert cache_scope(None, "s") not in ("", cache_scope("s", None))  # a user never equals a salt of its text
    assert cache_scope("a", None) != cache_scope("b", None) and cache_scope(None, "a") != cache_scope(None, "b")
    assert len({cache_scope("x\nuser", None), cache_scope(None, "x"), cache_scope("user\nx", None)}) == 3

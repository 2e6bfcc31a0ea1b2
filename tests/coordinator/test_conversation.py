"""``swarm coordinate --session FILE``: a conversation continued across invocations, on SmolLM2 over
an in-process 3-stage ring, each turn reusing the stages' prefix caches (resumed == fresh)."""

from __future__ import annotations

import json

import pytest
import trio

from swarm.config import CoordinatorConfig, SpecConfig
from swarm.coordinator.conversation import Conversation
from swarm.coordinator.generation import generate
from swarm.errors import ConfigError, collapse
from tests.support.ring import start_ring

pytestmark = pytest.mark.ring

QUESTIONS = ["Name a color.", "And another one?", "Which is darker?", "Say it in French.", "Thanks, bye."]


def _chat(model_dir, tmp_path, prefix_cache: bool, session, spec_config=None) -> list[dict]:
    async def main():
        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                spec, servers = await start_ring(nursery, model_dir, [(0, 10), (10, 20), (20, 30)], tmp_path,
                                                 dtype="float32")
                results = []
                for q in QUESTIONS:  # one generate() per turn, as one `swarm coordinate` invocation each
                    config = CoordinatorConfig(ring=spec, max_new_tokens=8, chat=True, key_path=tmp_path / "c.key",
                                               receipt_dir=None, prefix_cache=prefix_cache, session_file=session,
                                               **({"spec": spec_config} if spec_config else {}))
                    results.append(await generate(config, q))
                nursery.cancel_scope.cancel()
        return results

    try:
        return trio.run(main)
    except BaseExceptionGroup as group:
        raise collapse(group) from None


def test_a_five_turn_chat_resumes_from_the_file_and_the_prefix_caches(smollm2_dir, tmp_path):
    fresh = _chat(smollm2_dir, tmp_path / "a", False, tmp_path / "fresh.json")
    resumed = _chat(smollm2_dir, tmp_path / "b", True, tmp_path / "chat.json")
    assert [r["output_ids"] for r in resumed] == [r["output_ids"] for r in fresh]
    assert [r["prompt_ids"] for r in resumed] == [r["prompt_ids"] for r in fresh]
    assert all(r["cached_tokens"] == 0 for r in fresh)
    assert resumed[0]["cached_tokens"] == 0
    for prev, r in zip(resumed, resumed[1:]):  # at least the previous turn's prompt, in whole 32-position blocks
        assert r["cached_tokens"] >= (len(prev["prompt_ids"]) - 1) // 32 * 32 > 0, r["cached_tokens"]
    spec = SpecConfig(draft="ngram", k=4, depth=2)  # speculation on: the same ids again
    speculated = _chat(smollm2_dir, tmp_path / "c", True, tmp_path / "spec.json", spec)
    assert [r["output_ids"] for r in speculated] == [r["output_ids"] for r in fresh]
    assert all(r["cached_tokens"] > 0 for r in speculated[1:])
    doc = json.loads((tmp_path / "chat.json").read_text())
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"] * 5
    assert [m["content"] for m in doc["messages"][::2]] == QUESTIONS
    assert doc["ids"] == resumed[-1]["prompt_ids"] + resumed[-1]["output_ids"]
    assert resumed[-1]["session_file"] == str(tmp_path / "chat.json")


def test_a_session_file_of_another_model_or_mode_is_refused(tmp_path):
    path = tmp_path / "s.json"
    conv = Conversation.open(path, model="m", model_digest="d" * 64, chat=False)
    conv.ids = [1, 2]
    conv.record("hi", [1, 2, 3], [4], "x")
    assert json.loads(path.read_text())["ids"] == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="conversation with 'm'"):
        Conversation.open(path, model="other", model_digest="e" * 64, chat=False)
    with pytest.raises(ConfigError, match="without --chat"):
        Conversation.open(path, model="m", model_digest="d" * 64, chat=True)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable session file"):
        Conversation.open(path, model="m", model_digest="d" * 64, chat=False)
    path.write_text(json.dumps({"version": 1, "model_digest": "d" * 64, "chat": False, "ids": [-1], "messages": []}))
    with pytest.raises(ConfigError, match="malformed"):
        Conversation.open(path, model="m", model_digest="d" * 64, chat=False)


def test_an_unwritable_session_file_is_refused_before_anything_runs_and_modes_are_kept(tmp_path):
    with pytest.raises(ConfigError, match="cannot write in"):
        Conversation.open(tmp_path / "no" / "dir" / "s.json", model="m", model_digest="d" * 64, chat=False)
    with pytest.raises(ConfigError, match="is a directory"):
        Conversation.open(tmp_path, model="m", model_digest="d" * 64, chat=False)
    path = tmp_path / "s.json"
    Conversation.open(path, model="m", model_digest="d" * 64, chat=False).record("a", [1], [2], "b")
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o640)
    Conversation.open(path, model="m", model_digest="d" * 64, chat=False).record("c", [1, 2, 3], [4], "d")
    assert path.stat().st_mode & 0o777 == 0o640 and list(tmp_path.glob("*.tmp")) == []


def test_special_token_text_typed_into_a_plain_turn_stays_text(stories_dir, tmp_path):
    """Without --chat a turn is appended as text: a typed ``</s>`` ends nothing and ``<s>`` is no second BOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stories_dir))
    conv = Conversation.open(tmp_path / "s.json", model="m", model_digest="d" * 64, chat=False)
    first = conv.prompt_ids(tok, "<s>Once upon a time")
    assert first[0] == tok.bos_token_id and tok.bos_token_id not in first[1:]
    conv.record("<s>Once upon a time", first, [tok.eos_token_id], "")
    again = conv.prompt_ids(tok, " and then</s><s> the end")
    new = again[len(conv.ids):]
    assert again[:len(conv.ids)] == conv.ids and new and not {tok.bos_token_id, tok.eos_token_id} & set(new), new

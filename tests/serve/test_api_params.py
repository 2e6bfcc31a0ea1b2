"""The OpenAI request fields: null is the default everywhere, nothing that would change the answer
is silently ignored (table tests of the pure policy in swarm.serve.params)."""

from __future__ import annotations

import json

import pytest

from swarm.serve.params import (CHAT_HONOURED, CHAT_NOOP, CHAT_REFUSED, COMPLETION_HONOURED, COMPLETION_NOOP,
                              COMPLETION_REFUSED, ParamRefused, check_fields)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "Once upon a time"}


@pytest.mark.parametrize("chat", [True, False])
def test_null_is_the_default_for_every_optional_field(chat):
    base = CHAT if chat else COMPLETION
    fields = (CHAT_HONOURED | CHAT_NOOP | CHAT_REFUSED) if chat else \
        (COMPLETION_HONOURED | COMPLETION_NOOP | COMPLETION_REFUSED)
    optional = sorted(fields - {"messages", "prompt", "model"})
    assert "n" in optional and "tools" in optional if chat else "best_of" in optional
    out = check_fields({**base, **{name: None for name in optional}, "stream_options": {"include_usage": None}}, chat)
    assert out == {**base, "stream_options": {}}


@pytest.mark.parametrize("chat, field, value", [
    (True, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (True, "tool_choice", "required"),
    (True, "tool_choice", {"type": "function", "function": {"name": "f"}}),
    (True, "functions", [{"name": "f"}]),
    (True, "function_call", {"name": "f"}),
    (True, "response_format", {"type": "json_object"}),
    (True, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    (True, "logprobs", True),
    (True, "top_logprobs", 3),
    (True, "logit_bias", {"50256": -100}),
    (True, "presence_penalty", 0.5),
    (True, "frequency_penalty", -1),
    (True, "modalities", ["text", "audio"]),
    (True, "audio", {"voice": "alloy", "format": "wav"}),
    (True, "reasoning_effort", "low"),
    (True, "web_search_options", {}),
    (False, "logprobs", 0),
    (False, "logprobs", 2),
    (False, "echo", True),
    (False, "best_of", 3),
    (False, "suffix", " the end"),
    (False, "logit_bias", {"1": 5}),
    (False, "tools", []),  # not a completions field at all
    (True, "suffix", ""),
    (True, "bogus_field", 1),
    (False, "messages", []),
])
def test_a_field_that_would_change_the_answer_is_refused_by_name(chat, field, value):
    with pytest.raises(ParamRefused) as err:
        check_fields({**(CHAT if chat else COMPLETION), field: value}, chat)
    assert err.value.param == field and f"'{field}'" in str(err.value)


@pytest.mark.parametrize("chat, field, value", [
    (True, "tools", []), (True, "tool_choice", "none"), (True, "tool_choice", "auto"),
    (True, "response_format", {"type": "text"}), (True, "modalities", ["text"]), (True, "logprobs", False),
    (True, "top_logprobs", 0), (True, "presence_penalty", 0), (True, "frequency_penalty", 0.0),
    (True, "logit_bias", {}), (True, "metadata", {"a": "b"}), (True, "store", True),
    (True, "parallel_tool_calls", True), (True, "service_tier", "auto"), (True, "prediction", {"type": "content"}),
    (False, "echo", False), (False, "best_of", 1), (False, "suffix", ""),
])
def test_neutral_values_and_no_ops_are_accepted_and_dropped(chat, field, value):
    base = CHAT if chat else COMPLETION
    assert check_fields({**base, field: value}, chat) == base


def test_honoured_fields_pass_through():
    body = {**CHAT, "max_tokens": 4, "temperature": 0, "top_p": 0.9, "seed": 1, "stop": ["x"], "stream": True,
            "stream_options": {"include_usage": True}, "n": 1, "max_completion_tokens": 3}
    assert check_fields(body, True) == body


@pytest.mark.parametrize("chat", [True, False])
def test_cache_salt_and_user_pass_through_they_scope_the_prefix_caches(chat):
    body = {**(CHAT if chat else COMPLETION), "cache_salt": "s-1", "user": "u-1"}
    assert check_fields(body, chat) == body


def test_message_fields_other_than_role_content_name_are_refused():
    ok = {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "ann", "tool_calls": None}]}
    assert check_fields(ok, True)["messages"] == ok["messages"]
    bad = {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}
    with pytest.raises(ParamRefused, match=r"messages\[0\]\.tool_calls"):
        check_fields(bad, True)


def test_every_refused_field_has_a_rule():
    from swarm.serve.params import _REFUSED

    assert CHAT_REFUSED | COMPLETION_REFUSED <= set(_REFUSED)
    for honoured, noop, refused in ((CHAT_HONOURED, CHAT_NOOP, CHAT_REFUSED),
                                    (COMPLETION_HONOURED, COMPLETION_NOOP, COMPLETION_REFUSED)):
        assert not (honoured & noop) and not (honoured & refused) and not (noop & refused)


def test_load_body_takes_json_up_to_the_depth_limit_and_refuses_past_it():
    from swarm.serve.params import MAX_DEPTH, InvalidBody, load_body

    def nested(levels: int) -> bytes:  # the object is level 0, its field's value level 1, ...
        return ('{"metadata": ' + "[" * levels + "]" * levels + "}").encode()

    doc = load_body(nested(MAX_DEPTH))["metadata"]
    for _ in range(MAX_DEPTH - 1):
        (doc,) = doc
    assert doc == []
    with pytest.raises(InvalidBody, match="nested deeper") as err:
        load_body(nested(MAX_DEPTH + 1))
    assert err.value.param == "metadata"


def test_load_body_takes_unicode_text_and_refuses_lone_surrogates():
    from swarm.serve.params import InvalidBody, load_body

    assert load_body('{"prompt": "caf\u00e9 \U0001F600"}'.encode())["prompt"] == "caf\u00e9 \U0001F600"
    assert load_body(b'{"prompt": "\\ud83d\\ude00"}')["prompt"] == "\U0001F600"  # an escaped pair is one character
    for raw in (b'{"a": "\\ud83d"}', b'{"a": ["x", {"b": "\\udfff"}]}', b'{"a": "\\ude00\\ud83d"}'):
        with pytest.raises(InvalidBody, match="lone surrogate") as err:
            load_body(raw)
        assert err.value.param == "a"


def test_load_body_skips_a_utf8_bom_and_names_a_utf16_or_utf32_one():
    from swarm.serve.params import InvalidBody, load_body

    doc = {"prompt": "caf\u00e9 \ufeff inside", "max_tokens": 3}  # a BOM character inside a string is text
    raw = json.dumps(doc, ensure_ascii=False).encode()
    assert load_body(b"\xef\xbb\xbf" + raw) == load_body(raw) == doc
    assert load_body(b"\xef\xbb\xbf\n  " + raw) == doc
    for encoding, name in (("utf-16", "UTF-16 LE"), ("utf-32", "UTF-32 LE")):
        with pytest.raises(InvalidBody, match=f"not valid UTF-8: it starts with a {name} byte order mark"):
            load_body(raw.decode().encode(encoding))
    with pytest.raises(InvalidBody, match="not valid JSON"):  # one BOM is skipped, not any number
        load_body(b"\xef\xbb\xbf\xef\xbb\xbf" + raw)

"""`swarm serve`'s request handling, in process: the real Starlette app of ``build_app`` over the
real stories260k tokenizer and no ring. Every request here is answered before a ring would be used
(refused, parsed, or a route that needs none), so none is needed; `tests/serve/test_serve.py` drives
generation through a real ring.

Chat requests use stories260k's tokenizer with a Llama-2-style chat template, which refuses
messages whose roles do not alternate through jinja's ``raise_exception`` (as Llama 2's and
Mistral's templates do: vLLM #17119).
"""

from __future__ import annotations

import json
import time

import openai
import pytest
from starlette.testclient import TestClient

from swarm.serve.app import build_app
from swarm.serve.config import ServeConfig, check_origins
from swarm.serve.requests import COMPLETION_DEFAULT_MAX_TOKENS, ApiError, parse_request
from swarm.serve.state import ServeState

LLAMA2_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stories_dir))
    tok.chat_template = LLAMA2_TEMPLATE
    return tok


def make_state(tokenizer, **config) -> ServeState:
    """A ServeState over ``tokenizer`` and no ring; ``config``: ServeConfig fields."""
    from swarm.serve.metrics import ServeMetrics

    state = ServeState(config=ServeConfig.of(**config), ring=None, host=None, nursery=None, tokenizer=tokenizer,
                       model_id="stories260k", model_dir=None, num_layers=5, model_digest="", stop_ids={2},
                       max_ctx=512)
    state.metrics = ServeMetrics(state)
    return state


@pytest.fixture
def served(tokenizer):
    state = make_state(tokenizer)
    with TestClient(build_app(state), backend="trio", raise_server_exceptions=False) as client:
        yield state, client


def invalid(state) -> int:
    return state.metrics.requests.get("invalid", 0)


def assert_openai_400(res, param):
    assert res.status_code == 400, (res.status_code, res.text)
    assert res.headers["content-type"].startswith("application/json"), res.headers
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert err["param"] == param and err["message"], err
    return err["message"]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"role": "user", "content": "hi"}


# Each case is raw request bytes, as a client can send them: the body is not re-encoded by a JSON library
@pytest.mark.parametrize("path, raw, param, says", [
    # a chat template that raises (roles must alternate) and one whose first message is not the user's
    (CHAT, json.dumps({"messages": [USER, USER]}), "messages", "roles must alternate"),
    (CHAT, json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}), "messages", "roles must alternate"),
    # lone surrogates (llama.cpp #6396): valid JSON, not Unicode text, in any string and in a key
    (COMPLETIONS, '{"prompt": "\\ud83d"}', "prompt", "lone surrogate"),
    (COMPLETIONS, '{"prompt": ["Once \\udc00 upon"]}', "prompt", "lone surrogate"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages", r"messages\[0\].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', "messages",
     "lone surrogate"),
    (COMPLETIONS, '{"prompt": "x", "stop": ["\\udfff"]}', "stop", "lone surrogate"),
    (COMPLETIONS, '{"prompt": "x", "\\ud83d": 1}', None, "lone surrogate"),
    # deep nesting (llama.cpp #26600): past the interpreter's stack, and past the limit but within it
    (COMPLETIONS, '{"prompt": ' + "[" * 1000 + "]" * 1000 + "}", None, "nested deeper"),
    (COMPLETIONS, '{"prompt": "x", "metadata": ' + "[" * 200 + "]" * 200 + "}", "metadata", "nested deeper"),
    (CHAT, '{"messages": ' + '{"a": ' * 100 + "1" + "}" * 100 + "}", "messages", "nested deeper"),
    # not UTF-8, not JSON, not an object
    (COMPLETIONS, b'{"prompt": "caf\xe9"}', None, "not valid UTF-8.*0xe9"),
    (COMPLETIONS, b'\xff\xfe{\x00}\x00', None, "not valid UTF-8"),
    (COMPLETIONS, '{"prompt": "x", "temperature": NaN}', None, "NaN is not a JSON value"),
    (COMPLETIONS, '{"prompt": "x",', None, "not valid JSON"),
    (COMPLETIONS, '["prompt"]', None, "JSON object"),
    # wrong types in the fields
    (CHAT, '{"messages": "hi"}', "messages", "non-empty list"),
    (CHAT, '{"messages": [["user", "hi"]]}', "messages", "needs a role"),
    (CHAT, '{"messages": [{"role": ["user"], "content": "hi"}]}', "messages", "needs a role"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "messages", r"content\[0\] is of type 'image_url'"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "input_audio"}, "hi"]}]}', "messages",
     "only text parts"),
    (CHAT, '{"messages": [{"role": "user", "content": ["hi"]}]}', "messages", "not a text part"),
    (CHAT, '{"messages": [{"role": "user", "content": 7}]}', "messages", "must be a string"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": 3}]}', "messages", "name must be a string"),
    (COMPLETIONS, '{"prompt": "x", "n": "1"}', "n", "only n=1"),
    (COMPLETIONS, '{"prompt": "x", "n": true}', "n", "only n=1"),
    (COMPLETIONS, '{"prompt": "x", "model": 5}', "model", "must be a string"),
    (COMPLETIONS, '{"prompt": "x", "model": ["stories260k"]}', "model", "must be a string"),
    (COMPLETIONS, '{"prompt": "x", "max_tokens": "5"}', "max_tokens", "integer"),
    (COMPLETIONS, '{"prompt": "x", "temperature": "hot"}', "temperature", "a number"),
    (COMPLETIONS, '{"prompt": "x", "temperature": 1' + "0" * 400 + '}', "temperature", "a number"),
    (COMPLETIONS, '{"prompt": "x", "top_p": 1' + "0" * 400 + '}', "top_p", "a number"),
    (COMPLETIONS, '{"prompt": "x", "seed": 1.5}', "seed", "an integer"),
    (COMPLETIONS, '{"prompt": "x", "seed": 1' + "0" * 30 + '}', "seed", "an integer"),
    (COMPLETIONS, '{"prompt": [1, 2, 3]}', "prompt", "must be a string"),
    (COMPLETIONS, '{"prompt": {"text": "x"}}', "prompt", "must be a string"),
    (COMPLETIONS, '{"prompt": "x", "stop": [1]}', "stop", "stop"),
    (COMPLETIONS, '{"prompt": "x", "stream": "yes"}', "stream", "true or false"),
    (COMPLETIONS, '{"prompt": "x", "stream_options": "usage"}', "stream_options", "an object"),
    (COMPLETIONS, '{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options", "true or false"),
    (COMPLETIONS, '{"prompt": "x", "stream_options": {"usage": true}}', "stream_options", "stream_options.usage"),
    (COMPLETIONS, '{"prompt": "x", "logprobs": [1]}', "logprobs", "not supported"),
])
def test_malformed_input_is_a_400_in_openais_shape_counted_invalid(served, path, raw, param, says):
    import re

    state, client = served
    before = invalid(state)
    res = client.post(path, content=raw.encode() if isinstance(raw, str) else raw,
                      headers={"content-type": "application/json"})
    message = assert_openai_400(res, param)
    assert re.search(says, message), message
    assert invalid(state) == before + 1


def test_a_raising_chat_template_is_not_retried_by_the_openai_client(served):
    """The openai client retries a 500 (three times by default: vLLM #17119), never a 400."""
    state, client = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=3)
    with pytest.raises(openai.BadRequestError, match="roles must alternate"):
        api.chat.completions.create(model="stories260k", messages=[USER, USER], max_tokens=2)
    assert invalid(state) == 1  # one request, not four


def test_a_fault_of_the_server_is_a_500_with_an_openai_body(tokenizer):
    """A handler that fails (here /health over a state that has no ring: a server bug, not the
    client's) answers 500 with ``server_error`` in OpenAI's shape, not text/plain."""
    with TestClient(build_app(make_state(tokenizer)), backend="trio", raise_server_exceptions=False) as client:
        res = client.get("/health")
    assert res.status_code == 500 and res.headers["content-type"].startswith("application/json")
    err = res.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and "AttributeError" in err["message"]


def test_a_tokenizer_failure_the_checks_did_not_foresee_is_the_clients_400():
    """parse_request's catch-all: anything the request's content makes the tokenizer raise is a 400."""
    class Refuses:
        def __call__(self, text, **kw):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")

    state = make_state(Refuses())
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": "x"}, state, chat=False)
    assert err.value.status == 400 and err.value.param == "prompt" and "TextEncodeInput" in err.value.message


# ---- item 11: what OpenAI accepts is accepted with its meaning -------------------------------------------


@pytest.mark.parametrize("fields", [{"top_p": 0}, {"top_p": 0.0, "temperature": 0.7}, {"temperature": 1e-5},
                                    {"temperature": 0.00009}, {"temperature": 0}, {"temperature": 5e-324}])
def test_top_p_0_and_tiny_temperatures_are_greedy(tokenizer, fields):
    req = parse_request({"prompt": "Once upon a time", **fields}, make_state(tokenizer), chat=False)
    assert req.sampling.greedy and req.sampling.top_p == 1.0


def test_a_temperature_of_1e_4_and_more_still_samples(tokenizer):
    req = parse_request({"prompt": "Once", "temperature": 1e-4, "top_p": 1e-9}, make_state(tokenizer), chat=False)
    assert not req.sampling.greedy and req.sampling.temperature == 1e-4 and req.sampling.top_p == 1e-9


def test_seeds_any_64_bit_integer_and_minus_1_is_no_seed(tokenizer):
    state = make_state(tokenizer)

    def seed(value):
        return parse_request({"prompt": "x", "seed": value}, state, chat=False).sampling.seed

    assert len({seed(-1) for _ in range(8)}) > 1  # random, like no seed at all
    assert seed(-5) == seed(-5) == 2**63 - 5  # deterministic: taken modulo 2^63
    assert seed(-2**63) == 0 and seed(2**64 - 1) == 2**63 - 1 and seed(7) == 7
    for bad in (-2**63 - 1, 2**64):
        with pytest.raises(ApiError, match="'seed' must be an integer"):
            seed(bad)


@pytest.mark.parametrize("fields", [{"temperature": -0.1}, {"temperature": 2.5}, {"top_p": 1.5}, {"top_p": -1},
                                    {"max_tokens": 0}, {"seed": "1"}, {"n": 3}])
def test_api_errors_name_api_fields_not_command_line_flags(tokenizer, fields):
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": "x", **fields}, make_state(tokenizer), chat=False)
    (name,) = fields
    assert err.value.status == 400 and err.value.param == name and "--" not in err.value.message, err.value.message


# ---- item 12: GET /v1/models/{id}, CORS --------------------------------------------------------------------


def test_models_retrieve_and_a_real_created_time(served):
    state, client = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    got = api.models.retrieve("stories260k")
    assert got.id == "stories260k" and got.object == "model" and abs(got.created - time.time()) < 600
    (listed,) = api.models.list().data
    assert listed.created == got.created == state.created
    for other in ("gpt-4o", "org/model-7b", "stories260k/extra"):
        with pytest.raises(openai.NotFoundError) as err:
            api.models.retrieve(other)
        assert err.value.code == "model_not_found" and other in err.value.message
    assert client.get("/v1/nothing").json()["error"]["code"] == "not_found"  # other paths: still no route


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_without_cors_origins_a_preflight_gets_no_cors_headers(served):
    _, client = served
    res = client.options(CHAT, headers={"Origin": "https://app.example", **PREFLIGHT})
    assert res.status_code == 204 and "POST" in res.headers["allow"]
    assert not any(h.startswith("access-control-") for h in res.headers)  # the browser refuses: same origin only
    post = client.post(COMPLETIONS, json={"prompt": 3}, headers={"Origin": "https://app.example"})
    assert post.status_code == 400 and "access-control-allow-origin" not in post.headers
    wrong = client.put(CHAT, json={})
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]


def test_an_allowed_origin_gets_its_preflight_and_cors_headers(tokenizer):
    state = make_state(tokenizer, cors_origins=("https://app.example", "http://localhost:3000"))
    with TestClient(build_app(state), backend="trio", raise_server_exceptions=False) as client:
        ok = client.options(CHAT, headers={"Origin": "https://app.example", **PREFLIGHT})
        other = client.options(CHAT, headers={"Origin": "https://evil.example", **PREFLIGHT})
        models = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        refused = client.post(COMPLETIONS, json={"prompt": 3}, headers={"Origin": "https://app.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert refused.status_code == 400 and refused.headers["access-control-allow-origin"] == "https://app.example"


def test_cors_origin_star_allows_any_origin(tokenizer):
    with TestClient(build_app(make_state(tokenizer, cors_origins=("*",))), backend="trio") as client:
        res = client.options(COMPLETIONS, headers={"Origin": "https://anything.example", **PREFLIGHT})
    assert res.status_code == 200 and res.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("origin", ["https://app.example/", "app.example", "https://app.example/v1", ""])
def test_a_cors_origin_that_is_not_an_origin_is_refused(origin):
    from swarm.errors import ConfigError

    with pytest.raises(ConfigError, match="--cors-origin"):
        check_origins([origin])
    assert check_origins(["*", "https://a.example:8443"]) == ("*", "https://a.example:8443")


# ---- item 13: special-token text in a completion prompt stays text ---------------------------------------


@pytest.mark.parametrize("prompt", ["<s>Once upon a time", "Once upon a time</s> The end", "<unk> and <s></s>"])
def test_typed_special_tokens_in_a_completion_prompt_stay_text(tokenizer, prompt):
    from swarm.coordinator.generation import encode_prompt

    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    ids = parse_request({"prompt": prompt}, make_state(tokenizer), chat=False).prompt_ids
    assert ids[0] == tokenizer.bos_token_id  # the tokenizer's own BOS, once
    assert not specials & set(ids[1:]), ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt
    assert encode_prompt(tokenizer, prompt, chat=False) == ids  # `swarm coordinate --prompt` too
    plain = parse_request({"prompt": "Once upon a time"}, make_state(tokenizer), chat=False).prompt_ids
    assert plain == list(tokenizer("Once upon a time")["input_ids"])  # text without them: as before


# ---- issue 45: the default length, a body with a BOM, a client hanging up during its upload --------------


@pytest.mark.parametrize("chat, body", [(True, {"messages": [USER]}), (False, {"prompt": "Once upon a time"}),
                                        (True, {"messages": [USER], "max_tokens": None}),
                                        (False, {"prompt": "Once upon a time", "max_completion_tokens": None})])
def test_without_max_tokens_an_answer_may_fill_the_context(tokenizer, chat, body):
    """As OpenAI and vLLM: a chat without a limit may use what the context leaves after the prompt (not
    256); a completion gets the legacy API's 16."""
    state = make_state(tokenizer)
    state.max_ctx = 4096
    req = parse_request(body, state, chat=chat)
    assert req.max_tokens == (4096 - len(req.prompt_ids) if chat else COMPLETION_DEFAULT_MAX_TOKENS)
    assert parse_request(body | {"max_tokens": 300}, state, chat=chat).max_tokens == 300


@pytest.mark.parametrize("path, raw, param", [
    (COMPLETIONS, b'\xef\xbb\xbf{"prompt": "x", "temperature": 7}', "temperature"),
    (COMPLETIONS, b'\xef\xbb\xbf \r\n{"prompt": "x", "max_tokens": 0}', "max_tokens"),  # the BOM, then white space
    (CHAT, b'\xef\xbb\xbf{"messages": [], "max_tokens": 2}', "messages"),
])
def test_a_body_starting_with_a_utf8_bom_is_read_past_it(served, path, raw, param):
    """The BOM is skipped: the answer is about the request's own fields (here each has a fault, so no
    ring is needed), not "Unexpected UTF-8 BOM"."""
    state, client = served
    message = assert_openai_400(client.post(path, content=raw, headers={"content-type": "application/json"}), param)
    assert "BOM" not in message and "byte order mark" not in message


async def _call_app(app, messages: list[dict]) -> list[dict]:
    """Run one POST /v1/completions through the ASGI app as hypercorn would: ``messages`` are what
    the client's connection delivers; returns what the app sent."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": COMPLETIONS, "raw_path": COMPLETIONS.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    incoming, sent = list(messages), []

    async def receive():
        if incoming:
            return incoming.pop(0)
        import trio

        await trio.sleep_forever()

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("received", [[], [b'{"prompt": "Once'], [b'{"prompt": ', b'"Once upon a']])
def test_a_client_hanging_up_during_its_upload_is_abandoned_not_a_server_error(tokenizer, caplog, received):
    import logging

    import trio

    state = make_state(tokenizer)
    messages = [{"type": "http.request", "body": part, "more_body": True} for part in received]
    caplog.set_level(logging.INFO)
    sent = trio.run(_call_app, build_app(state), messages + [{"type": "http.disconnect"}])  # does not raise
    assert state.metrics.requests == {"abandoned": 1}
    assert [r.levelname for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [r.getMessage() for r in caplog.records] == ["request.abandoned path=/v1/completions during=upload"]
    assert sent[0]["status"] == 499  # no one reads it: logged by hypercorn's access log as what it was

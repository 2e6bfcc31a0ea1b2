"""Requests of ``swarm serve``: from an HTTP body to a validated ``Request``, or an OpenAI-shaped error.

Owns: ``ApiError`` and its response, a body read under the size limit, the prompt's size check before
tokenizing, and ``parse_request`` (every field checked, ``swarm.serve.params`` saying which are honoured, the
chat template and tokenizer applied), run in a worker thread by ``parse_body``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.config import SamplingParams
from swarm.errors import ConfigError

if TYPE_CHECKING:
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse
    from transformers import PreTrainedTokenizerBase

    from swarm.serve.state import ServeState

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: int | None = None):
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate, shown escaped
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s  # the Retry-After header of a 429/503 (default 1 s)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's and vLLM's
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt has no bound; a salt only needs to be unguessable
MAX_USER_CHARS = 256  # OpenAI's user: "a unique identifier representing your end-user"


@dataclass
class Request:
    """A validated completion request. ``max_tokens``: the client's, or (none given) for a chat what the
    ring's context leaves after the prompt, for a completion ``COMPLETION_DEFAULT_MAX_TOKENS``."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool
    cache_scope: str = ""  # which requests share prefix-cache blocks (``cache_scope``); "" = the shared pool


def error_response(err: ApiError) -> JSONResponse:
    """``err`` as a JSON response; a 429 or 503 carries Retry-After (default 1 s)."""
    from starlette.responses import JSONResponse

    retry = {"Retry-After": str(err.retry_after_s or 1)} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=retry)


# ---- request parsing ----------------------------------------------------------------------------

SEED_RANDOM = -1  # seed -1 asks for a random seed (llama.cpp, TGI, many UIs send it)
GREEDY_BELOW = 1e-4  # a temperature in (0, this) samples as greedy: logits / T would overflow


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if ok and not integer and isinstance(value, int):  # an int too large for a float is out of range anyway
        ok = -2**53 <= value <= 2**53
    if not ok or isinstance(value, bool) or (not integer and not math.isfinite(value)) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        span = f"[{int(lo)}, {int(hi)}]" if integer else f"[{lo:g}, {hi:g}]"
        raise ApiError(400, f"'{name}' must be {kind} in {span}, got {_shown(value)}", name)
    return value


def parse_request(body, state: ServeState, chat: bool) -> Request:
    """Validate an OpenAI request body (a parsed JSON document, see ``swarm.serve.params.load_body``).

    Everything a client sends is checked here, and nothing it sends can make this raise anything
    but ApiError: a value the checks did not foresee that makes the chat template or the tokenizer
    fail is the client's input too, and answered 400.

    Raises:
        ApiError: 400 naming the first bad parameter (``invalid_request_error``), 404 for another
            model; 500 (``server_error``) only where the server itself failed (e.g. it cannot read
            its tokenizer's files).
    """
    try:
        return _parse(body, state, chat)
    except ApiError:
        raise
    except (OSError, MemoryError) as exc:  # the server's own resources, not the request
        log.exception("request.parse_failed reason=%s", exc)
        raise ApiError(500, f"the server failed reading the request: {type(exc).__name__}: {exc}", None,
                       "internal_error", "server_error") from None
    except Exception as exc:  # e.g. a template's raise_exception, a tokenizer refusing a string
        log.warning("request.unparsable reason=%s: %s", type(exc).__name__, exc,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        raise ApiError(400, f"the request could not be processed: {type(exc).__name__}: {exc}",
                       "messages" if chat else "prompt") from None


def _parse(body, state: ServeState, chat: bool) -> Request:
    from swarm.serve.params import ParamRefused, check_fields

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = check_fields(body, chat)  # null = default; unknown or unsupported fields are refused by name
    except ParamRefused as exc:
        raise ApiError(400, str(exc), exc.param) from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {type(model).__name__}", "model")
    if model is not None and model != state.model_id:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves {state.model_id!r}",
                       "model", "model_not_found")
    n = body.get("n", 1)
    if n != 1 or not isinstance(n, int) or isinstance(n, bool):
        raise ApiError(400, f"only n=1 is supported (one choice per request), got {_shown(n)}", "n")
    if chat:
        prompt_ids = _chat_ids(body.get("messages"), state.tokenizer)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (or a list of one string)", "prompt")
        prompt_ids = _prompt_ids(state.tokenizer, prompt)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty after tokenization", "prompt")
    if len(prompt_ids) >= state.max_ctx:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the ring's maximum context is {state.max_ctx}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # without a limit, as OpenAI and vLLM: a chat may use what the ring's context leaves after the prompt,
    # a completion COMPLETION_DEFAULT_MAX_TOKENS (the legacy API's default, and vLLM's)
    default = state.max_ctx - len(prompt_ids) if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, state.max_ctx - len(prompt_ids))
    max_tokens = _number(body, name, default, 1, 2**31 - 1, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0 or temperature < GREEDY_BELOW:  # both keep only the most likely token: greedy
        temperature, top_p = 0.0, 1.0
    seed = _number(body, "seed", None, -2**63, 2**64 - 1, integer=True)
    if seed is None or seed == SEED_RANDOM:
        seed = secrets.randbits(31)  # like OpenAI: unseeded requests differ
    seed %= 2**63  # any other 64-bit seed (signed or not) is a seed, as OpenAI takes it
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    unknown = sorted(set(opts) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise ApiError(400, f"unrecognized field stream_options.{unknown[0]}", "stream_options")
    if not isinstance(opts.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false", "stream_options")
    try:
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), seed=int(seed))
    except ConfigError as exc:  # not reached with the checks above; its text names command-line flags
        raise ApiError(400, f"'temperature', 'top_p' or 'seed' is out of range ({exc})", "temperature") from None
    scope = cache_scope(_bounded_text(body, "cache_salt", MAX_CACHE_SALT_CHARS, empty=False),
                        _bounded_text(body, "user", MAX_USER_CHARS, empty=True))
    return Request(prompt_ids, max_tokens, sampling, stop, stream, bool(opts.get("include_usage")), chat, scope)


def _bounded_text(body: dict, name: str, max_chars: int, empty: bool) -> str | None:
    """``body[name]`` checked to be a string of at most ``max_chars`` characters (non-empty unless
    ``empty``), or None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_chars or (not empty and not value):
        least = 0 if empty else 1
        raise ApiError(400, f"'{name}' must be a string of {least}..{max_chars} characters, got {_shown(value)}", name)
    return value


def cache_scope(cache_salt: str | None, user: str | None) -> str:
    """Which requests share the stages' prefix caches: only those with the same scope (the coordinator
    mixes it into the namespace that roots every stage's block keys, so blocks, ``cached_tokens`` and the
    prefill time saved never cross scopes).

    Args:
        cache_salt: the request's ``cache_salt`` (vLLM's field): requests with the same salt share,
            whatever their ``user``; a salt shares with no request without it.
        user: the request's ``user`` (OpenAI's end-user id), used when there is no salt: requests of
            the same user share.
    Returns:
        "" for a request with neither (the one pool such requests share, as before salts existed),
        else a SHA-256 hex digest, tagged so that a salt never equals a ``user`` of the same text.
    """
    if cache_salt is not None:
        tagged = "cache_salt\n" + cache_salt
    elif user:
        tagged = "user\n" + user
    else:
        return ""
    return hashlib.sha256(tagged.encode("utf-8")).hexdigest()


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a completion prompt: the tokenizer's own BOS, and the prompt as literal text, so
    a typed ``<s>`` or ``<|endoftext|>`` stays those characters (as message content does in
    ``swarm.coordinator.chat``) instead of forging a control token."""
    return list(tokenizer(prompt, split_special_tokens=True)["input_ids"])


def _chat_ids(messages, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of message objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                m["role"] not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or developer", "messages")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ApiError(400, f"messages[{i}].name must be a string", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind != "text" or not isinstance(p.get("text"), str):
                    what = f"of type {_shown(kind)}" if kind not in (None, "text") else "not a text part"
                    raise ApiError(400, f"messages[{i}].content[{j}] is {what}: only text parts "
                                        '({"type": "text", "text": "..."}) are supported', "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    from swarm.coordinator.chat import ChatTemplateError, NoChatTemplate, encode_chat

    try:
        return encode_chat(tokenizer, clean)  # content is literal text: a typed <|im_end|> ends no turn
    except NoChatTemplate:
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages") from None
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None
    except Exception as exc:  # the template refused these messages (jinja's raise_exception, a bad role order)
        raise ApiError(400, f"the model's chat template refused the messages: {exc}", "messages") from None


# ---- the body and the prompt's size ------------------------------------------------------------


async def read_body(request: HttpRequest, limit_bytes: int) -> bytes:
    """The request body, at most ``limit_bytes`` of it.

    Raises:
        ApiError: 413 when the body is larger (by its Content-Length, or while reading); the rest is
            read and dropped, up to 16 times the limit, so the client reads the answer, not a reset.
    """
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit_bytes} bytes "
                              "(--max-body-mb)", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    parts, size = [], 0
    dropping = declared.isdigit() and int(declared) > limit_bytes
    async for part in request.stream():
        size += len(part)
        if size > limit_bytes:
            dropping = True
        if dropping:
            if size > 16 * limit_bytes:
                break
            continue
        parts.append(part)
    if dropping:
        raise too_large
    return b"".join(parts)


def parse_body(raw: bytes, state: ServeState, chat: bool) -> Request:
    """JSON, the prompt's size, then ``parse_request`` (templating, tokenizing); run in a worker thread.

    Raises:
        ApiError: 400 for a body that is not JSON or a prompt that cannot fit the ring's context
            (``context_length_exceeded``, found by its characters before tokenizing), and every error
            of ``parse_request``.
    """
    from swarm.serve.params import InvalidBody, load_body

    try:
        body = load_body(raw)  # UTF-8, JSON, not too deep, no lone surrogates
    except InvalidBody as exc:
        raise ApiError(400, str(exc), exc.param) from None
    if isinstance(body, dict) and state.max_prompt_chars:
        chars = prompt_chars(body, chat)
        if chars > state.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters: more tokens than the ring's maximum context of "
                                f"{state.max_ctx} (at most {state.max_prompt_chars} characters fit with this "
                                "tokenizer)", "messages" if chat else "prompt", "context_length_exceeded")
    return parse_request(body, state, chat)


def prompt_chars(body: dict, chat: bool) -> int:
    """Characters of a request's prompt text (a chat's message contents), counting only values of
    the right type (``parse_request`` reports the others)."""
    def text(value) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):  # a completion's prompt list, a message's content parts
            return sum(text(v.get("text") if isinstance(v, dict) else v) for v in value)
        return 0

    if not chat:
        return text(body.get("prompt"))
    messages = body.get("messages")
    return sum(text(m.get("content")) for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_ctx: int) -> int:
    """The most characters a prompt of fewer than ``max_ctx`` tokens can have: ``max_ctx`` times the
    longest token's characters (a token never decodes to more characters than its vocabulary
    string has; a chat template only adds tokens). A longer prompt is refused without tokenizing."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max_ctx * max((len(p) for p in pieces if p), default=1)

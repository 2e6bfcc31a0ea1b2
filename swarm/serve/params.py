"""Which fields of an OpenAI request swarm honours, accepts as a no-op, or refuses by name.

Owns: the decision for every field of the chat-completions and completions bodies, so nothing that would change
the answer is silently ignored (:class:`ParamRefused`, a 400 naming the field), and :func:`load_body` (UTF-8 JSON
at most :data:`MAX_DEPTH` deep, no lone surrogate). Pure, standard library only. The rules: docs/architecture.md.
"""

from __future__ import annotations

import json
from typing import Any

UTF8_BOM = b"\xef\xbb\xbf"
OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 LE"), (b"\x00\x00\xfe\xff", "UTF-32 BE"), (b"\xff\xfe", "UTF-16 LE"),
              (b"\xfe\xff", "UTF-16 BE"))  # longest first: UTF-32 LE's starts with UTF-16 LE's
MAX_DEPTH = 32  # JSON nesting a request may have; OpenAI's deepest (content parts, stream_options) is 4

COMMON_HONOURED = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                             "stream_options", "n", "cache_salt", "user"})  # the last two scope the prefix caches
CHAT_HONOURED = COMMON_HONOURED | {"messages", "max_completion_tokens"}
COMPLETION_HONOURED = COMMON_HONOURED | {"prompt"}

CHAT_NOOP = frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                       "prompt_cache_retention", "parallel_tool_calls", "prediction", "verbosity"})
COMPLETION_NOOP: frozenset[str] = frozenset()


def _neutral_tool_choice(value: Any) -> bool:
    return value in ("none", "auto")


# field -> (is this value neutral?, why it is refused otherwise)
_REFUSED: dict[str, tuple] = {
    "frequency_penalty": (lambda v: v == 0 and not isinstance(v, bool), "penalties are not supported"),
    "presence_penalty": (lambda v: v == 0 and not isinstance(v, bool), "penalties are not supported"),
    "logit_bias": (lambda v: v == {}, "logit_bias is not supported"),
    "logprobs": (lambda v: v is False, "log probabilities are not returned"),
    "top_logprobs": (lambda v: v == 0 and not isinstance(v, bool), "log probabilities are not returned"),
    "tools": (lambda v: v == [], "tool calling is not supported"),
    "tool_choice": (_neutral_tool_choice, "tool calling is not supported"),
    "functions": (lambda v: v == [], "function calling is not supported"),
    "function_call": (_neutral_tool_choice, "function calling is not supported"),
    "response_format": (lambda v: v == {"type": "text"}, "only plain text responses are supported"),
    "modalities": (lambda v: v == ["text"], "only text output is supported"),
    "audio": (lambda v: False, "audio output is not supported"),
    "reasoning_effort": (lambda v: False, "reasoning_effort is not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "best_of is not supported"),
    "echo": (lambda v: v is False, "echo is not supported"),
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported"),
}
CHAT_REFUSED = frozenset({"frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "tools",
                          "tool_choice", "functions", "function_call", "response_format", "modalities", "audio",
                          "reasoning_effort", "web_search_options"})
COMPLETION_REFUSED = frozenset({"frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "best_of", "echo",
                                "suffix"})

MESSAGE_FIELDS = frozenset({"role", "content", "name"})  # name: a participant label, not sent to the model


class ParamRefused(ValueError):
    """A request field swarm cannot honour (or does not know). ``param`` names it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class InvalidBody(ParamRefused):
    """A request body that is not a usable JSON document; ``param`` names the top-level field that
    holds the fault, or is None when the fault is in the document as a whole."""


def load_body(raw: bytes) -> Any:
    """The JSON document of a request body, checked to be text every tokenizer can take.

    Args:
        raw: the request body as received.
    Returns:
        The parsed document (any JSON value: the caller checks that it is an object).
    Raises:
        InvalidBody: the bytes are not UTF-8 (names the offset and byte, or the UTF-16 / UTF-32 byte
            order mark it starts with; a UTF-8 one is skipped), not JSON (names line and
            column; also ``NaN``/``Infinity``, which JSON does not have), nested deeper than
            ``MAX_DEPTH``, or a string holds a lone UTF-16 surrogate (names where).
    """
    if raw.startswith(UTF8_BOM):  # JSON parsers may ignore it (RFC 8259, 8.1); Windows tools write one
        raw = raw[len(UTF8_BOM):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        other = next((name for mark, name in OTHER_BOMS if raw.startswith(mark)), None)
        if other is not None:
            raise InvalidBody(None, f"the request body is not valid UTF-8: it starts with a {other} byte order "
                                    "mark (JSON on the network is UTF-8, RFC 8259)") from None
        raise InvalidBody(None, f"the request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                                f"{exc.start})") from None

    def no_constant(name):
        raise ValueError(f"{name} is not a JSON value")

    try:
        doc = json.loads(text, parse_constant=no_constant)
    except RecursionError:  # deeper than the interpreter's stack (about 1,000 levels)
        raise InvalidBody(None, f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidBody(None, f"the request body is not valid JSON: {exc}") from None
    _check_tree(doc)
    return doc


def _check_tree(doc: Any) -> None:
    """Refuse nesting past MAX_DEPTH and strings (keys too) that are not valid Unicode; iterative,
    so a deep document cannot exhaust the stack here."""
    todo = [(doc, "", 0)]
    while todo:
        value, path, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise InvalidBody(_top(path), f"the request body is nested deeper than {MAX_DEPTH} levels (at {path})")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                shown = k.encode("utf-8", "backslashreplace").decode("utf-8")  # the path is shown in errors
                sub = f"{path}.{shown}" if path else shown
                _check_text(k, f"the field name {sub}", path)
                todo.append((v, sub, depth + 1))
        elif isinstance(value, list):
            todo.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_text(text: str, where: str, path: str | None = None) -> None:
    """Refuse a string with a lone surrogate; ``where`` names it in the message, ``path`` (default
    ``where``) is where it lies, for the error's ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidBody(_top(where if path is None else path),
                          f"{where or 'the request body'} holds a lone surrogate (U+{ord(text[exc.start]):04X} at "
                          f"character {exc.start}), which is not Unicode text; encode characters outside the BMP "
                          "as a surrogate pair or as UTF-8") from None


def _top(path: str) -> str | None:
    """The top-level field of a path such as ``messages[0].content``."""
    for i, ch in enumerate(path):
        if ch in ".[":
            return path[:i] or None
    return path or None


def check_fields(body: dict, chat: bool) -> dict:
    """Drop ``null`` fields, then refuse every field that swarm would otherwise ignore.

    Args:
        body: the parsed JSON object of a request.
        chat: True for ``/v1/chat/completions``, False for ``/v1/completions``.
    Returns:
        A copy of ``body`` without its ``null`` fields (and without a ``null`` inside
        ``stream_options``), for ``parse_request`` to read the honoured fields from.
    Raises:
        ParamRefused: the first field (in body order) that is unknown or carries a value swarm
            cannot honour; ``param`` names it.
    """
    honoured, noop, refused = ((CHAT_HONOURED, CHAT_NOOP, CHAT_REFUSED) if chat else
                               (COMPLETION_HONOURED, COMPLETION_NOOP, COMPLETION_REFUSED))
    out = {}
    for name, value in body.items():
        if value is None:
            continue  # null: the default
        if name in honoured:
            out[name] = value
        elif name in noop:
            continue
        elif name in refused:
            neutral, why = _REFUSED[name]
            try:
                ok = neutral(value)
            except TypeError:
                ok = False
            if not ok:
                raise ParamRefused(name, f"'{name}' is not supported by swarm ({why}); got {_short(value)}")
        else:
            endpoint = "chat completions" if chat else "completions"
            raise ParamRefused(name, f"unrecognized request argument supplied to {endpoint}: '{name}'")
    if isinstance(out.get("stream_options"), dict):
        out["stream_options"] = {k: v for k, v in out["stream_options"].items() if v is not None}
    if chat and isinstance(out.get("messages"), list):
        for i, m in enumerate(out["messages"]):
            if isinstance(m, dict):
                extra = [k for k, v in m.items() if k not in MESSAGE_FIELDS and v is not None]
                if extra:
                    raise ParamRefused("messages", f"messages[{i}].{extra[0]} is not supported by swarm "
                                                   "(only role, content and name)")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

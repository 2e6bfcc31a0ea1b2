"""Chat prompts to token ids with the model's chat template, control text in messages kept literal.

Owns: :func:`encode_chat` and :func:`encode_chat_flag` (its command-line form), on any transformers tokenizer
passed in: only the template's own markers become control tokens, so a typed ``<|im_end|>`` cannot close a
turn and forge others (docs/architecture.md). Used by ``swarm coordinate --chat`` and ``swarm serve``.
"""

from __future__ import annotations

import json
import re
import secrets
import weakref

from swarm.errors import ConfigError


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or its template alters message content so that it cannot
    be located in the rendered prompt."""


class NoChatTemplate(ChatTemplateError):
    """The tokenizer has no chat template at all (a base model): the caller says what to use instead."""


def control_strings(tokenizer) -> list[str]:
    """Every string the tokenizer turns into an added (control or special) token when it meets it in text."""
    found = {str(getattr(t, "content", t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    found.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(s for s in found if s)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` ({"role", "content"} dicts) rendered by the tokenizer's chat template.

    The template always runs on the messages, so its content rules (Qwen3 dropping the reasoning of
    earlier assistant turns, trimming, tool-call markup) apply whatever the content holds. Control
    text the sender may not mean as markup is first swapped for a random placeholder: every control
    string in a non-assistant message, and in an assistant message every special token's text
    (``<|im_end|>``: decoding drops it, so the model's own output never holds it as text). An
    assistant's non-special added tokens (``<think>``, ``<tool_call>``: decoding keeps them as text)
    stay, so the template sees them and they encode as the tokens the model wrote, as
    ``apply_chat_template`` does. The rendered text is tokenized around the placeholders, each
    placeholder's characters with ``split_special_tokens=True``, so a typed ``<|im_end|>`` stays the
    characters it is. Without such text the result is exactly ``apply_chat_template``'s.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: {"role", "content"} dicts (string content), oldest first.
        add_generation_prompt: end with the template's opening of an assistant turn.
    Returns:
        The prompt's token ids.
    Raises:
        NoChatTemplate: the tokenizer has no chat template.
        ChatTemplateError: the template alters a placeholder (changes its case, cuts it), so the
            control text it stands for cannot be put back safely.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("this model's tokenizer has no chat template")
    nonce = secrets.token_hex(8)
    literal: dict[str, str] = {}  # placeholder -> the characters it stands for
    held = [_hold_controls(m, _literal_strings(tokenizer, m.get("role")), f"swarm{nonce}c", literal)
            for m in messages]
    if not literal:
        return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=True))
    text = tokenizer.apply_chat_template(held, add_generation_prompt=add_generation_prompt, tokenize=False)
    pieces = re.split("(" + "|".join(map(re.escape, literal)) + ")", text)  # odd entries: placeholders
    if any(nonce in piece.lower() for piece in pieces[::2]):
        raise ChatTemplateError("the chat template alters message content around control text; "
                                "cannot encode it safely")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += _literal_ids(tokenizer, literal[piece])
        else:
            ids += _plain(tokenizer, piece)
    return ids


def encode_chat_flag(tokenizer, messages: list[dict]) -> list[int]:
    """:func:`encode_chat` with a generation prompt, for ``--chat`` on the command line.

    Args:
        tokenizer: a transformers tokenizer.
        messages: {"role", "content"} dicts, the history and the new user turn.
    Returns:
        The prompt's token ids.
    Raises:
        ConfigError: the tokenizer has no chat template (``--chat`` was asked of a base model), or
            the template cannot encode the messages safely (:class:`ChatTemplateError`'s message).
    """
    try:
        return encode_chat(tokenizer, messages)
    except NoChatTemplate:
        raise ConfigError("--chat was given but this model's tokenizer has no chat template") from None
    except ChatTemplateError as exc:
        raise ConfigError(str(exc)) from None


def _literal_strings(tokenizer, role) -> list[str]:
    """The control strings that stay characters in a message of ``role``, longest first (the way the
    tokenizer matches added tokens): all of them, or in an assistant turn the special ones only."""
    if role == "assistant":
        special = {str(getattr(t, "content", t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                   if getattr(t, "special", True)}
        special.update(getattr(tokenizer, "all_special_tokens", []) or [])
        found = [s for s in special if s]
    else:
        found = control_strings(tokenizer)
    return sorted(found, key=len, reverse=True)


def _hold_controls(message: dict, controls: list[str], prefix: str, literal: dict[str, str]) -> dict:
    """``message`` with each of ``controls`` in its string content swapped for a new placeholder
    ``prefix<n>x`` (recorded in ``literal``); other content (None, parts) is left as it is."""
    content = message.get("content")
    if not isinstance(content, str) or not controls or not any(c in content for c in controls):
        return message

    def hold(found: re.Match) -> str:
        mark = f"{prefix}{len(literal)}x"
        literal[mark] = found.group()
        return mark

    return {**message, "content": re.sub("|".join(map(re.escape, controls)), hold, content)}


_WITHOUT_ADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _literal_ids(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` as characters, no added token matched in it: ``split_special_tokens`` leaves
    non-special added tokens (Qwen3's ``</think>``) matched, so a fast tokenizer's pipeline is run
    without its added tokens (built once per tokenizer); a slow one falls back to that flag."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return _ids(tokenizer(text, add_special_tokens=False, split_special_tokens=True))
    bare = _WITHOUT_ADDED.get(tokenizer)
    if bare is None:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []
        bare = _WITHOUT_ADDED[tokenizer] = Tokenizer.from_str(json.dumps(spec))
    return list(bare.encode(text, add_special_tokens=False).ids)


def _plain(tokenizer, text: str) -> list[int]:
    return _ids(tokenizer(text, add_special_tokens=False)) if text else []


def _ids(out) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)

"""Chat prompts to token ids with the model's chat template, message content always literal text.

Owns: :func:`encode_chat` and :func:`encode_chat_flag` (its command-line form). A user who types ``<|im_end|>`` into a message must not close their own
turn and forge others (prompt injection through control tokens): only the template's own markers
become special tokens; text inside a message is tokenized with special-token matching off. Used by
``swarm coordinate --chat`` and ``swarm serve``. Works on any transformers tokenizer passed in;
imports nothing heavy.
"""

from __future__ import annotations

import secrets

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

    Content that holds no control-token text is encoded exactly as ``apply_chat_template`` does.
    Otherwise the template is rendered with a random marker in place of each message's content;
    the text around the markers (the template's own) is tokenized normally and each content with
    ``split_special_tokens=True``, so a typed ``<|im_end|>`` stays the characters it is.

    Raises:
        NoChatTemplate: the tokenizer has no chat template.
        ChatTemplateError: the template alters or repeats a message's content.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("this model's tokenizer has no chat template")
    controls = control_strings(tokenizer)
    if not any(c in m["content"] for m in messages for c in controls):
        return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=True))
    nonce = secrets.token_hex(8)
    marks = [f"swarm{nonce}m{i}" for i in range(len(messages))]
    text = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                         add_generation_prompt=add_generation_prompt, tokenize=False)
    where = []
    for i, mark in enumerate(marks):
        n = text.count(mark)
        if n > 1:
            raise ChatTemplateError(f"the chat template repeats the content of message {i}; cannot encode it safely")
        if n == 1:
            where.append((text.index(mark), i))
    ids, start = [], 0
    for at, i in sorted(where):
        ids += _plain(tokenizer, text[start:at])
        ids += _ids(tokenizer(messages[i]["content"], add_special_tokens=False, split_special_tokens=True))
        start = at + len(marks[i])
    return ids + _plain(tokenizer, text[start:])


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


def _plain(tokenizer, text: str) -> list[int]:
    return _ids(tokenizer(text, add_special_tokens=False)) if text else []


def _ids(out) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)

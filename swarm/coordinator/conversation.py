"""A conversation kept in a file across ``swarm coordinate --session FILE`` invocations.

Owns: the session file (JSON, version 1: the model and its manifest digest, chat or not, the messages and every
committed token id so far) and a new prompt appended to it (a user message through the chat template, or plain
text after the ids), so the stages' prefix caches hold most of it. Written atomically; docs/architecture.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import ConfigError
from swarm.files import write_atomic

VERSION = 1


@dataclass
class Conversation:
    """One conversation: ``messages`` (chat) and ``ids`` (every committed token so far)."""

    path: Path
    model: str
    model_digest: str
    chat: bool
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    @classmethod
    def open(cls, path, *, model: str, model_digest: str, chat: bool) -> Conversation:
        """The conversation in ``path``, or a new one when the file does not exist.

        Raises:
            ConfigError: the file is not a session file, or belongs to another model or mode.
        """
        path = Path(path)
        parent = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise ConfigError(f"--session {path} is a directory; name the session file")
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ConfigError(f"--session {path}: cannot write in {parent} (missing or not writable); nothing was sent")
        if not path.exists():
            return cls(path, model, model_digest, chat)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--session {path}: not a readable session file ({exc})") from None
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise ConfigError(f"--session {path}: not a swarm session file (version {VERSION})")
        if doc.get("model_digest") != model_digest:
            raise ConfigError(f"--session {path} is a conversation with {doc.get('model')!r} "
                              f"(digest {str(doc.get('model_digest'))[:16]}); this ring serves {model!r}")
        if bool(doc.get("chat")) != chat:
            raise ConfigError(f"--session {path} was {'a chat (--chat)' if doc.get('chat') else 'plain text'}: "
                              f"continue it {'with' if doc.get('chat') else 'without'} --chat")
        ids, messages = doc.get("ids"), doc.get("messages")
        if not (isinstance(ids, list) and all(type(x) is int and x >= 0 for x in ids) and isinstance(messages, list)
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages)):
            raise ConfigError(f"--session {path}: malformed 'ids' or 'messages'")
        return cls(path, model, model_digest, chat, messages, ids)

    def prompt_ids(self, tokenizer, prompt: str) -> list[int]:
        """The ids of the next turn's prompt: the history plus ``prompt``.

        Raises:
            ConfigError: the prompt is empty, or the chat template fails.
        """
        if not prompt:
            raise ConfigError("the prompt is empty")
        if self.chat:
            from swarm.coordinator.chat import encode_chat_flag

            return encode_chat_flag(tokenizer, [*self.messages, {"role": "user", "content": prompt}])
        new = list(tokenizer(prompt, add_special_tokens=not self.ids, split_special_tokens=True)["input_ids"])
        return self.ids + new

    def record(self, prompt: str, prompt_ids: list[int], output_ids: list[int], answer: str) -> None:
        """Add a finished turn and write the file (atomically)."""
        if self.chat:
            self.messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        self.ids = list(prompt_ids) + list(output_ids)
        doc = {"version": VERSION, "model": self.model, "model_digest": self.model_digest, "chat": self.chat,
               "messages": self.messages, "ids": self.ids}
        mode = self.path.stat().st_mode & 0o777 if self.path.exists() else 0o600  # it holds the conversation
        try:
            write_atomic(self.path, json.dumps(doc), mode=mode)
        except OSError as exc:
            raise ConfigError(f"--session {self.path}: cannot write the conversation: {exc}") from None

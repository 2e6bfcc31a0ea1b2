"""Token ids to text as they are committed: the incremental detokenizer of ``swarm coordinate`` and
``swarm serve``.

Owns: :class:`Detokenizer`. Works on any transformers tokenizer passed in; imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Text of the committed ids, with stop strings: ``update(ids)`` returns the text that is safe to
    emit now.

    Text is held back while it ends in an incomplete multi-byte character (``\\ufffd``) and, with
    stop strings, by the length of the longest one less a character (a stop string may still be
    forming). What was emitted is never taken back: the pieces concatenate to ``text``.

    Attributes:
        text: the whole text so far, cut before the first stop string.
        emitted: characters of ``text`` already returned.
        hit: a stop string was found (``text`` ends before it; no more text follows).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.emitted = 0
        self.text = ""
        self.hit = False

    def update(self, ids: list[int], final: bool = False) -> str:
        """The newly emittable text after the ids committed so far.

        Args:
            ids: every output id committed so far (not only the new ones).
            final: no more ids will come: emit everything (but never past a stop string).
        Returns:
            The text to emit now; ``''`` while held back.
        """
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.hit, final = text[:cut], True, True
        self.text = text
        safe = len(text)
        if not final:
            if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
                safe = len(text.rstrip("\ufffd"))
            hold = max((len(s) - 1 for s in self.stop), default=0)
            safe = max(self.emitted, safe - hold)
        new, self.emitted = text[self.emitted:safe], max(self.emitted, safe)
        return new

"""Token ids to text as they are committed: the incremental detokenizer of ``swarm coordinate`` and
``swarm serve``.

Owns: :class:`Detokenizer`. Works on any transformers tokenizer passed in; imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT_IDS = 8  # prompt ids decoded before the output (vLLM's incremental detokenizer starts with 5)


class Detokenizer:
    """Text of the committed ids, with stop strings: ``update(ids)`` returns the text that is safe to
    emit now.

    With ``context`` (the prompt's ids, for a completion that continues the prompt's text) the output
    is decoded after the prompt's last ids and the prompt's text is cut off, as vLLM and TGI do: a
    SentencePiece word's leading space (``▁there``) is kept where decoding the output alone would
    drop it, so prompt + text reads as the model wrote it.

    Text is held back while it ends in an incomplete multi-byte character (``\\ufffd``) and, with
    stop strings, by the length of the longest one less a character (a stop string may still be
    forming). What was emitted is never taken back: the pieces concatenate to ``text``.

    Stop strings are searched in the text with the special tokens' own text where they sit
    (``<s>``, ``<|im_end|>``), though ``text`` leaves those out: a stop string that is (or holds) a
    special token's text stops too.

    Attributes:
        text: the whole text so far, cut before the first stop string.
        emitted: characters of ``text`` already returned.
        hit: a stop string was found (``text`` ends before it; no more text follows).
        hit_at: with ``hit``, how many leading ids hold the text up to the end of the stop string:
            the ids plain decoding (one id at a time) would have committed before stopping. Ids
            after it (drafts accepted in the same verify chunk) are not part of the answer.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), context: Sequence[int] = ()):
        """``context``: the ids before the output (the prompt); only its last ``CONTEXT_IDS`` are used."""
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.context = [int(i) for i in context][-CONTEXT_IDS:]
        self.prefix = self._plain(self.context) if self.context else ""
        self.emitted = 0
        self.text = ""
        self.hit = False
        self.hit_at: int | None = None
        self._clear = 0  # ids[:_clear] were seen to hold no stop string
        self._specials = _special_texts(tokenizer) if self.stop else {}
        self._marks: dict[int, tuple[int, int]] = {}  # index of a special id -> (that id, chars of text before it)

    def update(self, ids: list[int], final: bool = False) -> str:
        """The newly emittable text after the ids committed so far.

        Args:
            ids: every output id committed so far (not only the new ones).
            final: no more ids will come: emit everything (but never past a stop string).
        Returns:
            The text to emit now; ``''`` while held back.
        """
        ids = list(ids)
        text = self.decode(ids)
        cut = self._stop_cut(ids, text)
        if cut is None:
            self._clear = len(ids)
        else:
            n = self._first_stop(ids)  # the stop string may have completed before the last id (speculation)
            if n < len(ids):
                text = self.decode(ids[:n])
                cut = self._stop_cut(ids[:n], text)
            text, self.hit, self.hit_at, final = text[:cut], True, n, True
        self.text = text
        safe = len(text)
        if not final:
            if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
                safe = len(text.rstrip("\ufffd"))
            hold = max((len(s) - 1 for s in self.stop), default=0)
            safe = max(self.emitted, safe - hold)
        new, self.emitted = text[self.emitted:safe], max(self.emitted, safe)
        return new

    def decode(self, ids: Sequence[int]) -> str:
        """The text of output ``ids`` (special tokens left out), decoded after the context."""
        if not self.context:
            return self._plain(ids)
        full = self._plain(self.context + list(ids))
        if full.startswith(self.prefix):
            return full[len(self.prefix):]
        return self._plain(ids)  # the context's text changed with what followed (clean-up): the ids alone

    def _plain(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _stop_cut(self, ids: list[int], text: str) -> int | None:
        """Where in ``text`` (the text of ``ids``) the earliest stop string starts, searched with the
        special tokens' text in place; None without one."""
        if not self.stop:
            return None
        inserts = []  # (chars of text before the special token, its text), in order
        for j, t in enumerate(ids):
            if t in self._specials:
                mark = self._marks.get(j)
                if mark is None or mark[0] != t:
                    mark = self._marks[j] = (t, len(self.decode(ids[:j])))
                inserts.append((min(mark[1], len(text)), self._specials[t]))
        searched, at = [], 0
        for pos, special in inserts:
            searched += [text[at:pos], special]
            at = pos
        searched = "".join(searched) + text[at:]
        found = min((i for i in (searched.find(s) for s in self.stop) if i >= 0), default=-1)
        if found < 0:
            return None
        shift = 0  # characters of special text before ``found`` in ``searched``
        for pos, special in inserts:
            start = pos + shift
            if start >= found:
                break
            shift += min(len(special), found - start)
        return found - shift

    def _first_stop(self, ids: list[int]) -> int:
        """The fewest leading ids whose text holds a stop string (``ids`` hold one); binary search
        above the ids already seen without one."""
        lo, hi = min(self._clear, len(ids) - 1), len(ids)  # ids[:lo] hold none, ids[:hi] hold one
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._stop_cut(ids[:mid], self.decode(ids[:mid])) is None:
                lo = mid
            else:
                hi = mid
        return hi


def _special_texts(tokenizer) -> dict[int, str]:
    """Special token id -> its text, for the special tokens that decoding with
    ``skip_special_tokens`` leaves out (``<s>``, ``</s>``, ``<|im_end|>``)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {i for i, tok in added.items() if getattr(tok, "special", False)}
    texts = {}
    for i in sorted(ids):
        text = getattr(added.get(i), "content", None) or tokenizer.convert_ids_to_tokens(i)
        if isinstance(text, str) and text and tokenizer.decode([i], skip_special_tokens=True) == "":
            texts[i] = text
    return texts

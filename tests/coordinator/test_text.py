"""swarm.coordinator.text.Detokenizer: text emitted as ids commit, never half a character, never
past a stop string, and the pieces always add up to the text."""

from __future__ import annotations

import pytest

from swarm.coordinator.text import Detokenizer


class ByteTokenizer:
    """Each id is one byte of UTF-8; decoding an incomplete character gives U+FFFD, as a byte-level
    BPE tokenizer's ``decode`` does. Id 256 is a special token (dropped with skip_special_tokens)."""

    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def ids_of(text: str) -> list[int]:
    return list(text.encode())


def run(text_ids: list[int], stop=()) -> tuple[list[str], Detokenizer]:
    """Commit the ids one at a time, then finish; the pieces emitted at each step."""
    d = Detokenizer(ByteTokenizer(), stop)
    pieces = [d.update(text_ids[:n]) for n in range(1, len(text_ids) + 1)]
    return pieces + [d.update(text_ids, final=True)], d


def test_pieces_add_up_to_the_text():
    pieces, d = run(ids_of("hello, world") + [256])
    assert "".join(pieces) == d.text == "hello, world" and not d.hit
    assert pieces[:3] == ["h", "e", "l"]  # no stop strings: nothing is held back


def test_an_incomplete_character_is_held_back():
    ids = ids_of("aé")  # é is two bytes
    d = Detokenizer(ByteTokenizer())
    assert d.update(ids[:2]) == "a"  # "a\ufffd": the a is safe, the half character waits
    assert d.update(ids) == "é"
    assert d.update(ids, final=True) == ""


def test_final_flushes_a_character_that_never_completes():
    d = Detokenizer(ByteTokenizer())
    assert d.update([0xC3]) == ""
    assert d.update([0xC3], final=True) == "\ufffd"


@pytest.mark.parametrize("stop, want", [(["END"], "abc"), (["x", "END"], "abc"), (["ND"], "abcE"),
                                        (["more", "END"], "abc")])
def test_text_stops_before_the_first_stop_string(stop, want):
    pieces, d = run(ids_of("abcEND and more"), stop)
    assert d.hit and d.text == want
    assert "".join(pieces) == want


def test_text_that_may_start_a_stop_string_waits():
    d = Detokenizer(ByteTokenizer(), ["STOP"])
    assert d.update(ids_of("abcdS")) == "ab"  # the last 3 characters could begin "STOP"
    assert d.update(ids_of("abcdSTx")) == "cd"
    assert d.update(ids_of("abcdSTOP")) == "" and d.hit and d.text == "abcd"


def test_emitted_text_is_never_taken_back():
    class Shrinking(ByteTokenizer):  # a decode that is not prefix-stable (clean-up of spaces)
        def decode(self, ids, skip_special_tokens=False):
            return "ab" if len(ids) == 2 else "abc"[: len(ids)]

    d = Detokenizer(Shrinking())
    assert d.update([1, 2, 3]) == "abc"
    assert d.update([1, 2]) == ""
    assert d.emitted == 3


# ---- with a real SentencePiece tokenizer: context, special tokens' text, where a stop ends -------


@pytest.fixture(scope="module")
def stories_tok(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_dir))


def words(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("prompt, output", [("Once upon a time,", " there was a little girl"),
                                            ("The dog", " was big"),  # after a word, not a comma
                                            ("", "Once upon a time")])  # only <s> before: no space to keep
def test_a_completion_keeps_its_first_words_leading_space(stories_tok, prompt, output):
    context = stories_tok(prompt)["input_ids"]
    ids = words(stories_tok, output)
    assert stories_tok.convert_ids_to_tokens(ids[:1])[0].startswith("▁")
    pieces = [d.update(ids[:n]) for d in [Detokenizer(stories_tok, context=context)] for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == output  # streamed
    d = Detokenizer(stories_tok, [" little"], context=context)
    d.update(ids, final=True)
    assert d.text == output.split(" little")[0] and d.hit == (" little" in output)


@pytest.mark.parametrize("stop, special, want, past", [("<s>", "<s>", " a red ball", 0),
                                                      ("</s>", "</s>", " a red ball", 0),
                                                      ("ball<s>", "<s>", " a red ", 0),  # text, then the token
                                                      ("<s> The", "<s>", " a red ball", 1)])  # the token, then text
def test_a_stop_string_that_is_a_special_tokens_text_stops(stories_tok, stop, special, want, past):
    before, after = words(stories_tok, " a red ball"), words(stories_tok, " The cat")
    ids = before + [stories_tok.convert_tokens_to_ids(special)] + after
    d = Detokenizer(stories_tok, [stop], context=stories_tok("I saw")["input_ids"])
    pieces = [d.update(ids[:n]) for n in range(1, len(ids) + 1)] + [d.update(ids, final=True)]
    assert d.hit and d.text == want and "".join(pieces) == want
    assert d.hit_at == len(before) + 1 + past  # the ids up to the stop's end
    typed = Detokenizer(stories_tok, ["<s>"])  # typed text "<s>" (not the token) stops too, as before
    typed.update(words(stories_tok, "a <s> b"), final=True)
    assert typed.hit and typed.text == "a "


def test_the_ids_of_a_stop_are_counted_to_its_end_when_many_commit_at_once(stories_tok):
    """Under speculation one verify chunk commits several ids: the answer ends where plain decoding,
    one id at a time, would have stopped, not at the chunk's last id."""
    ids = words(stories_tok, " there was a little girl named Lily. She loved to play")
    plain = Detokenizer(stories_tok, [". She"], context=[1])
    n = next(n for n in range(1, len(ids) + 1) if plain.update(ids[:n]) is not None and plain.hit)
    assert plain.text == "there was a little girl named Lily" and plain.hit_at == n < len(ids)
    for chunks in ([len(ids)], [3, 9, len(ids)], [n - 1, len(ids)]):
        d = Detokenizer(stories_tok, [". She"], context=[1])
        for end in chunks:
            d.update(ids[:end])
        assert d.hit and d.hit_at == n and d.text == plain.text

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

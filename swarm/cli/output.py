"""What the ``swarm`` commands print for a person: streamed text, the rate, speculation, the receipt.

Owns: ``TextOut`` (generated text streamed to stdout; a log line kept off the streamed line), ``receipt_line``,
``rate_text`` and ``spec_summary`` (the summary lines of ``swarm coordinate`` and ``swarm demo``).
"""

from __future__ import annotations

import sys


class TextOut:
    """Generated text streamed to stdout, tracking whether the terminal's cursor is mid-line, so
    that a log line (a heal, on stderr) starts on a line of its own instead of mid-word."""

    midline = False

    @classmethod
    def write(cls, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            cls.midline = not text.endswith("\n")

    @staticmethod
    def on_terminal() -> bool:
        """stdout and stderr both go to a terminal: a log line would land on the streamed line."""
        try:
            return sys.stdout.isatty() and sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed streams
            return False

    @classmethod
    def break_line(cls, record=None) -> bool:
        """A logging filter: on a terminal, end the streamed line first (always lets the record
        through). Redirected, stdout keeps exactly the generated text (as ``--json``'s ``text``)."""
        if cls.midline and cls.on_terminal():
            sys.stdout.write("\n")
            sys.stdout.flush()
            cls.midline = False
        return True


def receipt_line(r: dict) -> str:
    """One line naming the job receipt and its verification."""
    if r.get("verified"):
        return f"receipt: {r['path']} (verified: {r['summary']})"
    return f"receipt: {r['path']} (VERIFICATION FAILED: {r['reason']})"


def rate_text(result: dict) -> str:
    """tokens/s as text; decode speed needs at least two tokens."""
    rate = result.get("tokens_per_s")
    return f"{rate:.1f} tokens/s" if rate is not None else "n/a tokens/s (one token)"


def spec_summary(result: dict) -> str:
    """The speculation part of a summary line (draft, k, depth, accept rate); empty without drafts."""
    s = result.get("spec") or {}
    if not s.get("k"):
        return ""
    return (f", draft {s['draft']} k={s['k']} depth={s['depth']}: accept rate {s['accept_rate']:.2f}, "
            f"{s['tokens_per_round_trip']:.2f} tokens per round trip")

"""Checks of documented `python bench/X.py ...` and `python -m pytest ...` commands, all in one child
process (``python -m tests.support.doc_commands`` reads a JSON list of [kind, args] on stdin and prints
one JSON list of results): a benchmark's own parser parses its arguments and then the benchmark stops
before any work; pytest collects with the command's arguments and the count of selected tests is kept.
Benchmarks go first, before pytest's collection puts ``tests/bench`` where ``bench`` is looked up."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class _Parsed(Exception):
    """Raised in place of running a benchmark once its arguments parsed."""


def check_bench(args: list[str]) -> dict:
    """{"ok": bool, "error": str}: ``args`` = [script, *arguments], the script relative to the repo root."""
    script = ROOT / args[0]
    if not script.is_file():
        return {"ok": False, "error": f"no {args[0]}"}
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, argv=None, namespace=None):
        real(self, argv, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_only
    sys.argv, err = [str(script), *args[1:]], io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return {"ok": True, "error": ""}
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        return {"ok": False, "error": f"exit {exc.code}: {lines[-1] if lines else ''}"}
    finally:
        argparse.ArgumentParser.parse_args = real
    return {"ok": False, "error": "ran without parsing its arguments with argparse"}


class _Count:
    """A pytest plugin keeping the number of tests left after selection (-k, -m, deselection)."""

    def __init__(self) -> None:
        self.selected: int | None = None

    def pytest_collection_finish(self, session) -> None:
        self.selected = len(session.items)


def check_pytest(args: list[str]) -> dict:
    """{"ok": bool, "selected": int, "error": str}: pytest's collection with ``args``."""
    import pytest

    count, out = _Count(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[count])
    tail = out.getvalue().strip().splitlines()[-1:] or [""]
    return {"ok": rc == 0 and bool(count.selected), "selected": count.selected or 0, "error": f"rc {rc}: {tail[0]}"}


def main() -> None:
    sys.path.insert(0, str(ROOT))
    todo = json.load(sys.stdin)
    order = sorted(range(len(todo)), key=lambda i: todo[i][0] != "bench")
    results: list[dict] = [{}] * len(todo)
    for i in order:
        kind, args = todo[i]
        results[i] = check_bench(args) if kind == "bench" else check_pytest(args)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

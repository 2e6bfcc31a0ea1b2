"""Every `swarm ...` command line in README.md and docs/*.md (in ```bash blocks) is one the CLI takes: its
subcommand and every flag parse with `swarm.cli.main.build_parser()` (not run: a command that needs a
swarm, a GPU or the network is still checked for drift). Shell variables ($B, $R, ...) stand for an
address or id; what follows ` #`, `;`, `&&` or `|` on a line is not part of the command."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from swarm.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWPlaceholder"


def _strict_parser() -> argparse.ArgumentParser:
    """The CLI's parser, with no abbreviated flags (a doc's ``--receipt`` must not pass as ``--receipt-dir``)."""
    parser, todo = build_parser(), []
    todo.append(parser)
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return parser


def _commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of each line of a ```bash block that runs `swarm` (`.venv/bin/swarm` too)."""
    found, inside, held = [], False, ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = line.strip() in ("```bash", "```sh", "```shell")
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):  # continued on the next line
            held += line.rstrip()[:-1] + " "
            continue
        line, held = held + line, ""
        cmd = re.split(r"\s#|;|&&|\|", line)[0].strip()
        cmd = re.sub(r"^(\.venv/bin/)?swarm\b", "swarm", cmd)
        if cmd.startswith("swarm ") or cmd == "swarm":
            found.append((n, cmd))
    return found


CASES = [(p, n, c) for p in DOCS for n, c in _commands(p)]


def test_the_docs_hold_commands_to_check():
    """The extraction finds the commands README's tour names (it cannot silently match nothing)."""
    readme = [c for p, _, c in CASES if p.name == "README.md"]
    assert any(c.startswith("swarm stage ") for c in readme) and any(c.startswith("swarm serve ") for c in readme)
    assert len(CASES) >= 40


@pytest.mark.parametrize("path,line,command", CASES, ids=[f"{p.name}:{n}" for p, n, _ in CASES])
def test_a_documented_command_parses(path, line, command, capsys):
    command = re.sub(r"\[(-[^\]]*)\]", r"\1", command)  # an optional flag shown as [--flag VALUE]: checked too
    args = [re.sub(r"\$\{?[A-Z_][A-Z0-9_]*\}?", PLACEHOLDER, a) for a in shlex.split(command)[1:]]
    args = [a.replace("...", "x") for a in args]
    try:
        _strict_parser().parse_args(args)
    except SystemExit as exc:
        err = capsys.readouterr().err.strip().splitlines()
        pytest.fail(f"{path.name}:{line}: `{command}` does not parse (exit {exc.code}): {err[-1] if err else ''}")

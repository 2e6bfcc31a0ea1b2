"""Every command line in README.md and docs/*.md (in ```bash blocks) is checked against the tool it runs,
so none drifts: `swarm ...` parses with the CLI's own parser, `make X` names a Makefile target, `python
bench/X.py ...` parses with that benchmark's parser, `python -m pytest ...` collects at least one test,
`python -c` code compiles and imports what is installed, `curl` names a route of `swarm serve` and sends a
body its checks take, `NAME=value` only sets a shell variable. A command of any other kind fails the test
until a checker for it is written. Commands that need a swarm or the network are checked, not run.
Shell variables ($B, $R, ...) stand for an address or id; `#` starts a comment; `;`, `&&` and `|` end the
command checked."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.cli.main import build_parser
from swarm.serve.params import check_fields, load_body

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWPlaceholder"
PYTHONS = ("python", "python3", ".venv/bin/python")
SEPARATORS = {";", "&", "&&", "|", "||"}


def _words(text: str) -> list[str]:
    """The words of a shell line up to its first `;`, `&&` or `|`; ValueError while a quote is open."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    words = []
    for word in lex:
        if word in SEPARATORS:
            break
        words.append(word)
    return words


def _commands(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, words) of each command in the file's ```bash blocks; a line ending in `\\`
    and a quote open at the end of a line go on to the next line."""
    found, inside, held, start = [], False, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside, held = line.strip() in ("```bash", "```sh", "```shell"), ""
            continue
        if not inside:
            continue
        if not held:
            start = n
        if line.rstrip().endswith("\\"):
            held += line.rstrip()[:-1] + " "
            continue
        held += line
        try:
            words = _words(held)
        except ValueError:  # a quoted argument goes on over the next lines
            held += "\n"
            continue
        held = ""
        if words:
            found.append((start, words))
    return found


def kind(words: list[str]) -> str:
    """Which checker a command's words go to."""
    exe = re.sub(r"^\.venv/bin/", "", words[0])
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]) and len(words) == 1:
        return "assignment"
    if exe in ("swarm", "make", "curl"):
        return exe
    if words[0] in PYTHONS and words[1:3] == ["-m", "pytest"]:
        return "pytest"
    if words[0] in PYTHONS and words[1:2] == ["-c"]:
        return "python-c"
    if words[0] in PYTHONS and len(words) > 1 and words[1].startswith("bench/"):
        return "bench"
    return "unknown"


CASES = [(p, n, w) for p in DOCS for n, w in _commands(p)]
IDS = [f"{p.name}:{n}" for p, n, _ in CASES]


def _cases(*kinds: str) -> list:
    return [pytest.param(p, n, w, id=f"{p.name}:{n}") for p, n, w in CASES if kind(w) in kinds]


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


def _filled(words: list[str]) -> list[str]:
    """Shell variables replaced by a placeholder address, `...` by a letter, `[--flag VALUE]` unbracketed."""
    out, bracketed = [], False
    for w in words:
        w = re.sub(r"\$\{?[A-Z_][A-Z0-9_]*\}?", PLACEHOLDER, w).replace("...", "x")
        if w.startswith("[-"):
            w, bracketed = w[1:], True
        if bracketed and w.endswith("]"):
            w, bracketed = w[:-1], False
        out.append(w)
    return out


def test_the_docs_hold_commands_to_check():
    """The extraction finds the commands README's tour names (it cannot silently match nothing), and every
    kind of checker has commands to check."""
    readme = [" ".join(w) for p, _, w in CASES if p.name == "README.md"]
    assert any(c.startswith("swarm stage ") for c in readme) and any(c.startswith("swarm serve ") for c in readme)
    assert "make demo" in readme and "make test" in readme
    assert len(CASES) >= 60
    kinds = {kind(w) for _, _, w in CASES}
    assert {"swarm", "make", "bench", "pytest", "python-c", "curl"} <= kinds


def test_a_multiline_quoted_argument_is_one_command(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text('```bash\npython -c "\nimport os\nprint(1)"  # note\n'
                   'curl -d \'{"a": 1}\' \\\n  http://x | jq\n```\n')
    assert _commands(doc) == [(2, ["python", "-c", "\nimport os\nprint(1)"]),
                              (5, ["curl", "-d", '{"a": 1}', "http://x"])]


@pytest.mark.parametrize("path,line,words", [pytest.param(p, n, w, id=i) for (p, n, w), i in zip(CASES, IDS)])
def test_every_documented_command_has_a_checker(path, line, words):
    assert kind(words) != "unknown", (f"{path.name}:{line}: `{shlex.join(words)[:100]}` is a kind of command no "
                                      "checker in this file knows; add one")


@pytest.mark.parametrize("path,line,words", _cases("swarm"))
def test_a_documented_swarm_command_parses(path, line, words, capsys):
    args = _filled(words)[1:]
    try:
        _strict_parser().parse_args(args)
    except SystemExit as exc:
        err = capsys.readouterr().err.strip().splitlines()
        pytest.fail(f"{path.name}:{line}: `{shlex.join(words)}` does not parse (exit {exc.code}): "
                    f"{err[-1] if err else ''}")


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", text, flags=re.M))


@pytest.mark.parametrize("path,line,words", _cases("make"))
def test_a_documented_make_target_exists(path, line, words):
    targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    missing = [t for t in targets if t not in _make_targets()]
    assert targets and not missing, f"{path.name}:{line}: no Makefile target {missing or '(none named)'}"


@pytest.fixture(scope="module")
def child_checks() -> dict[tuple[str, ...], dict]:
    """The benchmark and pytest commands' checks, run once in one child process (tests.support.doc_commands)."""
    todo = [[kind(w), _filled(w[1:]) if kind(w) == "bench" else [a for a in w[3:] if a not in ("-s", "-q")]]
            for _, _, w in CASES if kind(w) in ("bench", "pytest")]
    proc = subprocess.run([sys.executable, "-m", "tests.support.doc_commands"], input=json.dumps(todo), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {tuple(w): r for (_, w), r in zip(todo, json.loads(proc.stdout.strip().splitlines()[-1]))}


@pytest.mark.process
@pytest.mark.parametrize("path,line,words", _cases("bench"))
def test_a_documented_benchmark_command_parses(path, line, words, child_checks):
    got = child_checks[tuple(_filled(words[1:]))]
    assert got["ok"], f"{path.name}:{line}: `{shlex.join(words)}` does not parse: {got['error']}"


@pytest.mark.process
@pytest.mark.parametrize("path,line,words", _cases("pytest"))
def test_a_documented_pytest_command_selects_tests(path, line, words, child_checks):
    got = child_checks[tuple(a for a in words[3:] if a not in ("-s", "-q"))]
    assert got["ok"], f"{path.name}:{line}: `{shlex.join(words)}` selects no test: {got['error']}"


@pytest.mark.parametrize("path,line,words", _cases("python-c"))
def test_documented_python_code_compiles_and_its_imports_are_installed(path, line, words):
    code = words[2]
    tree = compile(code, f"{path.name}:{line}", "exec", flags=0x400)  # ast.PyCF_ONLY_AST
    names = {a.name.split(".")[0] for node in tree.body if type(node).__name__ == "Import" for a in node.names}
    names |= {node.module.split(".")[0] for node in tree.body if type(node).__name__ == "ImportFrom" and node.module}
    missing = sorted(n for n in names if importlib.util.find_spec(n) is None)
    assert not missing, f"{path.name}:{line}: the code imports {missing}, not installed by `make test`"


def _curl(words: list[str]) -> tuple[str, str, bytes | None]:
    """(method, url path, body) of a curl command line."""
    method, url, body, i = None, None, None, 1
    while i < len(words):
        w = words[i]
        if w in ("-X", "--request"):
            method, i = words[i + 1], i + 2
        elif w in ("-d", "--data", "--data-raw", "--json"):
            body, i = words[i + 1].encode(), i + 2
        elif w in ("-H", "--header", "-o", "--output", "-w", "--write-out", "-m", "--max-time"):
            i += 2
        elif w.startswith("-"):
            i += 1
        else:
            url, i = w, i + 1
    assert url, "curl without a URL"
    path = re.sub(r"^https?://[^/]+", "", url).split("?")[0] or "/"
    return method or ("POST" if body is not None else "GET"), path, body


@pytest.mark.parametrize("path,line,words", _cases("curl"))
def test_a_documented_request_names_a_route_and_passes_the_checks(path, line, words):
    from swarm.serve.app import _routes

    method, url, body = _curl(words)
    routes = [r for r in _routes(None) if r.path_regex.match(url)]
    assert routes, f"{path.name}:{line}: `swarm serve` has no route {url}"
    assert any(method in r.methods for r in routes), f"{path.name}:{line}: {url} does not take {method}"
    if body is not None:
        doc = load_body(body)
        chat = url.endswith("/chat/completions")
        if url.endswith("completions"):
            check_fields(doc, chat)

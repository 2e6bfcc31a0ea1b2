"""Every cross-reference of the form ``docs/NAME.md, "Section"`` (or ``README, "Section"``) in swarm/,
configs/ and the docs names a section that document has: a heading, or a paragraph's bold lead
(``**Healing**:``), starting with that text. A section renamed or moved fails here, not in a reader's hands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((ROOT / "swarm").rglob("*.py")), *sorted((ROOT / "configs").rglob("*.yaml")),
           ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REF = re.compile(r'\b(README|docs/[\w-]+\.md)(?:\.md)?, "([^"]+)"')


def _refs(path: Path) -> list[tuple[str, str]]:
    """(document, section) of each reference; one broken over lines (a comment, a docstring) is joined."""
    return REF.findall(re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text()))


def _sections(doc: Path) -> list[str]:
    text = doc.read_text()
    return re.findall(r"^#+\s+(.+)$", text, re.M) + re.findall(r"^\*\*(.+?)\*\*", text, re.M)


REFS = [(src, doc, section) for src in SOURCES for doc, section in _refs(src)]
CASES = [pytest.param(*ref, id=f"{ref[0].relative_to(ROOT)}:{ref[1]}:{ref[2]}") for ref in REFS]


def test_the_references_are_found():
    """The pattern finds the references (it cannot silently match nothing), the config files' included."""
    assert len(REFS) >= 20 and any(src.parent.name == "configs" for src, _, _ in REFS)


@pytest.mark.parametrize("src,doc,section", CASES)
def test_a_reference_names_a_section_of_its_document(src, doc, section):
    path = ROOT / ("README.md" if doc == "README" else doc)
    assert path.is_file(), f"{src.relative_to(ROOT)} refers to {doc}, which does not exist"
    found = [s for s in _sections(path) if re.match(re.escape(section) + r"(\W|$)", s.strip())]
    assert found, f"{src.relative_to(ROOT)} refers to {doc}, \"{section}\": no such heading or bold lead there"

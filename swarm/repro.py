"""Reproducibility classes: the facts a stage's output bits depend on, and a short id for them.

Owns: the facts' canonical form and class id (:func:`make`), a class read off the wire or a record (:func:`parse`,
which recomputes the id) and :func:`comparable`, asked before an audit compares bits. Pure, standard library
only; the facts are gathered by ``swarm.kernels.facts`` and listed in docs/audits.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

SCHEMA = "swarm/repro/1"
ID_PREFIX = "rc1-"
REQUIRED = ("schema", "device", "isa", "blas", "torch", "dtype", "kernel", "weights")
MAX_FACTS_CHARS = 2048  # a record or a receipt stays small


def _canonical(facts: dict) -> bytes:
    return json.dumps(facts, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def class_id(facts: dict) -> str:
    """The id of a set of facts: ``rc1-`` + 16 hex digits (BLAKE2b-256 of the canonical JSON).

    Raises:
        ValueError / TypeError: the facts hold a value JSON cannot encode.
    """
    digest = hashlib.blake2b(_canonical(facts), digest_size=32, person=b"swarm-repro/1").hexdigest()
    return ID_PREFIX + digest[:16]


@dataclass(frozen=True)
class ReproClass:
    """A reproducibility class: its id and the facts it digests."""

    id: str
    facts: dict

    def as_dict(self) -> dict:
        """``{"id", "facts"}``: the form in ``info``, records and receipts."""
        return {"id": self.id, "facts": dict(self.facts)}


def make(facts: dict) -> ReproClass:
    """The class of ``facts`` after checking them.

    Raises:
        ValueError: a required fact is missing, ``schema`` is not ``swarm/repro/1``, or the facts
            are not JSON values or too long (more than 2048 characters of canonical JSON).
    """
    if not isinstance(facts, dict):
        raise ValueError("reproducibility facts must be a map")
    missing = [k for k in REQUIRED if k not in facts]
    if missing:
        raise ValueError(f"reproducibility facts lack {', '.join(missing)}")
    if facts["schema"] != SCHEMA:
        raise ValueError(f"reproducibility facts of schema {facts['schema']!r}, not {SCHEMA}")
    try:
        size = len(_canonical(facts))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reproducibility facts are not JSON values: {exc}") from None
    if size > MAX_FACTS_CHARS:
        raise ValueError(f"reproducibility facts take {size} characters, more than {MAX_FACTS_CHARS}")
    return ReproClass(class_id(facts), dict(facts))


def parse(doc: Any) -> ReproClass:
    """A class as it travels (``{"id", "facts"}``), checked: the id must be the facts' digest.

    Raises:
        ValueError: not such a map, facts that :func:`make` refuses, or an id that does not match.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("id"), str) or not isinstance(doc.get("facts"), dict):
        raise ValueError("a reproducibility class must be a map of 'id' (string) and 'facts' (map)")
    cls = make(doc["facts"])
    if cls.id != doc["id"]:
        raise ValueError(f"reproducibility class id {doc['id'][:24]!r} is not the digest of its facts ({cls.id})")
    return cls


class Comparison:
    """The answer of :func:`comparable`: true when two stages' bits may be compared; ``reason``
    says why not (``"not comparable: torch 2.13.0 vs 2.12.0"``), empty when they may."""

    __slots__ = ("ok", "reason", "differences")

    def __init__(self, differences: list[tuple[str, Any, Any]]) -> None:
        self.differences = differences
        self.ok = not differences
        self.reason = "" if self.ok else "not comparable: " + "; ".join(
            f"{name} {_show(a)} vs {_show(b)}" for name, a, b in differences)

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Comparison({'comparable' if self.ok else self.reason!r})"


def _show(v: Any) -> str:
    if v is None:
        return "(none)"
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def _flatten(facts: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in facts.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def comparable(a: ReproClass | dict, b: ReproClass | dict) -> Comparison:
    """Whether two stages' outputs may be compared bit for bit: the same class (same facts).

    Args:
        a, b: classes, or their travelling form ``{"id", "facts"}`` (checked with :func:`parse`).
    Returns:
        A :class:`Comparison`, true when the ids match; else its ``reason`` names every fact that
        differs (``weights``, ``torch``, ``kernel.mode``, ...), or why a class could not be read.
    """
    try:
        ca = a if isinstance(a, ReproClass) else parse(a)
        cb = b if isinstance(b, ReproClass) else parse(b)
    except ValueError as exc:
        return Comparison([("class", str(exc), "a valid class")])
    if ca.id == cb.id:
        return Comparison([])
    fa, fb = _flatten(ca.facts), _flatten(cb.facts)
    diffs = [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    return Comparison(diffs or [("id", ca.id, cb.id)])

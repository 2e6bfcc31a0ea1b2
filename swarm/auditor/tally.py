"""An auditor's tally file: ``{PeerId: {audited, passed, failed}}`` as JSON, summed over runs.

Owns: the format (``unavailable`` beside the counts of a stage that restarted since a job), its writer
(``add_tally``: ``swarm audit run --tally``), its reader (``read_tally``: ``swarm peers --audits``, ``swarm serve
--audits``) and ``audit_column``, the per-stage counts and proof both readers show.
"""

from __future__ import annotations

import json
from pathlib import Path

from swarm.errors import ConfigError
from swarm.files import write_atomic

COUNTS = ("audited", "passed", "failed")
UNAVAILABLE = "unavailable"  # audits a restarted stage could not answer (``swarm.auditor.run``): counted apart


def read_tally(path: Path) -> dict[str, dict[str, int]]:
    """The tally in ``path``: PeerId -> ``{audited, passed, failed}`` (a missing count reads 0).

    Raises:
        ConfigError: the file cannot be read, or holds something else than such a map.
    """
    try:
        tally = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the audit tally {path}: {exc}") from None
    if not isinstance(tally, dict) or not all(isinstance(v, dict) for v in tally.values()):
        raise ConfigError(f"{path} is not an audit tally ({{PeerId: {{audited, passed, failed}}}})")
    try:
        return {str(peer): {k: int(counts.get(k, 0))
                            for k in COUNTS + ((UNAVAILABLE,) if UNAVAILABLE in counts else ())}
                for peer, counts in tally.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not an audit tally: a count is not a number ({exc})") from None


def add_tally(path: Path, tally: dict) -> dict:
    """Add ``{PeerId: {audited, passed, failed[, unavailable]}}`` to the JSON file at ``path`` (created if
    absent); returns the sum.

    Raises:
        ConfigError: the file holds something else than such a map, or cannot be written.
    """
    old = read_tally(path) if Path(path).exists() else {}
    for peer, counts in tally.items():
        mine = old.setdefault(peer, {k: 0 for k in COUNTS})
        for k in COUNTS:
            mine[k] += int(counts.get(k, 0))
        if counts.get(UNAVAILABLE):
            mine[UNAVAILABLE] = mine.get(UNAVAILABLE, 0) + int(counts[UNAVAILABLE])
    try:
        write_atomic(path, json.dumps(old, indent=1, sort_keys=True))
    except OSError as exc:
        raise ConfigError(f"cannot write the audit tally {path}: {exc}") from None
    return old


def audit_column(path: Path | None, proofs: dict[str, str]) -> dict[str, dict]:
    """PeerId -> ``{audited, passed, failed, proof}`` from an auditor's tally file (None: no counts) and
    the state of the fraud proof against each stage (``proofs``: PeerId -> a one-line state).

    Raises:
        ConfigError: as :func:`read_tally`.
    """
    out: dict[str, dict] = {}
    for peer, counts in (read_tally(path) if path is not None else {}).items():
        out[peer] = {**counts, "proof": None}
    for peer, state in proofs.items():
        out.setdefault(peer, {k: None for k in COUNTS})["proof"] = state
    return out

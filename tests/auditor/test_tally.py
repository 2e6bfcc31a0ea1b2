"""``swarm.auditor.tally``: the tally file ``swarm audit run --tally`` writes and ``swarm peers --audits`` /
``swarm serve --audits`` read; and ``Exclusions.judged``, the proof state a dashboard shows. Pure: files
and a DHT double, no network."""

from __future__ import annotations

import json

import pytest
import trio

from swarm.auditor.exclusions import Exclusions
from swarm.auditor.tally import add_tally, audit_column, read_tally
from swarm.errors import ConfigError


def test_runs_add_up_and_the_reader_fills_missing_counts(tmp_path):
    path = tmp_path / "tally.json"
    add_tally(path, {"A": {"audited": 2, "passed": 1, "failed": 1}})
    assert add_tally(path, {"A": {"audited": 1, "passed": 1, "failed": 0}, "B": {"audited": 1, "passed": 1,
                                                                                  "failed": 0}}) == \
        {"A": {"audited": 3, "passed": 2, "failed": 1}, "B": {"audited": 1, "passed": 1, "failed": 0}}
    assert read_tally(path)["A"] == {"audited": 3, "passed": 2, "failed": 1}
    path.write_text(json.dumps({"C": {"audited": 4}}))
    assert read_tally(path) == {"C": {"audited": 4, "passed": 0, "failed": 0}}


@pytest.mark.parametrize("text, says", [
    (None, "cannot read the audit tally"),
    ("{not json", "cannot read the audit tally"),
    ("[1, 2]", "is not an audit tally"),
    ('{"A": 3}', "is not an audit tally"),
    ('{"A": {"audited": "many"}}', "a count is not a number"),
])
def test_a_file_that_is_no_tally_is_refused_with_the_reason(tmp_path, text, says):
    path = tmp_path / "tally.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=says):
        read_tally(path)


def test_the_audit_column_joins_counts_and_proof_states(tmp_path):
    path = tmp_path / "tally.json"
    add_tally(path, {"A": {"audited": 1, "passed": 0, "failed": 1}})
    assert audit_column(path, {"A": "verified", "B": "refused: signature"}) == {
        "A": {"audited": 1, "passed": 0, "failed": 1, "proof": "verified"},
        "B": {"audited": None, "passed": None, "failed": None, "proof": "refused: signature"}}
    assert audit_column(None, {}) == {}


class _Proofs:
    """A DHT double: its ``proofs.read_all`` answers from a dict."""

    def __init__(self, proofs: dict[str, bytes]):
        self.by_peer, self.proofs = proofs, self

    async def read_all(self, peer_id: str) -> list[bytes]:
        return [self.by_peer[peer_id]] if peer_id in self.by_peer else []


def test_judged_says_what_became_of_the_proof_against_a_stage():
    shut_out = Exclusions(None)  # no local weights: a proof read cannot be re-run
    assert trio.run(shut_out.excluded, _Proofs({"A": b"a proof"}), ["A", "B"]) == frozenset()
    assert shut_out.judged("A") == {"proof": "unchecked", "why": "no local weights to re-run the proof"}
    assert shut_out.judged("B") is None
    shut_out.refused["C"] = "REFUSED (signature): ..."
    assert shut_out.judged("C") == {"proof": "refused", "why": "REFUSED (signature): ..."}

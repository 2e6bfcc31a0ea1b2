"""`swarm audit` on bad input: one line saying what is wrong, no traceback, exit code 1 (a refused
proof, or a ConfigError)."""

from __future__ import annotations

from tests.support.cli import run_cli


def test_audit_verify_refuses_a_file_that_is_not_a_proof(tmp_path):
    junk = tmp_path / "junk.proof"
    junk.write_bytes(b"\x93\x01\x02\x03")
    res = run_cli("audit", "verify", str(junk), "--model", str(tmp_path))
    assert res.returncode == 1 and res.stdout.startswith("REFUSED (malformed)") and "not a map" in res.stdout
    missing = run_cli("audit", "verify", str(tmp_path / "nope.proof"), "--model", str(tmp_path))
    assert missing.returncode == 1 and "is not a file" in missing.stderr and "Traceback" not in missing.stderr


def test_audit_run_refuses_bad_receipts_and_rates_before_any_network(tmp_path):
    res = run_cli("audit", "run", str(tmp_path / "none.json"), "--model", str(tmp_path))
    assert res.returncode == 1 and "cannot read the job receipt" in res.stderr
    bad = tmp_path / "r.json"
    bad.write_text("{}")
    res = run_cli("audit", "run", str(bad), "--model", str(tmp_path), "--rate", "2")
    assert res.returncode == 1 and "--rate must be in [0, 1]" in res.stderr


def test_audit_run_names_a_model_it_cannot_find_before_any_network(tmp_path):
    """A --model that is not there is one line (it used to audit nothing, print NOT COMPARABLE per stage
    and exit 0)."""
    receipt = tmp_path / "r.json"
    receipt.write_text("{}")
    res = run_cli("audit", "run", str(receipt), "--model", str(tmp_path / "no-such-model"))
    assert res.returncode == 1 and "no-such-model" in res.stderr and "Traceback" not in res.stderr, res.stderr

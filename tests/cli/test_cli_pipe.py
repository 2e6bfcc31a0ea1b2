"""A reader that closes ``swarm``'s stdout early (``swarm ... --json | head``) ends it quietly, exit 0."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # a child swarm process


def test_a_closed_stdout_is_no_traceback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "max_position_embeddings": 128}))
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "plan", str(tmp_path), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything was written
    try:
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]
    assert proc.returncode == 0, err.decode()[-2000:]

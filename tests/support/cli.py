"""The ``swarm`` command for tests: in this process (``run_cli``) or as a child process (``run_swarm``)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from swarm.cli.launch import start_swarm


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``swarm ARGS`` run in this process (``swarm.cli.main.main``) as ``python -m swarm ARGS`` runs it:
    returns its exit code (argparse's SystemExit included), stdout and stderr.

    For commands that fail early (a bad flag or ring file, an unreachable stage, a stage that
    cannot start, a preflight), where a child process would spend ~10 s of CPU importing torch
    and transformers to print one line; what only a real process shows (exit at interpreter
    shutdown, a daemon's lifecycle) stays with tests that start one.

    What ``main`` changes in the process is put back afterwards: os.environ (``env`` applies to
    the call only), sys.argv, the root logger's handlers (emptied for the call, so that
    ``main``'s logging setup writes to the captured stderr as in a process) and level, and the
    libp2p logger's level.
    """
    import contextlib
    import io
    import logging
    import sys

    import huggingface_hub.constants  # noqa: F401  (read HF_HUB_OFFLINE now, not under a command's offline switch)

    from swarm.cli.main import main
    from swarm.cli.output import TextOut

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv = dict(os.environ), sys.argv
    root, p2p = logging.getLogger(), logging.getLogger("libp2p")
    saved_handlers, saved_level, saved_p2p_level = root.handlers[:], root.level, p2p.level
    os.environ.update(env or {})
    sys.argv = ["swarm", *args]
    root.handlers = []
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code
                if isinstance(code, str):
                    print(code, file=sys.stderr)
                code = 0 if code is None else code if isinstance(code, int) else 1
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)
        p2p.setLevel(saved_p2p_level)
        sys.argv = saved_argv
        TextOut.midline = False
        for name in set(os.environ) - set(saved_env):
            del os.environ[name]
        for name, value in saved_env.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
    return subprocess.CompletedProcess(["swarm", *args], code, out.getvalue(), err.getvalue())


def run_swarm(*args: str, timeout: float = 180, env: dict | None = None, cwd: Path | None = None
              ) -> subprocess.CompletedProcess:
    """Run `python -m swarm ...` in its own process group; kill the whole group if it overruns.

    Runs in ``cwd`` (default: the test's isolated $SWARM_CACHE), so default ``receipts/`` land there."""
    cwd = cwd or Path(os.environ["SWARM_CACHE"])
    cwd.mkdir(parents=True, exist_ok=True)
    proc = start_swarm(list(args), {**os.environ, **(env or {})}, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"swarm {' '.join(args)} timed out; stderr: {err[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

"""A preloaded parent for ``swarm`` child processes: import torch, transformers and libp2p once, fork per child.

Owns: ``Zygote`` (start one, ``spawn`` a ``swarm ...`` command through it, close it), ``ZygoteProcess``
(the handle a spawn returns, with the parts of ``subprocess.Popen`` that ``LocalRing`` and the tests
use), ``shared_zygote`` (one per launching process, started on first use), ``install`` (launchers in this
process, ``swarm.cli.launch.start_swarm``, fork through it under ``SWARM_ZYGOTE=1``) and the zygote's own
loop (in ``tests.support.preload``, run as ``python -m tests.support.preload SOCKET`` from the repository's
root). Standard library only, and ``swarm.cli.launch``'s hook.

Why: a ``swarm stage`` process spends about 9 s of CPU importing torch, transformers' model code
and libp2p before it reads a weight; a ring of three stages on two cores waits on that, and the test
suite starts about a hundred such processes. The zygote pays the imports once; each child is a
``fork`` of it that runs ``swarm.cli.main.main(argv)`` with its own argv, environment, working
directory, standard streams and session, so it behaves as ``python -m swarm ...`` would (the same
technique as Android's zygote and Python's ``multiprocessing`` forkserver with preloading).

What keeps a fork equal to a fresh process:
- the zygote imports modules only (it runs no model, starts no trio loop and no Python thread) and
  forks from its single thread;
- a request whose environment differs from the zygote's in a variable that libraries read at import
  time (``HF_*``, ``TRANSFORMERS_*``, ``OMP_*``, ``PYTHON*``, ``HOME``, ... see ``IMPORT_TIME_ENV``)
  gets no zygote: ``spawn`` returns None and the caller starts a plain process;
- the child reseeds ``random`` (forks share the parent's state) and restores default signal handlers.

Lifetime: a child gets SIGTERM when the process that asked for it goes (the zygote watches each
request's connection: end of file means that launcher is gone, however it went), as children that
``LocalRing`` starts directly do (``PR_SET_PDEATHSIG``); the zygote exits when the process that started
it closes it or goes (a pipe from it), and its children get SIGTERM then too. A zygote's children find
it in ``SWARM_ZYGOTE_SOCKET``: a ``swarm demo`` forked from it forks its stages from it as well.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# environment variables read when a library is imported (not when it is used): a child that needs
# other values than the zygote imported with must start fresh
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS",
                   "GOTO", "CUDA", "NVIDIA", "PYTHON", "LD_", "XDG_", "HOME", "TMPDIR", "LIBP2P", "TOKENIZERS",
                   "SAFETENSORS", "TRITON", "NUMPY")
# ... except those that `swarm.cli.main.main` applies itself when the library is imported already
APPLIED_BY_MAIN = ("TRANSFORMERS_VERBOSITY",)
ZYGOTE_ENV = "SWARM_ZYGOTE"
ROOT = Path(__file__).resolve().parents[2]  # the repository: ``tests.support.preload`` imports from here
log = logging.getLogger(__name__)


def import_env(env: dict) -> dict:
    """The part of ``env`` that libraries read at import time (see ``IMPORT_TIME_ENV``, ``APPLIED_BY_MAIN``)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in APPLIED_BY_MAIN}


def refusal(mine: dict, added: dict, env: dict) -> str | None:
    """Why a zygote that imported with environment ``mine`` (its import-time part), its imports having
    added ``added``, cannot stand in for a fresh process with environment ``env``; None when it can.

    A variable that a process's own imports set (torch sets ``TORCHINDUCTOR_CACHE_DIR``) is in the
    environment of every launcher that imported them; with the value the imports give it, it
    changes nothing.
    """
    theirs = {k: v for k, v in import_env(env).items() if added.get(k) != v}
    differ = sorted({k for k, _ in set(import_env(mine).items()) ^ set(theirs.items())})
    return f"import-time environment differs: {differ}" if differ else None


class ZygoteProcess:
    """A child forked by a zygote; the subset of ``subprocess.Popen`` swarm uses.

    Attributes: ``pid``, ``args`` (the argv it stands for), ``stdout``/``stderr`` (text streams when
    piped, else None), ``returncode`` (None while it runs; negative: killed by that signal; -255:
    the zygote went away before it reported the exit). Unlike a ``Popen``, dropping the handle ends
    the child (its connection to the zygote closes, and the zygote takes that as the launcher gone).
    """

    def __init__(self, pid: int, args: list[str], conn: socket.socket, stdout, stderr):
        self.pid, self.args, self._conn = pid, args, conn
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] | None = None
        self._output: dict = {}

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            ready, _, _ = select.select([self._conn], [], [], timeout)
        except (OSError, ValueError):  # another thread collected it and closed the connection
            return self.returncode
        if not ready:
            return None
        with self._lock:
            if self.returncode is None:
                try:
                    data = self._conn.recv(64)
                except OSError:
                    data = b""
                self.returncode = int(json.loads(data)["exit"]) if data else -255
                self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read both pipes to their end and wait (like ``Popen.communicate`` without input); after a
        TimeoutExpired, a second call goes on with the same readers (no output is lost)."""
        if self._readers is None:
            def drain(name, stream):
                self._output[name] = stream.read() if stream is not None else None

            self._readers = [threading.Thread(target=drain, args=(n, s), daemon=True)
                             for n, s in (("out", self.stdout), ("err", self.stderr))]
            for t in self._readers:
                t.start()
        self.wait(timeout)
        for t in self._readers:
            t.join(timeout)
        return self._output.get("out"), self._output.get("err")


class Zygote:
    """A zygote process to fork ``swarm`` commands from: one this process starts, or one it attaches to.

    Args:
        env: the environment the zygote imports with (default: this process's); it refuses children
            whose environment differs from it in ``IMPORT_TIME_ENV`` variables (``spawn`` returns None).
        path: attach to the running zygote listening there instead of starting one.
        startup_timeout_s: how long the imports may take.
    Raises (``start``): OSError when the zygote could not start or import (its stderr tail in the message).
    """

    def __init__(self, env: dict | None = None, path: str | Path | None = None, startup_timeout_s: float = 180.0):
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.startup_timeout_s = startup_timeout_s
        self._dir = None if path else Path(tempfile.mkdtemp(prefix="swarm-zygote-"))
        self.path = Path(path) if path else self._dir / "sock"
        self.proc: subprocess.Popen | None = None
        self._lifeline: int | None = None

    def start(self) -> Zygote:
        life_r, self._lifeline = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.preload", str(self.path)],
                                         stdin=life_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                                         text=True, start_new_session=True, cwd=ROOT)
        finally:
            os.close(life_r)
        ready, _, _ = select.select([self.proc.stdout], [], [], self.startup_timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "SWARM_ZYGOTE_READY":
            self.close()
            raise OSError(f"the zygote did not start: {line.strip() or 'no READY line'}; "
                          f"stderr: {self._stderr_tail()}")
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        return self

    def _stderr_tail(self) -> str:
        if self.proc is None or self.proc.poll() is None:
            return ""
        return self.proc.stderr.read()[-2000:]

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:  # the zygote itself prints only on a fault
            sys.stderr.write(f"swarm zygote: {line}")

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else self.path.is_socket()

    def spawn(self, args: list[str], env: dict, cwd: str | Path | None = None, stdout=subprocess.PIPE,
              stderr=subprocess.PIPE) -> ZygoteProcess | None:
        """Fork ``swarm ARGS`` (``args`` without the interpreter and ``-m swarm``) in its own session.

        The child gets SIGTERM when this process goes (its end of the request's connection closes),
        as ``PR_SET_PDEATHSIG`` gives a plain child.
        Args: env: its whole environment; cwd: its working directory (default: ours); stdout,
            stderr: ``subprocess.PIPE`` (text streams on the handle) or ``subprocess.DEVNULL``.
        Returns: the handle, or None when the zygote cannot start it as a fresh process would
            (``env`` differs from the zygote's in an import-time variable) or is gone.
        """
        if not self.alive():
            return None
        ends, mine = [], []
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for how in (stdout, stderr):
                r, w = os.pipe() if how == subprocess.PIPE else (None, null)
                ends.append(w)
                mine.append(r)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(str(self.path))
                request = json.dumps({"args": list(args), "env": dict(env), "cwd": str(cwd or os.getcwd())})
                socket.send_fds(conn, [request.encode()], [null, *ends])
                reply = json.loads(conn.recv(4096) or b"{}")
                pid = reply.get("pid")
                if pid is None:
                    log.info("zygote: starting swarm %s as a fresh process: %s", args[0],
                             reply.get("refused", "the zygote closed the request"))
            except (OSError, ValueError) as exc:
                log.info("zygote: starting swarm %s as a fresh process: %s", args[0], exc)
                pid = None
            if pid is None:
                conn.close()
                for r in mine:
                    if r is not None:
                        os.close(r)
                return None
        finally:
            for fd in {null, *ends}:
                os.close(fd)
        streams = [open(r, "r", errors="replace") if r is not None else None for r in mine]
        return ZygoteProcess(int(pid), [sys.executable, "-m", "swarm", *args], conn, *streams)

    def close(self) -> None:
        """Stop the zygote this process started (children left get SIGTERM) and remove its socket."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._dir is not None:
            for p in (self.path, self._dir):
                try:
                    p.unlink() if p.is_socket() else p.rmdir()
                except OSError:
                    pass


_shared: Zygote | None = None
_shared_lock = threading.Lock()
SOCKET_ENV = "SWARM_ZYGOTE_SOCKET"  # set in a zygote's children: their own launchers fork from it too


def shared_zygote() -> Zygote | None:
    """This process's zygote: the one that forked it (``SWARM_ZYGOTE_SOCKET``), else one started on
    first use with the current environment (None, with one line on stderr, when it cannot start:
    callers then start plain processes)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive():
            inherited = os.environ.get(SOCKET_ENV)
            if inherited and Path(inherited).is_socket():
                _shared = Zygote(path=inherited)
                return _shared
            fresh = Zygote()
            try:
                _shared = fresh.start()
            except OSError as exc:
                fresh.close()
                print(f"swarm: starting child processes without a zygote: {exc}", file=sys.stderr)
                _shared = None
                return None
            atexit.register(_shared.close)
        return _shared


def enabled() -> bool:
    """Whether launchers in this process fork their children from a zygote (``SWARM_ZYGOTE=1``)."""
    return os.environ.get(ZYGOTE_ENV, "") == "1"


def _spawn(args: list[str], env: dict, cwd: str | Path | None) -> ZygoteProcess | None:
    if not enabled():
        return None
    parent = shared_zygote()
    return parent.spawn(args, env, cwd) if parent is not None else None


def install() -> None:
    """Launchers in this process (``swarm.cli.launch.start_swarm``) fork their ``swarm`` children from the
    shared zygote while ``SWARM_ZYGOTE=1``, and start plain processes otherwise or where it declines."""
    from swarm.cli import launch

    launch.set_spawner(_spawn)

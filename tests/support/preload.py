"""The zygote process itself (``python -m tests.support.preload SOCKET``): import, then fork on request.

Owns: the preload list, the zygote's loop (accept a request with its argv, environment, working
directory and three descriptors; refuse it when its import-time environment differs; fork; report
the child's pid and, when it is reaped, its exit status; SIGTERM a child whose launcher went) and
what a fresh fork does to become ``python -m swarm ARGS`` (its own launchers fork from this zygote too:
``zygote.install``). The launcher's side is ``tests.support.zygote``.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

from swarm.cli.launch import _die_with_parent
from tests.support.zygote import SOCKET_ENV, import_env, install, refusal

# what the zygote imports before it forks: the heavy part of every swarm command that computes or dials
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "libp2p", "trio", "swarm.cli.main",
           "swarm.stage.daemon", "swarm.model.block", "swarm.coordinator")
_MAX_REQUEST = 1 << 20


def _serve(path: str, mine: dict, added: dict) -> dict | None:
    """The zygote's loop: accept requests, fork, report each child's pid and exit status; SIGTERM a
    child whose launcher closed its connection (the launcher is gone).

    Args: mine: the zygote's import-time environment (before its imports); added: what its imports
        put in the environment (a fresh process's imports would put it there too).
    Returns in a forked child (its request, with its descriptors installed); returns None in the
    zygote when its own launcher is gone.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    orphans: set[int] = set()  # children whose launcher went: signalled once, no longer watched
    print("SWARM_ZYGOTE_READY", flush=True)
    while True:
        try:
            watched = [c for pid, c in children.items() if pid not in orphans]
            readable, _, _ = select.select([listener, sys.stdin, wake_r, *watched], [], [])
        except InterruptedError:
            continue
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            for pid in children:  # the launcher is gone: so are the children
                _signal(pid, signal.SIGTERM)
            return None
        if wake_r in readable:
            os.read(wake_r, 4096)
        for pid, conn in list(children.items()):
            if conn in readable:  # its launcher closed the connection before the child exited
                _signal(pid, signal.SIGTERM)
                orphans.add(pid)
        _reap(children)
        orphans &= children.keys()
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        try:
            data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
            request = json.loads(data)
            if len(fds) != 3:
                raise ValueError(f"expected 3 descriptors, got {len(fds)}")
            refused = refusal(mine, added, request["env"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            print(f"refused a malformed request: {exc}", file=sys.stderr, flush=True)
            conn.close()
            continue
        if refused:
            _answer(conn, {"refused": refused})
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for s in (listener, conn, *children.values()):
                s.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            request["env"] = {**added, **request["env"], SOCKET_ENV: path}
            return request
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        _answer(conn, {"pid": pid})


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _answer(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _answer(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


def _become(request: dict) -> list[str]:
    """In a fresh fork: take the request's session, signals, environment and directory; return argv."""
    import random

    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with_parent()  # go with the zygote, as a plain child goes with its launcher
    if os.getppid() == 1:  # the zygote died before the line above
        os._exit(1)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # the streams are now the request's pipes: line-buffer them as a fresh unbuffered process would
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=bool(os.environ.get("PYTHONUNBUFFERED")))
    main_py = str(Path(sys.modules["swarm"].__file__).with_name("__main__.py"))
    sys.argv = [main_py, *request["args"]]
    return list(request["args"])


def _zygote_main(path: str) -> int:
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    added = {k: v for k, v in os.environ.items() if k not in before}
    if threading.active_count() != 1:
        print(f"imports started Python threads ({threading.enumerate()}); a fork would copy them half-done",
              file=sys.stderr, flush=True)
        return 1
    request = _serve(path, import_env(before), added)
    if request is None:  # the launcher is gone, maybe by SIGKILL: remove what it could not
        sock = Path(path)
        sock.unlink(missing_ok=True)
        if sock.parent.name.startswith("swarm-zygote-"):
            try:
                sock.parent.rmdir()
            except OSError:
                pass
        return 0
    args = _become(request)
    from swarm.cli.main import main

    install()  # a `swarm demo` forked here forks its stages here too (SWARM_ZYGOTE_SOCKET)
    return main(args)


if __name__ == "__main__":
    sys.exit(_zygote_main(sys.argv[1]))

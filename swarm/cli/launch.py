"""Start stage daemons on loopback as child processes and always reap them.

Owns: ``LocalRing`` (``swarm demo``, the tests, the benchmarks): ``swarm stage`` processes with an even split of
layers and of the CPU cores, each ``SWARM_STAGE_READY`` awaited, the ring file built, and every process it
started terminated and reaped on exit (errors and Ctrl-C too). Standard library + swarm.config only.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from swarm.config import RingSpec, StageSpec
from swarm.errors import StageLost, SwarmError
from swarm.ranges import LayerRange

log = logging.getLogger(__name__)

# spawn(args, env, cwd) -> a started child with Popen's pid, stdout, stderr, poll, wait, send_signal, kill
# and communicate, or None to start a plain process (``set_spawner``)
Spawner = Callable[[list, dict, "str | Path | None"], object]
_spawner: Spawner | None = None


def set_spawner(spawn: Spawner | None) -> None:
    """Start ``swarm`` children through ``spawn`` from now on (None: plain processes). The test suite
    forks them from a parent that imported torch, transformers and libp2p once (tests/support/zygote.py)."""
    global _spawner
    _spawner = spawn


@dataclass
class StageProcess:
    """A running stage child: its process, READY payload, and collected stderr tail."""

    layers: LayerRange
    proc: subprocess.Popen  # or what the ``set_spawner`` spawner returned
    ready: dict | None = None
    lines: "queue.Queue[str | None]" = field(default_factory=queue.Queue)
    stderr_tail: list[str] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return self.ready["addrs"][0]


def stage_command(model: str, layers: LayerRange | None, key: Path, threads: int,
                  extra: list[str] | None = None) -> list[str]:
    """The argv that starts one stage daemon with the current interpreter (``layers`` None: no
    ``--layers``, the stage picks its block from the swarm; needs ``--bootstrap`` in ``extra``)."""
    span = [] if layers is None else ["--layers", f"{layers.start}:{layers.end}"]
    return [sys.executable, "-m", "swarm", "stage", "--model", model, *span,
            "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(key), "--threads", str(threads), *(extra or [])]


class LocalRing:
    """Context manager: start one stage process per layer range, wait for READY, reap on exit.

    Args:
        model: the model spec passed to every stage.
        ranges: layer ranges in ring order (see ``swarm.ranges.even_split``); None for a stage
            that picks its block from the swarm (``extra_args`` must hold ``--bootstrap``).
        key_dir: where the stages' identity keys live (stable PeerIds across runs).
        threads: torch threads per stage; default divides the cores among the stages.
        extra_args: more ``swarm stage`` flags (e.g. ``["--dtype", "float32"]``).
        per_stage_args: flags for single stages, by position in ``ranges``.
        per_stage_prefix: a command to run a stage under, by position (e.g. ``["ip", "netns",
            "exec", "lab-h1"]`` for a stage inside a network namespace).
        startup_timeout_s: how long to wait for every READY line.
    Raises:
        StageLost: a stage printed FATAL or exited or did not become ready in time (with its reason).
    """

    def __init__(self, model: str, ranges: list[LayerRange | None], key_dir: Path, threads: int | None = None,
                 extra_args: list[str] | None = None, startup_timeout_s: float = 180.0, env: dict | None = None,
                 per_stage_args: dict[int, list[str]] | None = None,
                 per_stage_prefix: dict[int, list[str]] | None = None):
        self.per_stage_args = per_stage_args or {}
        self.per_stage_prefix = per_stage_prefix or {}
        self.model = model
        self.ranges = ranges
        self.key_dir = Path(key_dir)
        self.threads = threads or max(1, (os.cpu_count() or 1) // len(ranges))
        self.extra_args = extra_args or []
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.stages: list[StageProcess] = []

    def __enter__(self) -> LocalRing:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for i, r in enumerate(self.ranges):
            # one key per stage: two stages of one range must not share a PeerId
            name = (f"stage-auto-{i}" if r is None else f"stage-{r.start}-{r.end}" if self.ranges.count(r) == 1
                    else f"stage-{i}-{r.start}-{r.end}")
            key = self.key_dir / f"{name}.key"
            argv = stage_command(self.model, r, key, self.threads, self.extra_args + self.per_stage_args.get(i, []))
            proc = start_swarm(argv[3:], env, self.per_stage_prefix.get(i))
            sp = StageProcess(r, proc)
            threading.Thread(target=_pump, args=(proc.stdout, sp.lines, None), daemon=True).start()
            threading.Thread(target=_pump, args=(proc.stderr, None, sp.stderr_tail), daemon=True).start()
            self.stages.append(sp)
        deadline = time.monotonic() + self.startup_timeout_s
        for sp in self.stages:
            sp.ready = self._wait_ready(sp, deadline)

    def _wait_ready(self, sp: StageProcess, deadline: float) -> dict:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StageLost(f"stage {sp.layers} did not print SWARM_STAGE_READY within {self.startup_timeout_s:.0f} s"
                                f"{_tail(sp)}")
            try:
                line = sp.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise StageLost(f"stage {sp.layers} exited with code {sp.proc.wait()} before it was ready{_tail(sp)}")
            if line.startswith("SWARM_STAGE_READY "):
                ready = json.loads(line.split(" ", 1)[1])
                sp.layers = LayerRange(*ready["layers"])  # a stage that picked its block says which here
                return ready
            if line.startswith("SWARM_STAGE_FATAL "):
                reason = json.loads(line.split(" ", 1)[1]).get("reason")
                raise StageLost(f"stage {sp.layers} failed to start: {reason}")

    def ring_spec(self, model: str | None = None) -> RingSpec:
        return RingSpec(model=model or self.model,
                        stages=tuple(StageSpec(addr=sp.addr, layers=sp.layers) for sp in self.stages))

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate every stage (SIGTERM, then SIGKILL after ``grace_s``) and reap it."""
        for sp in self.stages:
            if sp.proc.poll() is None:
                try:
                    os.killpg(sp.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace_s
        for sp in self.stages:
            try:
                sp.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(sp.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                sp.proc.wait()


def start_swarm(args: list[str], env: dict, prefix: list[str] | None = None, cwd: str | Path | None = None):
    """Start ``swarm ARGS`` as a child in its own session, stdout and stderr piped as text: through the
    spawner given to ``set_spawner`` where there is one and no ``prefix`` (a command to run it under), and
    as ``python -m swarm ARGS`` where there is none or it declines; in ``cwd`` (default: ours).
    Returns: a ``subprocess.Popen``, or the spawner's Popen-like handle.
    """
    if _spawner is not None and not prefix:
        proc = _spawner(args, env, cwd)
        if proc is not None:
            return proc
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", "swarm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent, cwd=cwd)


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the launcher dies, even by SIGKILL,
    so no stage outlives a killed demo or test."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _pump(pipe, lines: queue.Queue | None, tail: list | None) -> None:
    for line in pipe:
        line = line.rstrip("\n")
        if lines is not None:
            lines.put(line)
        if tail is not None:
            tail.append(line)
            del tail[:-20]
    if lines is not None:
        lines.put(None)


def _tail(sp: StageProcess) -> str:
    time.sleep(0.2)  # let the stderr pump catch the last lines of a dying process
    return ("; stderr: " + " | ".join(sp.stderr_tail[-5:])) if sp.stderr_tail else ""


class BootstrapNode:
    """Context manager: run ``swarm bootstrap`` (or ``swarm relay``) as a child, wait for its READY
    line, reap it on exit.

    Args:
        key_path: its identity key. startup_timeout_s: how long to wait for READY.
        role: "bootstrap" or "relay". listen: its listen multiaddr (a fixed port lets a test
            restart it at the same address). prefix: a command to run it under (e.g. ``ip netns exec``).
    Attributes:
        addr: its first multiaddr (with /p2p/PeerId), to pass as ``--bootstrap``.
    Raises:
        StageLost: it printed FATAL, exited, or was not ready in time.
    """

    def __init__(self, key_path: Path, startup_timeout_s: float = 60.0, env: dict | None = None,
                 role: str = "bootstrap", listen: str = "/ip4/127.0.0.1/tcp/0", prefix: list[str] | None = None):
        if role not in ("bootstrap", "relay"):
            raise ValueError(f"role must be bootstrap or relay, got {role!r}")
        self.key_path, self.startup_timeout_s, self.env = Path(key_path), startup_timeout_s, env
        self.role, self.listen, self.prefix = role, listen, list(prefix or [])
        self.proc: subprocess.Popen | None = None  # or the spawner's handle
        self.ready: dict = {}

    @property
    def addr(self) -> str:
        return self.ready["addrs"][0]

    def __enter__(self) -> BootstrapNode:
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = start_swarm([self.role, "--key", str(self.key_path), "--listen", self.listen], env, self.prefix)
        sp = StageProcess(LayerRange(0, 1), self.proc)
        threading.Thread(target=_pump, args=(self.proc.stdout, sp.lines, None), daemon=True).start()
        threading.Thread(target=_pump, args=(self.proc.stderr, None, sp.stderr_tail), daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                try:
                    line = sp.lines.get(timeout=max(0.05, deadline - time.monotonic()))
                except queue.Empty:
                    raise StageLost(f"{self.role} node not ready within {self.startup_timeout_s:.0f} s{_tail(sp)}") \
                        from None
                if line is None:
                    raise StageLost(f"{self.role} node exited with code {self.proc.wait()}{_tail(sp)}")
                if line.startswith(f"SWARM_{self.role.upper()}_READY "):
                    self.ready = json.loads(line.split(" ", 1)[1])
                    return self
                if line.startswith(f"SWARM_{self.role.upper()}_FATAL "):
                    raise StageLost(f"{self.role} node failed: {line.split(' ', 1)[1]}")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


__all__ = ["BootstrapNode", "LocalRing", "StageProcess", "stage_command", "SwarmError"]

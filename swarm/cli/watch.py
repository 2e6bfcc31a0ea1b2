"""``swarm receipts watch DIR``: a live table of jobs as their receipts arrive.

Owns: scanning a receipt directory (each file verified once, again only if it changes), the rows
of the table, and the ``rich`` live display. Glue over ``swarm.receipts``; no torch, no network.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import ConfigError, ReceiptInvalid
from swarm.receipts import load, verify_job


@dataclass
class Row:
    """One job in the table."""

    path: str
    created: float  # unix seconds (file mtime when the receipt has no time)
    job_id: str
    model: str
    tokens: int | None
    tokens_per_s: float | None
    stages: str
    verified: bool
    reason: str
    nonce: str = ""


def short_peer(peer_id: str) -> str:
    """``12D3…wxyz``: enough of a PeerId to tell ring members apart in a table."""
    return peer_id if len(peer_id) <= 12 else f"{peer_id[:4]}…{peer_id[-6:]}"


class Scanner:
    """Reads and verifies the ``*.json`` receipts of a directory, caching by (size, mtime)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._cache: dict[Path, tuple[tuple[int, int], Row]] = {}

    def rows(self) -> list[Row]:
        """All receipts, newest first. Raises ConfigError if the directory does not exist."""
        if not self.directory.exists():
            raise ConfigError(f"receipt directory {self.directory} does not exist")
        if not self.directory.is_dir():
            raise ConfigError(f"{self.directory} is not a directory (watch takes the directory of the receipts)")
        out = []
        for p in self.directory.glob("*.json"):
            try:
                st = p.stat()
            except OSError:
                continue  # removed meanwhile
            stamp = (st.st_size, st.st_mtime_ns)
            cached = self._cache.get(p)
            if cached is None or cached[0] != stamp:
                cached = (stamp, self._row(p, st.st_mtime))
                self._cache[p] = cached
            out.append(cached[1])
        for gone in set(self._cache) - {Path(r.path) for r in out}:
            del self._cache[gone]
        rows = sorted(out, key=lambda r: (r.created, r.path))
        first: dict[str, str] = {}
        shown = []
        for r in rows:  # a nonce already used by an older receipt: a replayed job
            if r.verified and r.nonce in first:
                r = Row(**{**r.__dict__, "verified": False,
                           "reason": f"nonce: already used by {first[r.nonce]} (a replayed job)"})
            elif r.verified:
                first[r.nonce] = r.path
            shown.append(r)
        return shown[::-1]

    @staticmethod
    def _row(p: Path, mtime: float) -> Row:
        try:
            job = load(p)
        except ReceiptInvalid as exc:
            return Row(str(p), mtime, p.stem, "?", None, None, "", False, f"unreadable: {exc}")
        if not isinstance(job, dict):
            return Row(str(p), mtime, p.stem, "?", None, None, "", False, "not a job receipt")
        try:
            verify_job(job)
            ok, reason = True, ""
        except ReceiptInvalid as exc:
            ok, reason = False, str(exc)
        ring = job.get("ring") if isinstance(job.get("ring"), list) else []
        stages = "\n".join(f"{short_peer(str(s.get('peer_id', '?')))} {_fmt(s.get('layers'))}"
                           for s in ring if isinstance(s, dict))
        created = job.get("created_ms")
        ids = job.get("output_ids")
        rate = job.get("tokens_per_s")
        sane = isinstance(created, (int, float)) and not isinstance(created, bool) and 0 < created < 4e12
        return Row(str(p), created / 1000 if sane else mtime, str(job.get("job_id", p.stem))[:64],
                   str(job.get("model", "?"))[:64], len(ids) if isinstance(ids, list) else None,
                   rate if isinstance(rate, (int, float)) and 0 <= rate < 1e9 else None, stages, ok, reason,
                   str(job.get("nonce", "")))


def _fmt(layers) -> str:
    try:
        return f"[{int(layers[0])},{int(layers[1])})"
    except (TypeError, ValueError, IndexError, KeyError):
        return "[?]"


def table(rows: list[Row], directory: Path, limit: int = 50):
    """A ``rich.table.Table`` of the newest ``limit`` rows."""
    from rich.table import Table

    ok = sum(r.verified for r in rows)
    t = Table(title=f"swarm receipts in {directory}: {len(rows)} jobs, {ok} verified, {len(rows) - ok} failed",
              title_justify="left", expand=False)
    for col, kw in (("time", {}), ("job", {}), ("model", {}), ("tokens", {"justify": "right"}),
                    ("tok/s", {"justify": "right"}), ("stages (PeerId [layers))", {}), ("verified", {})):
        t.add_column(col, **kw)
    for r in rows[:limit]:
        verdict = "[green]yes[/green]" if r.verified else f"[red]no[/red]: {r.reason}"
        t.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)), r.job_id[:12], r.model,
                  "" if r.tokens is None else str(r.tokens), "" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
                  r.stages, verdict)
    return t


def watch(directory: Path, interval_s: float = 1.0, once: bool = False, limit: int = 50) -> int:
    """Show the table; with ``once`` print it and return, else refresh every ``interval_s`` until Ctrl-C.

    Returns:
        0, or 1 when ``once`` and some receipt fails verification.
    Raises:
        ConfigError: the directory does not exist, or ``interval_s`` is not positive.
    """
    from rich.console import Console
    from rich.live import Live

    if not interval_s > 0:
        raise ConfigError(f"--interval-s must be a positive number of seconds, got {interval_s}")
    if limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    scanner = Scanner(directory)
    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: do not wrap at 80 columns
    if once:
        rows = scanner.rows()
        console.print(table(rows, directory, limit))
        return 0 if all(r.verified for r in rows) else 1
    if not sys.stdout.isatty():  # piped: print the table again whenever a receipt arrives or changes
        last = None
        try:
            while True:
                rows = scanner.rows()
                key = [(r.path, r.verified, r.reason) for r in rows]
                if key != last:
                    console.print(table(rows, directory, limit))
                    sys.stdout.flush()
                    last = key
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return 0
    with Live(table(scanner.rows(), directory, limit), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(table(scanner.rows(), directory, limit))
        except KeyboardInterrupt:
            return 0

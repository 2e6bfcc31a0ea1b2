"""What a stage keeps of its recent jobs so that an audit can open them: the retention store.

Owns: :class:`RetentionStore` (each recent job's signed receipt and window commitment, bounded in bytes, spilled
to ``--audit-retention-dir`` when evicted, read back for an audit, taken over after a restart by
:meth:`~RetentionStore.adopt`) and :class:`RetentionCorrupt`. No clock. The spill file: docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import msgpack

from swarm.openings import Commitment
from swarm.errors import SwarmError
from swarm.files import write_atomic

log = logging.getLogger(__name__)

FORGOTTEN_KEPT = 4096  # evicted jobs remembered by id, so an audit of one hears "evicted", not "unknown"
SPILL_SCHEMA = "swarm/retained/1"
SPILL_SUFFIX = ".ret"


class RetentionCorrupt(SwarmError):
    """A spilled job's file cannot be read back, or its rows are not the ones its receipt commits to."""


@dataclass(frozen=True)
class Retained:
    """One job's receipt (signed, this stage's) and its window commitment."""

    receipt: dict
    commitment: Commitment

    @property
    def nbytes(self) -> int:
        return self.commitment.nbytes


class RetentionStore:
    """Recent jobs' rows for audits, at most ``max_bytes`` in memory, the oldest evicted first (to the
    spill directory when there is one, else forgotten).

    Args:
        max_bytes: the memory budget (``--audit-retention-mb`` in bytes); 0 keeps nothing.
        spill_dir: the directory evicted jobs go to (``--audit-retention-dir``); None: no spill. Spill
            files left there by an earlier run wait for :meth:`adopt` (kept or deleted); temporary
            files of interrupted writes are deleted now.
        disk_max_bytes: the spill's bound (``--audit-retention-disk-mb`` in bytes), file sizes summed.
    Raises:
        ValueError: a negative budget.
        OSError: the spill directory cannot be created or cleaned.
    """

    def __init__(self, max_bytes: int, spill_dir: Path | str | None = None, disk_max_bytes: int = 0) -> None:
        if max_bytes < 0 or disk_max_bytes < 0:
            raise ValueError(f"the retention budgets must be >= 0 bytes, got {max_bytes} and {disk_max_bytes}")
        self.max_bytes, self.disk_max_bytes = max_bytes, disk_max_bytes
        self.nbytes = 0
        self.disk_bytes = 0
        self._jobs: OrderedDict[tuple[str, str], Retained] = OrderedDict()
        self._disk: OrderedDict[tuple[str, str], tuple[Path, int]] = OrderedDict()  # oldest first
        self._evicted: deque = deque(maxlen=FORGOTTEN_KEPT)
        self.evictions = 0  # jobs forgotten for good (from memory without a spill, or from the disk)
        self.spilled = 0  # jobs written to the spill directory
        self.reloaded = 0  # spilled files read back for an audit
        self._loaded: tuple | None = None  # (key, Retained): the last file read back (an audit opens windows 0..k)
        self.adopted = 0  # spill files of an earlier run taken over (``adopt``)
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self._found: list[Path] = []  # an earlier run's spill files, until ``adopt`` judges them
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            stale = clean_spill_dir(self.spill_dir, parts_only=True)
            if stale:
                log.info("audit.retention_cleaned dir=%s files=%d", self.spill_dir, stale)
            self._found = sorted((p for p in self.spill_dir.iterdir() if p.is_file() and p.name.endswith(SPILL_SUFFIX)),
                                 key=_mtime)

    def adopt(self, keep) -> int:
        """Take over the spill files an earlier run left in the directory: a file is kept (oldest first, within
        the disk bound) when it reads back, its rows hash to the root its receipt signed, and
        ``keep(receipt)`` (the receipt is signed by this stage's own key); every other one is deleted.
        Runs once (later calls do nothing); returns how many were kept.

        Args:
            keep: ``keep(receipt dict) -> bool``.
        """
        found, self._found = self._found, []
        kept = dropped = 0
        adopted: OrderedDict[tuple[str, str], tuple[Path, int]] = OrderedDict()
        for path in found:
            try:
                doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
                session, job_id = doc["session"], doc["job"]
                if not (isinstance(session, str) and isinstance(job_id, str)
                        and path.name == spill_name(session, job_id)):
                    raise RetentionCorrupt(f"{path} is not named after its job")
                if (session, job_id) in self._disk:  # this run spilled the job again, to this very file
                    continue
                entry = read_spilled(path, session, job_id)
                ok = bool(keep(entry.receipt)) and (session, job_id) not in self._jobs
            except Exception as exc:  # msgpack, a missing field, RetentionCorrupt: not a file to keep
                log.info("audit.retention_dropped path=%s reason=%s", path, exc)
                ok = False
            if not ok:
                path.unlink(missing_ok=True)
                dropped += 1
                continue
            size = path.stat().st_size
            adopted[(session, job_id)] = (path, size)
            self.disk_bytes += size
            kept += 1
        # an earlier run's jobs are older than this run's: first out
        self._disk = OrderedDict([*adopted.items(), *self._disk.items()])
        while self.disk_bytes > self.disk_max_bytes and self._disk:
            old = next(iter(self._disk))
            kept -= old in adopted
            self._unspill(old)
            self._forget(old)
        self.adopted += kept
        if found:
            log.info("audit.retention_adopted dir=%s kept=%d dropped=%d", self.spill_dir, kept, dropped)
        return kept

    def spill_all(self) -> int:
        """Move every job held in memory to the spill directory, oldest first (a stage draining before a
        restart: the next run takes them over, :meth:`adopt`); the disk bound evicts as a spill always
        does. Returns how many were written (0 without a spill directory)."""
        if self.spill_dir is None:
            return 0
        written = 0
        for key in list(self._jobs):
            entry = self._jobs[key]
            self._drop(key)
            if self._spill(key, entry):
                written += 1
            else:
                self._forget(key)
        return written

    def __len__(self) -> int:
        return len(self._jobs) + len(self._disk)

    def put(self, session: str, job_id: str, receipt: dict, commitment: Commitment) -> bool:
        """Keep a job's receipt and commitment (replacing an earlier one of the same job), evicting the
        oldest jobs (to the spill directory, if any) until it fits. Returns False (and keeps nothing)
        when it alone exceeds the memory budget."""
        key = (session, job_id)
        self._drop(key)
        self._unspill(key)
        entry = Retained(receipt, commitment)
        if entry.nbytes > self.max_bytes:
            self._forget(key)
            log.warning("audit.not_retained session=%s job=%s bytes=%d budget=%d (--audit-retention-mb)",
                        session, job_id, entry.nbytes, self.max_bytes)
            return False
        while self.nbytes + entry.nbytes > self.max_bytes and self._jobs:
            old, old_entry = next(iter(self._jobs.items()))
            self._drop(old)
            if not self._spill(old, old_entry):
                self._forget(old)
        self._jobs[key] = entry
        self.nbytes += entry.nbytes
        return True

    def get(self, session: str, job_id: str) -> Retained | None:
        """The job's entry (from memory, else read back from its spill file), or None (see
        :meth:`evicted` for why).

        Raises:
            RetentionCorrupt: its spill file does not read back or does not match its receipt (the file
                is deleted and the job counts as evicted).
        """
        key = (session, job_id)
        entry = self._jobs.get(key)
        if entry is not None or key not in self._disk:
            return entry
        if self._loaded is not None and self._loaded[0] == key:
            return self._loaded[1]
        path, _ = self._disk[key]
        try:
            entry = read_spilled(path, session, job_id)
        except RetentionCorrupt:
            self._unspill(key)
            self._forget(key)
            raise
        self.reloaded += 1
        self._loaded = (key, entry)
        return entry

    def evicted(self, session: str, job_id: str) -> bool:
        """Whether the job was kept once and evicted since (or was too large to keep)."""
        return (session, job_id) in self._evicted

    def _drop(self, key) -> None:
        entry = self._jobs.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _forget(self, key) -> None:
        self._evicted.append(key)
        self.evictions += 1

    def _spill(self, key, entry: Retained) -> bool:
        """Write an entry evicted from memory to its file, evicting the oldest files past the disk bound.
        False when there is no spill directory, the entry alone exceeds the bound, or the write failed."""
        if self.spill_dir is None:
            return False
        data = encode_spilled(key[0], key[1], entry)
        if len(data) > self.disk_max_bytes:
            log.warning("audit.not_spilled session=%s job=%s bytes=%d budget=%d (--audit-retention-disk-mb)",
                        key[0], key[1], len(data), self.disk_max_bytes)
            return False
        while self.disk_bytes + len(data) > self.disk_max_bytes and self._disk:
            old = next(iter(self._disk))
            self._unspill(old)
            self._forget(old)
        path = self.spill_dir / spill_name(*key)

        try:
            write_atomic(path, data)
        except OSError as exc:  # a full disk costs this job's audits, never the stage
            log.warning("audit.spill_failed session=%s job=%s path=%s error=%s", key[0], key[1], path, exc)
            return False
        self._disk[key] = (path, len(data))
        self.disk_bytes += len(data)
        self.spilled += 1
        return True

    def _unspill(self, key) -> None:
        got = self._disk.pop(key, None)
        if got is None:
            return
        path, size = got
        self.disk_bytes -= size
        if self._loaded is not None and self._loaded[0] == key:
            self._loaded = None
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("audit.spill_unlink_failed path=%s error=%s", path, exc)


def spill_name(session: str, job_id: str) -> str:
    """The spill file's name of a job: a hash of its session and job id (both are network strings)."""
    h = hashlib.blake2b(f"{session}\x00{job_id}".encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return h + SPILL_SUFFIX


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def clean_spill_dir(directory: Path, parts_only: bool = False) -> int:
    """Delete the spill files (and temporary files of interrupted writes; with ``parts_only`` only those) in
    ``directory``; returns how many. Other files are left alone."""
    n = 0
    for path in directory.iterdir():
        name = path.name
        if path.is_file() and ((name.endswith(SPILL_SUFFIX) and not parts_only)
                               or (name.startswith(".") and ".ret." in name and name.endswith(".part"))):
            path.unlink(missing_ok=True)
            n += 1
    return n


def encode_spilled(session: str, job_id: str, entry: Retained) -> bytes:
    """A spill file's bytes (see the module docstring)."""
    c = entry.commitment
    return msgpack.packb({"schema": SPILL_SCHEMA, "session": session, "job": job_id, "receipt": entry.receipt,
                          "size": c.size, "rows": [list(r) for r in c.rows]}, use_bin_type=True)


def read_spilled(path: Path, session: str, job_id: str) -> Retained:
    """Read a spill file back and check it: its job, and that its rows hash to the root its receipt signed.

    Raises:
        RetentionCorrupt: naming the file and what is wrong with it.
    """
    try:
        doc = msgpack.unpackb(Path(path).read_bytes(), raw=False, strict_map_key=False)
    except OSError as exc:
        raise RetentionCorrupt(f"the spilled rows {path} cannot be read: {exc}") from None
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise RetentionCorrupt(f"the spilled rows {path} are not a msgpack document ({type(exc).__name__})") from None
    if not (isinstance(doc, dict) and doc.get("schema") == SPILL_SCHEMA and isinstance(doc.get("receipt"), dict)
            and type(doc.get("size")) is int and doc["size"] >= 1 and isinstance(doc.get("rows"), list)
            and all(isinstance(r, list) and len(r) == 4 for r in doc["rows"])):
        raise RetentionCorrupt(f"the spilled rows {path} are not a {SPILL_SCHEMA} document")
    if doc.get("session") != session or doc.get("job") != job_id:
        raise RetentionCorrupt(f"the spilled rows {path} are of another job")
    try:
        commitment = Commitment([tuple(r) for r in doc["rows"]], doc["size"])
    except (TypeError, ValueError) as exc:
        raise RetentionCorrupt(f"the spilled rows {path} do not form windows: {exc}") from None
    signed = (doc["receipt"].get("windows") or {}).get("root")
    if commitment.field()["root"] != signed:
        raise RetentionCorrupt(f"the spilled rows {path} do not hash to the root its receipt signed "
                               f"({str(signed)[:16]}...): the file was altered")
    return Retained(doc["receipt"], commitment)


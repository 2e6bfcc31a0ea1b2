"""A stage's own copy of a model's weights: a directory holding only some shards, and their checks.

Owns: ``WeightsManifest`` (per-tensor sha256, the model id, the shard layout), the sidecar ``swarm-weights.json``,
``ShardVerifier`` (a safetensors file's header and every tensor checked while its bytes arrive) and re-verifying
a directory fetched earlier (``find_cached``, warm restart). No torch, no networking. Layout: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import ModelError, SwarmError, WeightsMismatch
from swarm.files import write_atomic
from swarm.weights.manifest import MANIFEST_VERSION, manifest_model_id, read_header
from swarm.weights.select import INDEX_NAME, SINGLE_FILE, select_shards

log = logging.getLogger(__name__)

SIDECAR = "swarm-weights.json"
_MAX_HEADER_BYTES = 100 * 2**20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
READ_BLOCK_BYTES = 8 * 2**20


def safe_file_name(name: object) -> bool:
    """True for a plain file name (no directory part, no leading dot): what a peer may ask for or name."""
    return isinstance(name, str) and len(name) <= 200 and bool(_SAFE_FILE.match(name))


@dataclass(frozen=True)
class WeightsManifest:
    """The manifest a stage's tensors are checked against.

    Attributes:
        model_id: sha256 hex over ``tensors`` (``manifest.manifest_model_id``); None when only the
            tensors of some shards were hashed (a hub download without a manifest).
        num_layers: L of the model (part of the id).
        tensors: ``{name: [safetensors dtype, shape, sha256 hex of the bytes]}``; every tensor of
            the model when ``model_id`` is set.
        shards: the layout, ``{shard file: {name: [dtype, shape, [begin, end]]}}`` (header entries,
            offsets relative to the data section) of every shard, held or not.
    """

    model_id: str | None
    num_layers: int
    tensors: dict
    shards: dict

    @property
    def weight_map(self) -> dict[str, str]:
        """``{tensor name: shard file}`` of the layout."""
        return {name: file for file, entries in self.shards.items() for name in entries}

    def to_doc(self) -> dict:
        return {"model_id": self.model_id, "num_layers": self.num_layers, "tensors": self.tensors,
                "shards": self.shards}


def parse_manifest(doc: object, origin: str) -> WeightsManifest:
    """Check a manifest document (a peer's reply or a sidecar) and return it.

    Checks types, that every tensor lies in exactly one shard with the manifest's dtype and shape,
    and, when ``model_id`` is set, that the tensors are exactly the layout's and hash to that id.

    Raises:
        ModelError: naming ``origin`` and the first problem.
    """
    def bad(why: str) -> ModelError:
        return ModelError(f"{origin}: invalid weights manifest: {why}")

    if not isinstance(doc, dict):
        raise bad("not a map")
    mid, num_layers, tensors, shards = (doc.get(k) for k in ("model_id", "num_layers", "tensors", "shards"))
    if mid is not None and not (isinstance(mid, str) and _HEX64.match(mid)):
        raise bad("model_id is not 64 lowercase hex characters")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 < num_layers < 100_000:
        raise bad(f"num_layers {num_layers!r} is not a positive integer")
    if not isinstance(tensors, dict) or not isinstance(shards, dict) or not shards:
        raise bad("tensors and shards must be maps (shards non-empty)")
    for name, entry in tensors.items():
        if not (isinstance(name, str) and isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and _int_list(entry[1]) and isinstance(entry[2], str) and _HEX64.match(entry[2])):
            raise bad(f"tensor entry {name!r} is not [dtype, shape, sha256]")
    seen: set[str] = set()
    for file, entries in shards.items():
        if not safe_file_name(file) or not file.endswith(".safetensors") or not isinstance(entries, dict):
            raise bad(f"shard {file!r} is not a plain *.safetensors file name with a map of tensors")
        for name, entry in entries.items():
            if not (isinstance(name, str) and isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and _int_list(entry[1]) and _int_list(entry[2]) and len(entry[2]) == 2
                    and 0 <= entry[2][0] <= entry[2][1]):
                raise bad(f"layout entry {name!r} of {file} is not [dtype, shape, [begin, end]]")
            if name in seen:
                raise bad(f"tensor {name!r} lies in two shards")
            seen.add(name)
            known = tensors.get(name)
            if known is not None and (known[0] != entry[0] or list(known[1]) != list(entry[1])):
                raise bad(f"tensor {name!r} has dtype/shape {known[:2]} in the manifest but {entry[:2]} in {file}")
    if not set(tensors) <= seen:
        raise bad(f"tensor {sorted(set(tensors) - seen)[0]!r} is in no shard")
    if mid is not None:
        if set(tensors) != seen:
            raise bad(f"model id given but tensor {sorted(seen - set(tensors))[0]!r} of the layout has no hash")
        if manifest_model_id(tensors, num_layers) != mid:
            raise bad(f"the tensors do not hash to the model id {mid[:16]}...")
    return WeightsManifest(model_id=mid, num_layers=num_layers, tensors=tensors, shards=shards)


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def header_entries(header: dict) -> dict[str, list]:
    """``{name: [dtype, shape, [begin, end]]}`` of a safetensors header (``__metadata__`` dropped)."""
    return {name: [e["dtype"], list(e["shape"]), list(e["data_offsets"])]
            for name, e in header.items() if name != "__metadata__"}


def local_layout(path: Path, files) -> dict[str, dict]:
    """The layout of some shard files of a directory, from their headers.

    Raises:
        ModelError: a header is unreadable or malformed.
    """
    out = {}
    for file in files:
        try:
            out[file] = header_entries(read_header(Path(path) / file))
        except (KeyError, TypeError) as e:
            raise ModelError(f"malformed safetensors header in {Path(path) / file}: {e!r}") from e
    return out


# ---- the sidecar ---------------------------------------------------------------------------------

def read_sidecar(path: Path) -> dict | None:
    """The sidecar document of a weights directory, or None if it has none.

    Raises:
        ModelError: the sidecar exists but is unreadable or not a manifest.
    """
    file = Path(path) / SIDECAR
    if not file.is_file():
        return None
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"unreadable {file}: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != MANIFEST_VERSION:
        raise ModelError(f"{file} is not a swarm weights sidecar of version {MANIFEST_VERSION}")
    return doc


def sidecar_manifest(path: Path) -> WeightsManifest | None:
    """The manifest recorded in a weights directory's sidecar, checked, or None without a sidecar."""
    doc = read_sidecar(path)
    return None if doc is None else parse_manifest(doc, str(Path(path) / SIDECAR))


def write_sidecar(path: Path, manifest: WeightsManifest, *, name: str, source: dict, files: dict) -> None:
    """Write the sidecar (and the index of a sharded layout) atomically.

    Args:
        path: the weights directory. manifest: what its tensors are checked against.
        name: the model name the stage was started with (``--model``).
        source: where the files came from, e.g. ``{"kind": "hub", "repo": ..., "revision": sha}``.
        files: ``{small file name: [size bytes, sha256 hex]}`` of config and tokenizer files.
    """
    path = Path(path)
    if set(manifest.shards) != {SINGLE_FILE}:
        weight_map = dict(sorted(manifest.weight_map.items()))
        index = {"metadata": {"total_size": sum(e[2][1] - e[2][0] for s in manifest.shards.values()
                                                for e in s.values())}, "weight_map": weight_map}
        write_atomic(path / INDEX_NAME, json.dumps(index, indent=2) + "\n", mode=0o644)
    doc = {"v": MANIFEST_VERSION, "name": name, "source": source, "files": files, **manifest.to_doc()}
    write_atomic(path / SIDECAR, json.dumps(doc, sort_keys=True), mode=0o644)


def temp_file(dest: Path, file: str):
    """An open binary temp file in ``dest`` for ``file`` (named so no ``*.safetensors`` glob sees it)."""
    fd, tmp = tempfile.mkstemp(prefix=f".incoming-{file}.", suffix=".part", dir=dest)
    return os.fdopen(fd, "wb"), Path(tmp)


def install(tmp: Path, final: Path) -> None:
    """Move a verified temp file into place (same directory: an atomic rename)."""
    os.chmod(tmp, 0o644)
    os.replace(tmp, final)


def weights_dir(root: Path, name: str, key: str) -> Path:
    """``<root>/<slug of name>-<key[:16]>``: where one model's fetched files live."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    return Path(root) / f"{slug}-{key[:16]}"


def layout_key(manifest: WeightsManifest, origin: str) -> str:
    """A directory key: the model id (or the hub origin) and the layout, so one directory never mixes
    two layouts of the same weights."""
    layout = json.dumps(manifest.shards, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{manifest.model_id or origin}\n{layout}".encode()).hexdigest()


# ---- verifying bytes -----------------------------------------------------------------------------

class ShardVerifier:
    """Check one safetensors file while its bytes arrive, before anything of it is kept.

    Feed the file's bytes in order (any slicing). The header must equal ``expected`` (names, dtypes,
    shapes, offsets); its data section must be exactly the tensors, back to back; each tensor's
    sha256 must equal ``tensors[name][2]``. The first mismatch raises at once, so a tampered
    transfer is abandoned at the tensor that differs.

    Args:
        file: the shard's file name (for messages).
        expected: its layout entries ``{name: [dtype, shape, [begin, end]]}``; None accepts any
            well-formed header (a hub download without a known layout).
        tensors: the manifest ``{name: [dtype, shape, sha256]}``; None hashes without comparing
            (``hashes`` then holds what a manifest would record).
        file_sha256: sha256 hex of the whole file (the hub's LFS pointer), checked at ``finish``.
    """

    def __init__(self, file: str, expected: dict | None, tensors: dict | None, file_sha256: str | None = None):
        self.file, self.expected, self.tensors = file, expected, tensors
        self.hashes: dict[str, list] = {}
        self.pos = 0
        self.total: int | None = None  # file size, known once the header is read
        self._head = bytearray()
        self._header_len: int | None = None
        self._spans: list[tuple[int, int, str, str, list]] = []  # (begin, end, name, dtype, shape)
        self._k = 0
        self._hasher = hashlib.sha256()
        self._file_hasher = hashlib.sha256() if file_sha256 else None
        self._file_sha256 = file_sha256

    def feed(self, data) -> None:
        """Take the next bytes of the file. Raises WeightsMismatch at the first bad header or tensor."""
        view = memoryview(data).cast("B")
        if self._file_hasher is not None:
            self._file_hasher.update(view)
        while len(view):
            if self.total is not None:
                view = self._feed_data(view)
                continue
            want = 8 if self._header_len is None else 8 + self._header_len
            take = min(want - len(self._head), len(view))
            self._head += view[:take]
            self.pos += take
            view = view[take:]
            if len(self._head) < want:
                continue
            if self._header_len is None:
                self._header_len = struct.unpack("<Q", bytes(self._head))[0]
                if not 2 <= self._header_len <= _MAX_HEADER_BYTES:
                    raise self._bad(f"declares a {self._header_len}-byte header")
            else:
                self._parse_header(bytes(self._head[8:]))

    def _parse_header(self, raw: bytes) -> None:
        try:
            header = json.loads(raw)
            entries = header_entries(header)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise self._bad(f"has a malformed header ({e!r})") from None
        if self.expected is not None and entries != self.expected:
            diff = sorted(set(entries) ^ set(self.expected)) or sorted(
                n for n in entries if entries[n] != self.expected.get(n))
            raise self._bad(f"has another header than the manifest's layout (first difference: {diff[0]!r})")
        end = 0
        for name, (dtype, shape, (begin, stop)) in sorted(entries.items(), key=lambda kv: kv[1][2]):
            if begin != end or stop < begin:
                raise self._bad(f"has a gap or overlap at tensor {name!r}")
            if self.tensors is not None:
                known = self.tensors.get(name)
                if known is None or known[0] != dtype or list(known[1]) != list(shape):
                    raise self._bad(f"holds tensor {name!r} {dtype}{shape}, which the manifest does not name so")
            self._spans.append((begin, stop, name, dtype, shape))
            end = stop
        self._data_start = 8 + len(raw)
        self.total = self._data_start + end
        self._finish_empty()

    def _feed_data(self, view: memoryview) -> memoryview:
        if self._k >= len(self._spans):
            raise self._bad(f"is longer than its header says ({self.total} bytes)")
        begin, stop, *_ = self._spans[self._k]
        offset = self.pos - self._data_start
        take = min(len(view), stop - offset)
        self._hasher.update(view[:take])
        self.pos += take
        if offset + take == stop:
            self._close_span()
            self._finish_empty()
        return view[take:]

    def _finish_empty(self) -> None:
        while self._k < len(self._spans) and self._spans[self._k][0] == self._spans[self._k][1]:
            self._close_span()

    def _close_span(self) -> None:
        _, _, name, dtype, shape = self._spans[self._k]
        digest = self._hasher.hexdigest()
        if self.tensors is not None and self.tensors[name][2] != digest:
            raise self._bad(f"tensor {name!r} has sha256 {digest[:16]}..., the manifest says "
                            f"{self.tensors[name][2][:16]}...")
        self.hashes[name] = [dtype, list(shape), digest]
        self._k += 1
        self._hasher = hashlib.sha256()

    def finish(self) -> dict[str, list]:
        """Check that the whole file arrived. Returns ``{name: [dtype, shape, sha256]}`` of its tensors.

        Raises:
            WeightsMismatch: the file is shorter than its header says, or its sha256 is not the expected one.
        """
        if self.total is None or self.pos != self.total or self._k != len(self._spans):
            raise self._bad(f"ended after {self.pos} bytes, before its last tensor")
        if self._file_hasher is not None and self._file_hasher.hexdigest() != self._file_sha256:
            raise self._bad(f"has sha256 {self._file_hasher.hexdigest()[:16]}..., the hub says "
                            f"{self._file_sha256[:16]}...")
        return self.hashes

    def _bad(self, why: str) -> WeightsMismatch:
        return WeightsMismatch(f"{self.file} {why}")


class FileVerifier:
    """Check a small non-weight file (config, tokenizer) against its size and sha256 while it arrives."""

    def __init__(self, file: str, size: int, sha256: str):
        self.file, self.size, self.sha256 = file, size, sha256
        self.pos = 0
        self._hasher = hashlib.sha256()

    def feed(self, data) -> None:
        self.pos += len(data)
        if self.pos > self.size:
            raise WeightsMismatch(f"{self.file} is longer than the {self.size} bytes announced")
        self._hasher.update(data)

    def finish(self) -> dict:
        if self.pos != self.size or self._hasher.hexdigest() != self.sha256:
            raise WeightsMismatch(f"{self.file} does not match its announced size and sha256")
        return {}


def verify_file(path: Path, verifier) -> dict[str, list]:
    """Stream a file on disk through a verifier. Returns ``verifier.finish()``.

    Raises:
        WeightsMismatch: the bytes do not match. ModelError: the file cannot be read.
    """
    buf = bytearray(READ_BLOCK_BYTES)
    view = memoryview(buf)
    try:
        with Path(path).open("rb") as f:
            while n := f.readinto(buf):
                verifier.feed(view[:n])
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e}") from e
    return verifier.finish()


def file_digest(path: Path) -> list:
    """``[size bytes, sha256 hex]`` of a small file."""
    data = Path(path).read_bytes()
    return [len(data), hashlib.sha256(data).hexdigest()]


# ---- warm restart --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CachedWeights:
    """A weights directory fetched earlier, with what it still lacks for a layer range."""

    path: Path
    manifest: WeightsManifest
    missing: tuple[str, ...]  # shard files the range needs that are absent or failed verification


def find_cached(root: Path, name: str, model_id: str | None, layers) -> CachedWeights | None:
    """The best weights directory under ``root`` for a stage, its needed shards re-verified.

    A directory matches when its sidecar names ``model_id`` (if given) or else ``name`` (case
    folded), and it has config.json. Every needed shard present is hashed again against the
    manifest; one that fails is deleted (and reported missing), so nothing unverified is loaded.
    Among matches, the one missing the fewest shards wins (then the newest).

    Args:
        root: ``<cache_root>/weights``. name: ``--model``. model_id: ``--model-id`` or None.
        layers: the stage's LayerRange.
    Returns:
        the directory, or None when none matches.
    """
    candidates = []
    for sidecar in Path(root).glob(f"*/{SIDECAR}"):
        try:
            doc = read_sidecar(sidecar.parent)
            if (doc.get("model_id") != model_id) if model_id else (str(doc.get("name", "")).lower() != name.lower()):
                continue
            manifest = parse_manifest(doc, str(sidecar))
            config = json.loads((sidecar.parent / "config.json").read_text())
            selection = select_shards(manifest.weight_map, config, layers)
        except (SwarmError, OSError, ValueError) as e:  # unreadable, or the range is not in that model
            log.info("weights.cache.skip dir=%s reason=%s", sidecar.parent, e)
            continue
        absent = [s for s in selection.shards if not (sidecar.parent / s).is_file()]
        candidates.append((len(absent), -sidecar.stat().st_mtime, sidecar.parent, manifest, selection))
    if not candidates:
        return None
    _, _, path, manifest, selection = min(candidates, key=lambda c: c[:2])
    return CachedWeights(path, manifest, tuple(reverify(path, manifest, selection.shards)))


def reverify(path: Path, manifest: WeightsManifest, shards) -> list[str]:
    """Hash the present shards among ``shards`` against the manifest; delete any that fail.

    Returns:
        the shards that are absent (or were deleted), in order.
    """
    missing = []
    for shard in shards:
        file = Path(path) / shard
        if not file.is_file():
            missing.append(shard)
            continue
        try:
            verify_file(file, ShardVerifier(shard, manifest.shards[shard], manifest.tensors))
        except ModelError as e:  # WeightsMismatch included
            log.warning("weights.cache.corrupt file=%s reason=%s; deleted, will fetch again", file, e)
            with contextlib.suppress(OSError):
                file.unlink()
            missing.append(shard)
    return missing

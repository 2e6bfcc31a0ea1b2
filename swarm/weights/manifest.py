"""Per-tensor manifest and model id: what names a model on the swarm is its weights, not its name.

Owns: reading safetensors headers, the per-tensor manifest ``{name: [dtype, shape, sha256]}`` of a
checkpoint directory (sha256 of each tensor's exact bytes in the file), the **model id** (sha256
of that manifest in canonical JSON, plus the config's ``num_hidden_layers``), and a cache of
both on disk keyed by every shard's path, size and mtime, so a stage hashes its model once.
May import: stdlib, ``swarm.errors``, ``swarm.weights.store`` (lazily: a directory of only some
shards answers from its sidecar). No torch: hashing reads the files through mmap.

Two checkpoints get the same model id exactly when they hold the same tensors (names, dtypes,
shapes, values), whatever their shard layout or directory name; a stage with other weights
under the same model name therefore never shares a model's DHT key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from pathlib import Path

from swarm.errors import ModelError

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
_MAX_HEADER_BYTES = 100 * 2**20


def read_header(shard: Path) -> dict:
    """Read a safetensors header: a little-endian u64 length, then that many bytes of JSON.

    Raises:
        ModelError: the file is unreadable, or its header length or JSON is malformed.
    """
    try:
        with Path(shard).open("rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 <= n <= min(_MAX_HEADER_BYTES, Path(shard).stat().st_size - 8):
                raise ValueError(f"bad header length {n}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except OSError as e:
        raise ModelError(f"cannot read {shard}: {e}") from e
    except ValueError as e:
        raise ModelError(f"{shard} is not a valid safetensors file: {e}") from e
    return header


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sorted by name.

    Raises:
        ModelError: the directory holds no ``*.safetensors`` file.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors files in {path}")
    return files


def tensor_manifest(path: Path) -> dict[str, list]:
    """Hash every tensor of a checkpoint directory.

    Args:
        path: a directory of ``*.safetensors`` shards (HF layout).
    Returns:
        ``{tensor name: [safetensors dtype, shape list, sha256 hex of its bytes]}``.
    Raises:
        ModelError: a shard is unreadable or truncated, or two shards hold the same tensor name.
    """
    out: dict[str, list] = {}
    for shard in shard_files(path):
        header = read_header(shard)
        base = 8 + struct.unpack("<Q", shard.open("rb").read(8))[0]
        try:
            with shard.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for name, entry in header.items():
                    if name == "__metadata__":
                        continue
                    if name in out:
                        raise ModelError(f"tensor {name!r} appears in two shards of {path}")
                    start, end = entry["data_offsets"]
                    if base + end > len(mm):
                        raise ModelError(f"{shard}: tensor {name!r} lies outside the file (truncated?)")
                    digest = hashlib.sha256(mm[base + start: base + end]).hexdigest()
                    out[name] = [entry["dtype"], list(entry["shape"]), digest]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"malformed safetensors header in {shard}: {e!r}") from e
        except OSError as e:
            raise ModelError(f"cannot read {shard}: {e}") from e
    return out


def manifest_model_id(manifest: dict[str, list], num_layers: int) -> str:
    """The model id of a manifest: sha256 hex over its canonical JSON and the layer count."""
    body = json.dumps({"v": MANIFEST_VERSION, "num_layers": int(num_layers), "tensors": manifest},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def model_id(path: Path, cache_dir: Path | None = None) -> str:
    """The model id of a checkpoint directory (64 hex chars), hashed once and cached.

    Args:
        path: checkpoint directory with ``config.json`` and ``*.safetensors``, or a weights
            directory holding only some shards (``swarm.weights.store``) whose sidecar records the
            full manifest.
        cache_dir: where to keep computed manifests (``<cache_dir>/<key>.json``; the key covers
            each shard's resolved path, size and mtime); None computes without caching.
    Returns:
        sha256 hex of the per-tensor manifest (see ``manifest_model_id``).
    Raises:
        ModelError: config.json is missing or has no ``num_hidden_layers``/``n_layer``, a shard
            cannot be read, or a directory of only some shards does not know its model id (a hub
            download without a manifest).
    """
    mid, _ = load_manifest(path, cache_dir)
    if mid is None:
        raise ModelError(f"{path} holds only some shards of its model and no manifest of the others, so its model "
                         "id is unknown: fetch it with --fetch-from a stage that holds the model, or start the "
                         "stage with --bootstrap (which downloads every shard to compute the id)")
    return mid


def load_manifest(path: Path, cache_dir: Path | None = None) -> tuple[str | None, dict[str, list]]:
    """The model id and per-tensor manifest of a checkpoint directory (hashed once, cached as ``model_id``).

    A weights directory with a sidecar (only some shards) returns the sidecar's id and manifest,
    after checking that the headers of the shards it holds agree with it (their values were hashed
    when they were fetched, and are hashed again before a stage loads them).

    Returns:
        (model id or None when unknown, ``{name: [dtype, shape, sha256]}``).
    Raises:
        ModelError: as ``model_id``.
    """
    from swarm.weights.store import local_layout, sidecar_manifest

    path = Path(path)
    partial = sidecar_manifest(path)
    if partial is not None:
        held = [f for f in partial.shards if (path / f).is_file()]
        for file, entries in local_layout(path, held).items():
            if entries != partial.shards[file]:
                raise ModelError(f"{path / file} does not match the layout its sidecar records")
        return partial.model_id, partial.tensors
    num_layers = _num_layers(path)
    key = None
    if cache_dir is not None:
        h = hashlib.sha256(f"swarm-manifest-cache-v{MANIFEST_VERSION}\n".encode())
        for shard in shard_files(path):
            st = shard.stat()
            h.update(f"{shard.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        key = Path(cache_dir) / f"{h.hexdigest()[:32]}.json"
        try:
            cached = json.loads(key.read_text())
            if (cached.get("num_layers") == num_layers and isinstance(cached.get("model_id"), str)
                    and isinstance(cached.get("tensors"), dict)):
                return cached["model_id"], cached["tensors"]
        except (OSError, ValueError, AttributeError):
            pass
    manifest = tensor_manifest(path)
    mid = manifest_model_id(manifest, num_layers)
    if key is not None:
        _write_atomic(key, json.dumps({"model_id": mid, "num_layers": num_layers, "path": str(path),
                                       "tensors": manifest}, sort_keys=True))
    log.info("model.id path=%s tensors=%d id=%s", path, len(manifest), mid[:16])
    return mid, manifest


def _num_layers(path: Path) -> int:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}") from e
    for name in ("num_hidden_layers", "n_layer"):
        if isinstance(config.get(name), int):
            return config[name]
    raise ModelError(f"{path / 'config.json'} names no num_hidden_layers")


def _write_atomic(target: Path, text: str) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".manifest-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except OSError as e:  # a read-only cache costs a re-hash next time, nothing else
        log.warning("model.manifest_not_cached path=%s error=%s", target, e)

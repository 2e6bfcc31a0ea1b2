"""The model id of a weights directory, computed once and cached on disk.

Owns: ``model_id`` and ``load_manifest``: a whole checkpoint is hashed (``swarm.weights.manifest``) and cached by
every shard's path, size and mtime; a directory of only some shards answers from its sidecar. No torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from swarm.errors import ModelError
from swarm.files import write_atomic
from swarm.weights.manifest import MANIFEST_VERSION, manifest_model_id, shard_files, tensor_manifest
from swarm.weights.store import local_layout, sidecar_manifest

log = logging.getLogger(__name__)


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
        try:
            write_atomic(key, json.dumps({"model_id": mid, "num_layers": num_layers, "path": str(path),
                                          "tensors": manifest}, sort_keys=True), mode=0o600)
        except OSError as e:  # a read-only cache costs a re-hash next time, nothing else
            log.warning("model.manifest_not_cached path=%s error=%s", key, e)
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

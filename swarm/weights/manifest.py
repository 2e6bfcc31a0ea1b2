"""Per-tensor manifest and model id: what names a model on the swarm is its weights, not its name.

Owns: safetensors headers (``read_header``), the manifest ``{name: [dtype, shape, sha256]}`` of a checkpoint
(``tensor_manifest``, read through mmap) and the **model id** (``manifest_model_id``): the same tensors give the
same id whatever the shards or the directory's name. No torch; the id cached on disk is ``identify``'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import struct
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

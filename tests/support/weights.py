"""Helpers for the weights tests: resharded synthetic checkpoints, in-process weights servers, byte flips."""

from __future__ import annotations

import json
import shutil
import struct
from contextlib import asynccontextmanager
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair

from swarm.transport.host import open_host
from swarm.weights.peer import PROTOCOL_ID, REQUEST_MAX_BYTES, WeightsServer

INDEX = "model.safetensors.index.json"


def reshard(src: Path, out: Path, groups: list[list[str]] | None = None) -> Path:
    """Copy a one-file checkpoint into shards: by default one per decoder layer, one for the embedding
    and one for the rest (final norm, LM head); writes the index and a small tokenizer file."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(src) / "model.safetensors"))
    if groups is None:
        by_key: dict[str, list[str]] = {}
        for name in sorted(tensors):
            parts = name.split(".")
            key = f"layer{int(parts[2]):03d}" if parts[1] in ("layers", "h") and parts[2].isdigit() else \
                "a-embed" if parts[1] in ("embed_tokens", "wte", "wpe") else "z-rest"
            by_key.setdefault(key, []).append(name)
        groups = [by_key[k] for k in sorted(by_key)]
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update((n, file) for n in names)
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in Path(src).iterdir():
        if f.suffix == ".json" and f.name != INDEX:
            shutil.copy(f, out / f.name)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return out


def shards_of(path: Path) -> set[str]:
    return {p.name for p in Path(path).glob("*.safetensors")}


def flip_byte(shard: Path, tensor: str, offset: int = 5) -> None:
    """Flip one byte inside ``tensor``'s data in a safetensors file (its header stays the same)."""
    raw = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    raw[8 + n + begin + min(offset, end - begin - 1)] ^= 0x01
    shard.write_bytes(bytes(raw))


class LyingServer(WeightsServer):
    """A peer that claims another checkpoint's manifest (model id and hashes) for its own files."""

    def __init__(self, model_dir: Path, claim_dir: Path, model_name: str):
        super().__init__(model_dir, model_name)
        self.claim_dir = claim_dir

    def _build_reply(self) -> dict:
        reply = super()._build_reply()
        honest = WeightsServer(self.claim_dir, self.model_name)._build_reply()
        return {**reply, "model_id": honest["model_id"], "tensors": honest["tensors"]}


@asynccontextmanager
async def weights_peer(server: WeightsServer):
    """A loopback host (port 0) serving ``server``; yields its first address."""
    async with open_host(create_new_key_pair()) as host:
        host.set_handler(PROTOCOL_ID, server.handle, max_frame_bytes=REQUEST_MAX_BYTES)
        yield host.addrs()[0]


@asynccontextmanager
async def client_host():
    async with open_host(create_new_key_pair()) as host:
        yield host

"""weights/peer.py on loopback between in-process hosts: a stage fetches only its shards, verified;
tampered or missing tensors send it to the next peer; a warm restart fetches nothing."""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import trio
from libp2p.exceptions import BaseLibp2pError

from swarm.config import StageConfig
from swarm.errors import ConfigError, ModelError
from swarm.model.block import load_block
from swarm.model.resolve import model_manifest_digest, tensor_index
from swarm.ranges import LayerRange
from swarm.transport.framing import encode_frame
from swarm.stage.acquire import acquire_model
from swarm.weights.manifest import tensor_manifest
from swarm.weights.identify import model_id
from swarm.weights.peer import PROTOCOL_ID, WeightsServer, fetch_weights
from swarm.weights.store import SIDECAR
from tests.support.cli import run_cli
from tests.support.transport import run
from tests.support.weights import LyingServer, client_host, flip_byte, reshard, shards_of, weights_peer

NAME = "tiny-llama"
MIDDLE = LayerRange(1, 3)
MIDDLE_SHARDS = {"model-00003-of-00006.safetensors", "model-00004-of-00006.safetensors"}  # layers 1 and 2


@pytest.fixture(scope="module")
def source(synthetic, tmp_path_factory) -> Path:
    """A 4-layer Llama in 6 shards: embedding, one per layer, final norm + LM head."""
    return reshard(synthetic("llama", dtype="float32"), tmp_path_factory.mktemp("src") / "tiny-llama")


def _fetch(peers, root, layers=MIDDLE, name=NAME, expect=None):
    async def main():
        async with client_host() as host:
            return await fetch_weights(host, peers, name=name, layers=layers, root=root, expect_model_id=expect,
                                       timeout_s=5.0)
    return main


def _same_block(a: Path, b: Path, layers: LayerRange) -> None:
    """Two directories give the same block: same tensors, bit-identical output for the same input."""
    x, y = load_block(a, layers, dtype="float32", device="cpu"), load_block(b, layers, dtype="float32", device="cpu")
    assert sorted(x.loaded_tensors) == sorted(y.loaded_tensors) and x.range_digest == y.range_digest
    hidden = torch.randn(1, 3, x.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x.forward(x.new_cache(16), 0, hidden=hidden), y.forward(y.new_cache(16), 0, hidden=hidden))


@pytest.mark.ring
def test_fetches_only_its_shards_and_equals_the_source(source, tmp_path):
    async def main():
        async with weights_peer(WeightsServer(source, NAME)) as addr:
            return await _fetch([addr], tmp_path / "w")()
    got = run(main, timeout_s=30)
    assert got.path is not None and not got.failures and not got.missing
    assert shards_of(got.path) == MIDDLE_SHARDS
    assert got.fetched_bytes == sum((got.path / f).stat().st_size for f in MIDDLE_SHARDS) + sum(
        (got.path / f).stat().st_size for f in ("config.json", "generation_config.json", "tokenizer_config.json"))
    held = tensor_manifest(got.path)
    full = tensor_manifest(source)
    assert held and all(full[n] == held[n] for n in held)  # values equal the source's, tensor for tensor
    # the partial directory answers like the full one: model id, layout digest, loader
    assert model_id(got.path) == got.model_id == model_id(source)
    assert model_manifest_digest(got.path) == model_manifest_digest(source)
    assert set(tensor_index(got.path)) == set(held)
    _same_block(got.path, source, MIDDLE)
    with pytest.raises(ModelError, match="lacks tensor"):  # a range it does not hold is refused by name
        load_block(got.path, LayerRange(0, 2), device="cpu")
    assert not list(got.path.glob(".incoming-*"))


@pytest.mark.ring
def test_without_layers_only_the_manifest_and_small_files_come_then_the_placed_block(source, tmp_path):
    """A stage placing itself (no --layers) first gets what placement needs, no shard; its memory
    fit reads the manifest's shapes; once placed, the same directory gets only that block's shards."""
    from swarm.stage.preflight import layers_that_fit

    async def main():
        async with weights_peer(WeightsServer(source, NAME)) as addr:
            meta = await _fetch([addr], tmp_path / "w", layers=None)()
            return meta, shards_of(meta.path), await _fetch([addr], tmp_path / "w")()
    meta, meta_shards, block = run(main, timeout_s=30)
    assert meta.path is not None and not meta.missing and meta_shards == set()
    assert {p.name for p in meta.path.iterdir() if p.is_file()} >= {"config.json", SIDECAR}
    assert model_id(meta.path) == model_id(source)  # the id is known before any shard is here
    for budget in (0.05, 0.2, 1000):
        assert layers_that_fit(meta.path, dtype="float32", device="cpu", budget_mb=budget) == \
            layers_that_fit(source, dtype="float32", device="cpu", budget_mb=budget)
    assert block.path == meta.path and shards_of(block.path) == MIDDLE_SHARDS


@pytest.mark.ring
def test_tampered_peer_is_detected_and_the_next_peer_serves(source, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    flip_byte(bad / "model-00004-of-00006.safetensors", "model.layers.2.mlp.up_proj.weight")
    root = tmp_path / "w"

    async def main(with_honest: bool):
        async with weights_peer(LyingServer(bad, source, NAME)) as liar, weights_peer(WeightsServer(source, NAME)) \
                as honest:
            return await _fetch([liar, honest] if with_honest else [liar], root)()

    alone = run(main, False, timeout_s=30)
    assert alone.path is None and alone.missing == ["model-00004-of-00006.safetensors"]
    assert any("model.layers.2.mlp.up_proj.weight" in f and "sha256" in f for f in alone.failures), alone.failures
    dest = next(root.iterdir())
    # nothing tampered is kept: the bad shard was never renamed in, no temp file is left
    assert "model-00004-of-00006.safetensors" not in shards_of(dest) and not list(dest.glob(".incoming-*"))

    got = run(main, True, timeout_s=30)
    assert got.path == dest and not got.missing and shards_of(dest) == MIDDLE_SHARDS
    assert any("sha256" in f for f in got.failures)  # the liar was tried first and caught again
    assert tensor_manifest(dest)["model.layers.2.mlp.up_proj.weight"] == \
        tensor_manifest(source)["model.layers.2.mlp.up_proj.weight"]
    _same_block(dest, source, MIDDLE)


@pytest.mark.ring
def test_peer_without_the_tensors_is_skipped(source, tmp_path):
    partial = tmp_path / "partial"  # a stage that fetched layers [0, 2) only
    async def seed():
        async with weights_peer(WeightsServer(source, NAME)) as addr:
            return await _fetch([addr], tmp_path / "seed", layers=LayerRange(0, 2))()
    shutil.copytree(run(seed, timeout_s=30).path, partial)

    async def main(peers_of):
        async with weights_peer(WeightsServer(partial, NAME)) as a, weights_peer(WeightsServer(source, NAME)) as b:
            return await _fetch(peers_of(a, b), tmp_path / "w")()

    only_partial = run(main, lambda a, b: [a], timeout_s=30)
    assert only_partial.path is None and only_partial.missing == ["model-00004-of-00006.safetensors"]
    got = run(main, lambda a, b: [a, b], timeout_s=30)
    assert got.path is not None and shards_of(got.path) == MIDDLE_SHARDS
    # a partial directory serves what it holds, under the full model id
    assert model_id(partial) == model_id(source)


@pytest.mark.ring
def test_unreachable_and_wrong_peers_fall_through(source, tmp_path):
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"

    async def main():
        async with weights_peer(WeightsServer(source, "another-name")) as other, \
                weights_peer(WeightsServer(source, NAME)) as good:
            named = await _fetch([dead, other, good], tmp_path / "w")()
            expected = await _fetch([other], tmp_path / "w2", name="whatever", expect=model_id(source))()
            wrong_id = await _fetch([good], tmp_path / "w3", expect="ab" * 32)()
            return named, expected, wrong_id

    named, expected, wrong_id = run(main, timeout_s=40)
    assert named.path is not None
    assert "unreachable" in named.failures[0] or "timed out" in named.failures[0]
    assert f"--model-id {model_id(source)}" in named.failures[1]  # names the id to pass to accept it
    assert expected.path is not None  # the expected id decides, not the name
    assert wrong_id.path is None and "not abababab" in wrong_id.failures[0]


def test_circuit_addresses_are_refused(tmp_path):
    circuit = ("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit/p2p/"
               "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN")
    with pytest.raises(ConfigError, match="never fetched through a relay"):  # checked before anything is dialed
        trio.run(lambda: fetch_weights(None, [circuit], name=NAME, layers=MIDDLE, root=tmp_path))
    with pytest.raises(ConfigError, match="never fetched through a relay"):
        StageConfig.of(model=NAME, layers=MIDDLE, fetch_from=(circuit,))
    with pytest.raises(ConfigError, match="/p2p/<PeerId>"):
        StageConfig.of(model=NAME, layers=MIDDLE, fetch_from=("/ip4/127.0.0.1/tcp/4001",))
    with pytest.raises(ConfigError, match="never fetched through a relay"):  # a placed stage's peers too
        StageConfig.of(model=NAME, layers=None, bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/x",), fetch_from=(circuit,))
    with pytest.raises(ConfigError, match="64 lowercase hex"):
        StageConfig.of(model=NAME, layers=MIDDLE, model_id="ABC")
    done = run_cli("stage", "--model", NAME, "--layers", "1:3", "--fetch-from", circuit)
    assert done.returncode == 1 and done.stdout.startswith("SWARM_STAGE_FATAL") and "relay" in done.stdout


@pytest.mark.ring
def test_bad_requests_leave_the_server_serving(source, tmp_path):
    async def main():
        async with weights_peer(WeightsServer(source, NAME)) as addr, client_host() as host:
            answers = []
            for request in ({"t": "get", "file": "../config.json"}, {"t": "get", "file": SIDECAR},
                            {"t": "get", "file": "model-00009-of-00009.safetensors"}, {"t": "nonsense"}):
                raw = await host.open_raw_stream(addr, PROTOCOL_ID)
                await raw.write(encode_frame(request))
                body = b""
                while len(body) < 4 or len(body) < 4 + struct.unpack(">I", body[:4])[0]:
                    body += await raw.read(4096)
                answers.append(body)
                await raw.close()
            raw = await host.open_raw_stream(addr, PROTOCOL_ID)  # a malformed frame: the stream is reset
            await raw.write(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")
            with trio.fail_after(5), contextlib.suppress(EOFError, BaseLibp2pError):  # EOF or reset: the end
                while await raw.read(4096):
                    pass
            return answers, await fetch_weights(host, [addr], name=NAME, layers=MIDDLE, root=tmp_path / "w")

    answers, got = run(main, timeout_s=30)
    assert all(b"error" in a for a in answers)
    assert b"not held here" in answers[0] and b"not held here" in answers[1] and b"unknown request" in answers[3]
    assert got.path is not None  # the same server still serves a well-formed fetch


@pytest.mark.ring
def test_warm_restart_reverifies_and_fetches_nothing(source, tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "weights"

    async def seed():
        async with weights_peer(WeightsServer(source, NAME)) as addr:
            return await _fetch([addr], root)()
    first = run(seed, timeout_s=30).path
    mtimes = {f: (first / f).stat().st_mtime_ns for f in MIDDLE_SHARDS}
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    config = StageConfig.of(model=NAME, layers=MIDDLE, fetch_from=(dead,))
    # the only peer is down: a restart can only succeed from its own verified files
    resolved = acquire_model(config)
    assert resolved.path == first and {f: (first / f).stat().st_mtime_ns for f in MIDDLE_SHARDS} == mtimes
    _same_block(resolved.path, source, MIDDLE)
    # a shard changed on disk since: re-verification deletes it, and with no peer the start fails
    flip_byte(first / "model-00003-of-00006.safetensors", "model.layers.1.self_attn.q_proj.weight")
    with pytest.raises(ModelError, match="no peer could supply"):
        acquire_model(config)
    assert "model-00003-of-00006.safetensors" not in shards_of(first)


@pytest.mark.ring
def test_sidecar_records_source_and_manifest(source, tmp_path):
    async def main():
        async with weights_peer(WeightsServer(source, NAME)) as addr:
            return await _fetch([addr], tmp_path / "w")(), addr
    got, addr = run(main, timeout_s=30)
    doc = json.loads((got.path / SIDECAR).read_text())
    assert doc["name"] == NAME and doc["source"] == {"kind": "peers", "peers": [addr]}
    assert doc["model_id"] == model_id(source) and doc["tensors"] == tensor_manifest(source)
    assert set(doc["shards"]) == shards_of(source)


def test_wire_writes_fill_one_noise_message():
    """The pinned constants behind WRITE_BYTES: one write is one Yamux frame is one Noise message."""
    import libp2p.security.noise.io as noise_io
    import libp2p.stream_muxer.yamux.yamux as yamux

    from swarm.weights.peer import WRITE_BYTES

    assert WRITE_BYTES + yamux.HEADER_SIZE == noise_io.MAX_PLAINTEXT_LENGTH == 65535 - 16
    assert WRITE_BYTES <= yamux.MAX_MESSAGE_SIZE - yamux.HEADER_SIZE  # Yamux does not cut it again


@pytest.mark.process
def test_fetch_path_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, swarm.stage.acquire, swarm.weights.hub, swarm.weights.peer, swarm.weights.select, "
            "swarm.weights.store; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])

"""weights/hub.py against a local fake of the hub that records what was asked for: a stage downloads only
its shards, pinned to one commit, each checked; a warm restart asks the hub nothing."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from swarm.config import StageConfig
from swarm.errors import ModelError, WeightsMismatch
from swarm.model.block import load_block
from swarm.model.resolve import model_manifest_digest
from swarm.stage.preflight import preflight
from swarm.ranges import LayerRange
from swarm.stage.acquire import acquire_model
from swarm.weights.hub import fetch_from_hub
from swarm.weights.identify import load_manifest, model_id
from swarm.weights.store import WeightsManifest, local_layout
from tests.support.weights import flip_byte, reshard, shards_of

REPO = "org/tiny"
SHA = "c0ffee" + "0" * 34
SMALL = {"config.json", "generation_config.json", "tokenizer_config.json"}


class FakeHub:
    """The parts of huggingface_hub a stage calls, over a local directory; records every call."""

    def __init__(self, repo_dir: Path, cache: Path):
        self.repo_dir, self.cache = repo_dir, cache
        self.calls: list[tuple] = []
        self.lfs_override: dict[str, str] = {}

    @property
    def downloads(self) -> list[str]:
        return [c[1] for c in self.calls if c[0] == "download"]

    def api(self):
        return self

    def model_info(self, repo_id, timeout=None, files_metadata=False, **_):
        self.calls.append(("model_info", repo_id))
        assert repo_id == REPO and files_metadata and timeout is not None
        siblings = []
        for f in sorted(self.repo_dir.iterdir()):
            lfs = None
            if f.suffix == ".safetensors":
                lfs = SimpleNamespace(sha256=self.lfs_override.get(f.name, hashlib.sha256(f.read_bytes()).hexdigest()))
            siblings.append(SimpleNamespace(rfilename=f.name, lfs=lfs))
        siblings.append(SimpleNamespace(rfilename="README.md", lfs=None))  # never downloaded
        return SimpleNamespace(sha=SHA, siblings=siblings)

    def get_safetensors_metadata(self, repo_id, revision=None, timeout=None, **_):
        from swarm.weights.manifest import read_header

        self.calls.append(("metadata", repo_id, revision))
        assert revision == SHA
        files = {}
        for f in sorted(self.repo_dir.glob("*.safetensors")):
            tensors = {n: SimpleNamespace(dtype=e["dtype"], shape=e["shape"], data_offsets=tuple(e["data_offsets"]))
                       for n, e in read_header(f).items() if n != "__metadata__"}
            files[f.name] = SimpleNamespace(tensors=tensors)
        return SimpleNamespace(files_metadata=files)

    def hf_hub_download(self, repo_id, filename, *, revision=None, **_):
        self.calls.append(("download", filename, revision))
        assert repo_id == REPO and revision == SHA, "every file is pinned to the resolved commit"
        target = self.cache / revision / filename  # as huggingface_hub's snapshot directory
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.repo_dir / filename, target)
        return str(target)


@pytest.fixture(scope="module")
def repo(synthetic, tmp_path_factory) -> Path:
    """A 4-layer tied Qwen2 in 6 shards: embedding, one per layer, final norm."""
    return reshard(synthetic("qwen2", dtype="float32", tie_word_embeddings=True), tmp_path_factory.mktemp("hub") / "r")


@pytest.fixture
def hub(repo, tmp_path, monkeypatch) -> FakeHub:
    import huggingface_hub

    fake = FakeHub(repo, tmp_path / "hf-cache")
    monkeypatch.setattr(huggingface_hub, "HfApi", fake.api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("SWARM_CACHE", str(tmp_path / "cache"))
    return fake


def shard(i: int) -> str:
    return f"model-{i:05d}-of-00006.safetensors"


def test_stage_downloads_only_its_shards(hub, repo):
    resolved = acquire_model(StageConfig.of(model=REPO, layers=LayerRange(1, 3)))
    assert sorted(hub.downloads) == sorted(SMALL | {shard(3), shard(4)})  # layers 1, 2; no README, no index
    assert all(c[-1] == SHA for c in hub.calls if c[0] != "model_info")
    path = resolved.path
    assert shards_of(path) == {shard(3), shard(4)} and resolved.name == REPO
    # what the ring checks and the loader reads agree with the full checkpoint
    assert model_manifest_digest(path) == model_manifest_digest(repo)
    block, full = load_block(path, LayerRange(1, 3), device="cpu"), load_block(repo, LayerRange(1, 3), device="cpu")
    assert block.range_digest == full.range_digest
    # the hashes were recorded, but without every tensor the model id is unknown (and says so)
    mid, tensors = load_manifest(path)
    assert mid is None and tensors == {n: e for n, e in load_manifest(repo)[1].items() if n in tensors}
    with pytest.raises(ModelError, match="model id is unknown"):
        model_id(path)


def test_tied_tail_gets_the_embedding_shard(hub):
    resolved = acquire_model(StageConfig.of(model=REPO, layers=LayerRange(3, 4)))
    assert shards_of(resolved.path) == {shard(1), shard(5), shard(6)}  # embedding (tied head), layer 3, norm
    assert set(hub.downloads) - SMALL == {shard(1), shard(5), shard(6)}


def test_warm_restart_asks_the_hub_nothing(hub, repo):
    first = acquire_model(StageConfig.of(model=REPO, layers=LayerRange(1, 3))).path
    hub.calls.clear()
    again = acquire_model(StageConfig.of(model=REPO, layers=LayerRange(1, 3)))
    assert again.path == first and hub.calls == []
    # an overlapping range downloads only the shard it lacks, into the same directory
    wider = acquire_model(StageConfig.of(model=REPO, layers=LayerRange(1, 4)))
    assert wider.path == first and set(hub.downloads) - SMALL == {shard(5), shard(6), shard(1)}
    # --check finds the fetched weights without the hub
    hub.calls.clear()
    ok = preflight(StageConfig.of(model=REPO, layers=LayerRange(1, 3), key_path=first.parent / "k.key"))
    assert ok["model_digest"] == model_manifest_digest(repo) and ok["tensors"] > 0 and hub.calls == []


def test_stage_on_the_dht_downloads_everything_to_know_its_id(hub, repo):
    resolved = acquire_model(StageConfig.of(model=REPO, layers=LayerRange(1, 3), bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/x",)))
    assert shards_of(resolved.path) == shards_of(repo)
    assert model_id(resolved.path) == model_id(repo)
    bad = "ab" * 32
    with pytest.raises(WeightsMismatch, match=f"not {bad}"):
        fetch_from_hub(REPO, LayerRange(1, 3), resolved.path.parent / "other", expect_model_id=bad)


def test_downloads_are_checked_against_a_known_manifest(hub, repo, tmp_path):
    mid, tensors = load_manifest(repo)
    manifest = WeightsManifest(mid, 4, tensors, local_layout(repo, sorted(shards_of(repo))))
    tampered = tmp_path / "tampered-repo"
    shutil.copytree(repo, tampered)
    flip_byte(tampered / shard(4), "model.layers.2.mlp.down_proj.weight")
    hub.repo_dir = tampered
    hub.lfs_override[shard(4)] = hashlib.sha256((repo / shard(4)).read_bytes()).hexdigest()  # LFS agrees with neither
    with pytest.raises(WeightsMismatch, match="model.layers.2.mlp.down_proj.weight"):
        fetch_from_hub(REPO, LayerRange(1, 3), tmp_path / "w", manifest=manifest)
    dest = next((tmp_path / "w").iterdir())
    assert shard(4) not in shards_of(dest) and not list(dest.glob(".incoming-*"))  # nothing tampered kept
    assert not (hub.cache / SHA / shard(4)).exists()  # nor left in the hub cache for the next attempt
    # with the honest repo, the same manifest passes and the directory knows the full model id
    hub.repo_dir, hub.lfs_override = repo, {}
    path = fetch_from_hub(REPO, LayerRange(1, 3), tmp_path / "w", manifest=manifest)
    assert model_id(path) == mid and shards_of(path) == {shard(3), shard(4)}


def test_hub_lfs_sha256_is_checked(hub, repo, tmp_path):
    hub.lfs_override[shard(3)] = "0" * 64
    with pytest.raises(WeightsMismatch, match="the hub says"):
        fetch_from_hub(REPO, LayerRange(1, 2), tmp_path / "w")
    assert shard(3) not in shards_of(next((tmp_path / "w").iterdir()))


def test_offline_fails_fast_and_clearly(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="offline"):
        fetch_from_hub(REPO, LayerRange(1, 2), tmp_path / "w")
    # a stage tries a full snapshot downloaded earlier, and without one reports the hub's reason
    with pytest.raises(ModelError, match="offline"):
        acquire_model(StageConfig.of(model=REPO, layers=LayerRange(1, 2)))
    assert hub.calls == []

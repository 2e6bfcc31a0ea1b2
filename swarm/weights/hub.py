"""A stage's own shards from the Hugging Face hub, pinned to one commit, each tensor checked.

Owns: ``fetch_from_hub``: the repo's commit, its safetensors layout (headers only), the small files and only the
shards holding the stage's tensors at that commit, each verified in huggingface_hub's cache before it is linked
into the weights directory. No torch. What it trusts without a manifest: docs/architecture.md, "Known limits".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from swarm.errors import ModelError, WeightsMismatch
from swarm.weights.manifest import manifest_model_id
from swarm.weights.select import metadata_files, num_layers_of, select_shards
from swarm.weights.store import (ShardVerifier, WeightsManifest, file_digest, layout_key, sidecar_manifest, verify_file,
                                 weights_dir, write_sidecar)

log = logging.getLogger(__name__)

HUB_TIMEOUT_S = 5.0  # first request to the hub: fail within seconds when offline
_TRUE = {"1", "on", "yes", "true"}


def fetch_from_hub(repo_id: str, layers, root: Path, *, name: str | None = None,
                   manifest: WeightsManifest | None = None, expect_model_id: str | None = None,
                   need_model_id: bool = False, timeout_s: float = HUB_TIMEOUT_S) -> Path:
    """Download the files a stage holding ``layers`` needs from a hub repo into a weights directory.

    Args:
        repo_id: ``org/name``.
        layers: the stage's LayerRange.
        root: where weights directories live (``<cache_root>/weights``).
        name: the model name to record (default ``repo_id``).
        manifest: a manifest known from peers (hashes to its model id): every downloaded tensor must
            match it, and the repo must hold exactly its tensors.
        expect_model_id: the id the weights must have; without ``manifest`` every shard is
            downloaded to check it.
        need_model_id: without ``manifest``, download every shard so the model id is known.
        timeout_s: timeout of the hub's metadata requests and download ETag checks, in seconds.
    Returns:
        the weights directory (config, tokenizer files, index, the needed shards, sidecar).
    Raises:
        ModelError: offline or unreachable hub, unknown repo, no safetensors, a family or range the
            selection cannot serve. WeightsMismatch: a file that does not match its layout, manifest,
            LFS sha256, or the expected model id (nothing of it is kept).
    """
    import huggingface_hub as hf
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, HTTPError, RepositoryNotFoundError

    prefix = f"cannot download {repo_id!r} from the Hugging Face hub"
    if constants.HF_HUB_OFFLINE or any(os.environ.get(v, "").strip().lower() in _TRUE
                                          for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        raise ModelError(f"{prefix}: offline (HF_HUB_OFFLINE is set); pass a local directory, a .gguf file, or "
                         "--fetch-from a stage that holds the model")
    try:
        api = hf.HfApi()
        info = api.model_info(repo_id, timeout=timeout_s, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        if not any(f.endswith(".safetensors") for f in siblings):
            raise ModelError(f"hub repo {repo_id!r} has no safetensors weights (required); pass a local directory "
                             "or a .gguf file")
        meta = api.get_safetensors_metadata(repo_id, revision=info.sha, timeout=timeout_s)
        layout = {file: {n: [t.dtype, list(t.shape), list(t.data_offsets)] for n, t in fm.tensors.items()}
                  for file, fm in meta.files_metadata.items()}
        return _fetch(hf, repo_id, info.sha, siblings, layout, layers, Path(root), name or repo_id, manifest,
                      expect_model_id, need_model_id, timeout_s)
    except RepositoryNotFoundError as e:
        raise ModelError(f"{prefix}: repository not found (or gated/private; log in with `hf auth login`)") from e
    except (HTTPError, OSError) as e:  # DNS/connect/timeout errors, OfflineModeIsEnabled, 5xx
        what = "the hub answered with an error" if isinstance(e, HfHubHTTPError) else "no network access"
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        raise ModelError(f"{prefix}: {what} ({type(e).__name__}: {first_line})") from e


def _fetch(hf, repo_id, sha, siblings, layout, layers, root, name, manifest, expect_model_id, need_model_id,
           timeout_s) -> Path:
    if manifest is not None:
        ours = {n: e[:2] for n, e in manifest.tensors.items()}
        theirs = {n: e[:2] for entries in layout.values() for n, e in entries.items()}
        if ours != theirs:
            raise ModelError(f"hub repo {repo_id}@{sha[:12]} holds other tensors than the manifest of model id "
                             f"{manifest.model_id[:16]}...")
        manifest = WeightsManifest(manifest.model_id, manifest.num_layers, manifest.tensors, layout)
    probe = manifest or WeightsManifest(None, 1, {}, layout)
    dest = weights_dir(root, name, layout_key(probe, f"hub:{repo_id}@{sha}"))
    dest.mkdir(parents=True, exist_ok=True)

    def download(file: str) -> Path:
        """Into huggingface_hub's own cache (shared with coordinators and transformers), at ``sha``."""
        log.info("weights.hub.download repo=%s revision=%s file=%s", repo_id, sha[:12], file)
        return Path(hf.hf_hub_download(repo_id, file, revision=sha, etag_timeout=timeout_s))

    small = metadata_files(siblings)
    if "config.json" not in small:
        raise ModelError(f"hub repo {repo_id}@{sha[:12]} has no config.json")
    for file in small:
        _place(download(file), dest / file)
    config = json.loads((dest / "config.json").read_text())
    num_layers = num_layers_of(config)
    if manifest is not None and num_layers != manifest.num_layers:
        raise WeightsMismatch(f"hub config.json says {num_layers} layers, the manifest {manifest.num_layers}")
    weight_map = {n: file for file, entries in layout.items() for n in entries}
    want_all = manifest is None and (need_model_id or expect_model_id is not None)
    shards = sorted(layout) if want_all else list(select_shards(weight_map, config, layers).shards)
    prior = sidecar_manifest(dest)  # hashes of shards an earlier run downloaded here
    known = manifest.tensors if manifest is not None else dict(prior.tensors if prior else {})
    hashes: dict[str, list] = {}
    verified: list[tuple[Path, Path]] = []
    for shard in shards:
        here = dest / shard
        if here.is_file() and all(n in known for n in layout[shard]):
            try:
                hashes.update(verify_file(here, ShardVerifier(shard, layout[shard], known)))
                continue
            except WeightsMismatch as e:
                log.warning("weights.cache.corrupt file=%s reason=%s; downloading again", here, e)
                here.unlink()
        lfs = getattr(siblings.get(shard), "lfs", None)
        got = download(shard)
        try:
            hashes.update(verify_file(got, ShardVerifier(shard, layout[shard], manifest.tensors if manifest else None,
                                                         getattr(lfs, "sha256", None))))
        except WeightsMismatch:
            _forget(got)  # huggingface_hub would hand the same bad bytes to the next attempt
            raise
        verified.append((got, here))
        if not want_all:
            _place(got, here)  # verified: it may be used
    if manifest is None:
        tensors = {**known, **hashes}
        mid = manifest_model_id(tensors, num_layers) if set(tensors) == set(weight_map) else None
        if expect_model_id is not None and mid != expect_model_id:
            raise WeightsMismatch(f"hub repo {repo_id}@{sha[:12]} holds model id {mid}, not {expect_model_id}")
        manifest = WeightsManifest(mid, num_layers, tensors, layout)
        for got, here in verified if want_all else ():
            _place(got, here)
    write_sidecar(dest, manifest, name=name, source={"kind": "hub", "repo": repo_id, "revision": sha},
                  files={f: file_digest(dest / f) for f in small})
    log.info("weights.hub.done repo=%s revision=%s dir=%s shards=%s", repo_id, sha[:12], dest, shards)
    return dest


def _place(src: Path, final: Path) -> None:
    """Put a verified file from huggingface_hub's cache into the weights directory: a hard link to the
    blob where the filesystem allows (no second copy on disk), else a copy; atomic either way."""
    blob = Path(src).resolve()
    tmp = final.parent / f".incoming-{final.name}.{os.getpid()}.part"
    with contextlib.suppress(OSError):
        tmp.unlink()
    try:
        os.link(blob, tmp)
    except OSError:
        shutil.copyfile(blob, tmp)
    os.replace(tmp, final)


def _forget(cached: Path) -> None:
    """Remove a downloaded file (its blob and the snapshot's link to it) from huggingface_hub's cache."""
    for path in (Path(cached).resolve(), Path(cached)):
        with contextlib.suppress(OSError):
            path.unlink()

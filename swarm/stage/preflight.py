"""``swarm stage --check``: everything a stage needs, checked without listening or dialing.

Owns: the preflight of a ``StageConfig``: engine imports, the model resolved locally (the hub offline), its
family, the layer range, every tensor and its dtype, the device, the key file, the memory it will need, and the
kernels it would run (the fma kernels are built here if no installed library serves).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from swarm.config import StageConfig
from swarm.errors import ConfigError, ModelError
from swarm.ranges import LayerRange

# safetensors dtypes a stage can load (converted to the stage dtype on load)
LOADABLE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
PUBLISHED = ("F8_E4M3", "F8_E5M2", "U8")  # an FP8 checkpoint's weights, an MXFP4 one's blocks and scales
BASELINE_BYTES = 350 * 2**20  # Python + torch + transformers + libp2p in a stage process (measured ~300 MiB)


def available_memory(device) -> int | None:
    """Bytes of memory available on ``device`` now (CUDA: free device memory; CPU: MemAvailable),
    or None where this platform does not say."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_key(path: Path | None) -> dict:
    from swarm.transport.identity import check_key_creatable, load_or_create_key, peer_id_of

    if path is None:
        raise ConfigError("no key file given (--key)")
    if path.exists() or path.is_symlink():
        return {"key": str(path), "key_exists": True, "peer_id": peer_id_of(load_or_create_key(path, create=False))}
    check_key_creatable(path)  # as the start will create it and its lock: the same error, nothing left behind
    return {"key": str(path), "key_exists": False, "peer_id": None}


def preflight(config: StageConfig) -> dict:
    """Check that ``config`` can serve, touching no network. Returns the SWARM_STAGE_OK payload.

    Raises:
        SwarmError (ModelError, ConfigError, IdentityError): the first problem, in one line.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"  # a hub id must already be in the local cache
    import torch  # noqa: F401  (the engine imports)

    from swarm.kernels.facts import kernels_in_use
    from swarm.model.block import (FAMILIES, block_tensor_names, load_config, pick_device, pick_dtype,
                                   pick_kernel_mode, rows_reason)
    from swarm.model.plan import kv_elements_per_token_layer
    from swarm.model.resolve import model_manifest_digest, resolve_model, tensor_index
    from swarm.weights.manifest import read_header

    try:
        resolved = _fetched_weights(config) or resolve_model(config.model.name, progress=False)
    except ModelError as exc:
        if "HF_HUB_OFFLINE" in str(exc):
            raise ModelError(f"{config.model.name!r} is not in the local Hugging Face cache, and --check does not "
                             "download; start the stage once without --check to fetch it") from None
        raise
    model_config = load_config(resolved.path)
    family = FAMILIES[model_config.model_type]
    num_layers = model_config.num_hidden_layers
    config.model.layers.check_within(num_layers)
    names = block_tensor_names(resolved.path, config.model.layers)
    wanted = config.model.device
    device = pick_device("cpu" if config.model.quantize is not None and wanted == "auto" else wanted)
    from swarm.model import qcheckpoint, qformats

    if config.model.quantize in qformats.SCHEMES:  # llama.cpp's block formats: checked as load_block checks them
        dtype = pick_dtype(qformats.compute_dtype(config.model.quantize, config.model.dtype, device), device)
        qformats.require_kernels(config.model.quantize)
    elif config.model.quantize is not None:  # checked as load_block checks it: CPU, bfloat16, the ops present
        from swarm.model.block import _quantized_dtype

        dtype = pick_dtype(_quantized_dtype(config.model.quantize, config.model.dtype, device), device)
    else:
        dtype = pick_dtype(config.model.dtype, device)
    if device.type == "mps" and dtype == torch.float64:
        raise ConfigError("float64 is not supported on MPS: use --dtype float32")
    index = tensor_index(resolved.path)
    headers: dict = {}
    itemsize = torch.empty((), dtype=dtype).element_size()
    qcheckpoint.block_size(model_config)  # refuses quantization methods other than fp8 and mxfp4 by name
    published = getattr(model_config, "quantization_config", None) is not None
    # held as published where the fma kernels run the block (load_block): a byte an FP8 value, MXFP4's bytes
    held = config.model.quantize is None and pick_kernel_mode(device, dtype)[0] == "fma"
    weights = 0
    for name in sorted(names):
        shard = index[name]
        header = headers.setdefault(shard, read_header(shard))
        entry = header.get(name)
        stored = entry.get("dtype") if isinstance(entry, dict) else None
        if stored not in LOADABLE and not (published and stored in PUBLISHED):
            raise ModelError(f"tensor {name!r} in {shard.name} has dtype {stored or 'nothing'}; a stage loads "
                             f"{', '.join(LOADABLE)}" + (f", and {', '.join(PUBLISHED)} in FP8 or MXFP4 checkpoints"
                                                         if published else ""))
        numel = 1
        for d in entry.get("shape", []):
            numel *= int(d)
        if stored in PUBLISHED:  # held as stored, or dequantized at load (an MXFP4 byte holds two values)
            weights += numel if held and stored != "F8_E5M2" else 0 if name.endswith("_scales") else \
                numel * itemsize * (2 if name.endswith("_blocks") else 1)
        elif published and name.endswith("_scale_inv"):  # an FP8 weight's scales: held in float32, or folded in
            weights += numel * 4 if held else 0
        else:
            weights += numel * (max(itemsize, 4) if family.keeps_float32(name) else itemsize)  # DeepSeek-V3's router
    _check_retention_dir(config.audits.audit_retention_dir)
    if config.model.quantize in qformats.SCHEMES:  # what the block holds, counted as load_block holds it
        weights = qformats.held_bytes(resolved.path, config.model.layers, config.model.quantize)
    elif config.model.quantize is not None:  # what the block holds: swarm.model.plan counts it as load_block quantizes
        from swarm.model.plan import model_shapes, range_bytes

        weights = range_bytes(model_shapes(resolved.path), config.model.layers, config.model.quantize)
    max_ctx = int(getattr(model_config, "max_position_embeddings", 0) or getattr(model_config, "n_positions", 0)
                  or 4096)
    if config.admission.max_ctx is not None and config.admission.max_ctx > max_ctx:
        raise ConfigError(f"--max-ctx {config.admission.max_ctx} exceeds the model's maximum context of {max_ctx}")
    max_ctx = config.admission.max_ctx or max_ctx
    kv_per_position = len(config.model.layers) * kv_elements_per_token_layer(model_config) * itemsize  # as the block's
    kv = config.admission.kv_budget_bytes if config.admission.kv_budget_mb is not None else kv_per_position * max_ctx
    needed = weights + kv + (BASELINE_BYTES if device.type == "cpu" else 0)
    available = available_memory(device)
    if available is not None and needed > available:
        raise ConfigError(
            f"not enough memory on {device.type}: the stage needs about {needed / 2**20:.0f} MiB (weights "
            f"{weights / 2**20:.0f} MiB in {str(dtype).removeprefix('torch.')}, KV {kv / 2**20:.0f} MiB"
            f"{'' if config.admission.kv_budget_mb is not None else ' for one full-context session'}) but "
            f"{available / 2**20:.0f} MiB are available; use fewer layers, --kv-budget-mb or --max-ctx")
    return {
        "model": resolved.name, "model_path": str(resolved.path), "family": model_config.model_type,
        "model_digest": model_manifest_digest(resolved.path), "num_layers": num_layers,
        "layers": config.model.layers.as_list(), "tensors": len(names), "device": str(device),
        "dtype": str(dtype).removeprefix("torch."), "quantize": config.model.quantize, "max_ctx": max_ctx,
        "weights_bytes": weights,
        "kv_bytes_per_position": kv_per_position, "kv_bytes": kv, "memory_needed_bytes": needed,
        "memory_available_bytes": available, **_check_key(config.network.key_path),
        # the kernels the stage starts in (its start-up proof may still fall back to rows: READY says)
        "kernels": kernels_in_use(pick_kernel_mode(device, dtype)[0], rows_reason(device, dtype)).as_dict(),
    }


def _check_retention_dir(path: Path | None) -> None:
    """``--audit-retention-dir`` must be a writable directory, or creatable in one (nothing is created here).

    Raises:
        ConfigError: it is something else, or nothing could be written there.
    """
    if path is None:
        return
    path = Path(path).expanduser()
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe == path and not path.is_dir():
        raise ConfigError(f"--audit-retention-dir {path}: cannot keep spilled rows there: it is not a directory")
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--audit-retention-dir {path}: cannot keep spilled rows there: {probe} is not a "
                          "writable directory")


def _fetched_weights(config: StageConfig):
    """The weights directory a stage of this model and range fetched earlier (``swarm.weights``), its
    shards re-verified, or None (then ``--model`` resolves as usual)."""
    from swarm.config import cache_root
    from swarm.model.resolve import ResolvedModel
    from swarm.weights.store import find_cached

    if config.model.layers is None or Path(config.model.name).expanduser().exists():
        return None
    cached = find_cached(cache_root() / "weights", config.model.name, config.weights.model_id, config.model.layers)
    if cached is None or cached.missing:
        return None
    return ResolvedModel(cached.path, name=config.model.name, source=config.model.name)


def layers_that_fit(model_dir, *, dtype: str = "auto", device: str = "auto", budget_mb: float | None = None,
                    max_ctx: int | None = None) -> int:
    """How many decoder layers of a model fit a memory budget (automatic placement, ``swarm stage``
    without ``--layers``).

    Per layer: its weights in the stage dtype (from the safetensors headers of one middle layer, or
    from the manifest of a weights directory fetched before its shards) plus
    the KV cache of one full-context session. The embedding and LM head are not counted (they are
    small next to the layers of the models this targets; the first and last stage pay them).

    Args:
        model_dir: the resolved checkpoint directory.
        dtype, device: as ``swarm stage`` takes them.
        budget_mb: memory for the stage's layers in MiB; None: half of what the device has free now
            (after the process baseline on CPU).
        max_ctx: positions of the one full-context session budgeted per layer (None: the model's).
    Returns:
        1 .. L layers.
    """
    import torch

    from swarm.model.block import block_tensor_names, load_config, pick_device, pick_dtype
    from swarm.model.plan import kv_elements_per_token_layer
    from swarm.model.resolve import tensor_index
    from swarm.weights.manifest import read_header
    from swarm.weights.select import select_tensors
    from swarm.weights.store import sidecar_manifest

    model_config = load_config(model_dir)
    num_layers = model_config.num_hidden_layers
    dev = pick_device(device)
    itemsize = torch.empty((), dtype=pick_dtype(dtype, dev)).element_size()
    probe = LayerRange(num_layers // 2, num_layers // 2 + 1)
    partial = sidecar_manifest(Path(model_dir))
    if partial is not None:  # a weights directory, maybe without shards yet: shapes from its manifest
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        shapes = {name: partial.tensors[name][1] for name in select_tensors(partial.tensors, raw, probe)}
    else:
        names = block_tensor_names(model_dir, probe) - block_tensor_names(model_dir, LayerRange(0, 1)) \
            if 0 < probe.start < num_layers - 1 else block_tensor_names(model_dir, probe)
        index, headers = tensor_index(model_dir), {}
        shapes = {name: headers.setdefault(index[name], read_header(index[name])).get(name, {}).get("shape", [])
                  for name in names}
    weights = sum(math.prod(int(d) for d in shape) for shape in shapes.values()) * itemsize
    ctx = max_ctx or int(getattr(model_config, "max_position_embeddings", 0) or 4096)
    per_layer = weights + kv_elements_per_token_layer(model_config) * itemsize * ctx
    if budget_mb is not None:
        budget = int(budget_mb * 2**20)
    else:
        available = available_memory(dev)
        budget = (available - (BASELINE_BYTES if dev.type == "cpu" else 0)) // 2 if available else 2**30
    return max(1, min(num_layers, budget // max(1, per_layer)))

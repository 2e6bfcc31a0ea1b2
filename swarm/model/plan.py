"""Memory planning: the bytes of each layer and of each token of KV, and a split of a model's layers over cards.

Owns: :func:`model_shapes` (from safetensors headers, or a meta-device model of a ``config.json``), :func:`range_bytes`
(what a stage holding ``[a, b)`` loads or holds, by the stage's own tensor selection), :class:`Footprint`,
:func:`split` (contiguous blocks over cards, by memory) and :func:`parse_size` (``24GB``, ``512MiB``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import ConfigError, ModelError
from swarm.ranges import LayerRange

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZED = ("int8", "int4")
DTYPES = tuple(FLOAT_BYTES) + QUANTIZED
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, zero: bool = False) -> int:
    """Bytes of a size such as ``24GB`` (10^9), ``24GiB`` (2^30), ``512MB``, ``1.5TB`` or ``1000`` (bytes).

    Args:
        zero: accept 0.
    Raises:
        ConfigError: not a number with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or 0
            without ``zero``.
    """
    m = _SIZE.match(text or "")
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{text!r} is not a size: write e.g. 24GB (10^9 bytes), 24GiB (2^30) or 512MB")
    value = float(m.group(1)) * _UNITS[unit]
    if not (0 <= value if zero else 0 < value) or value >= 2**60:
        raise ConfigError(f"{text!r} is not a {'' if zero else 'positive '}size")
    return int(value)


def human(n: float) -> str:
    """``n`` bytes as GB / MB / KB with 3 significant figures (decimal units, as ``parse_size`` reads them)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ModelShapes:
    """Every weight tensor of a model: ``shapes`` {checkpoint name: shape}, ``config`` (the parsed
    config.json), and where the shapes came from (``source``: ``safetensors`` or ``config``)."""

    shapes: dict
    config: dict
    source: str

    @property
    def num_layers(self) -> int:
        from swarm.weights.select import num_layers_of

        return num_layers_of(self.config)


def model_shapes(path: Path | str) -> ModelShapes:
    """The weight tensors' names and shapes of a model directory or of a ``config.json`` alone.

    Args:
        path: a directory with config.json and safetensors (shapes from the headers, exactly what a
            stage reads), a directory with config.json only, or a config.json file (shapes from
            transformers' model for that config built on the meta device: nothing is allocated).
    Raises:
        ModelError: no config.json, an unreadable one, an unsupported family, unreadable headers.
    """
    path = Path(path).expanduser()
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise ModelError(f"{path} is neither a model directory with config.json nor a config.json file")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {cfg_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{cfg_path} is not a JSON object")
    if path.is_dir() and (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()):
        from swarm.model.resolve import tensor_index
        from swarm.weights.manifest import read_header

        index, headers = tensor_index(path), {}
        shapes = {name: tuple(int(d) for d in headers.setdefault(shard, read_header(shard))[name]["shape"])
                  for name, shard in index.items()}
        return ModelShapes(shapes, config, "safetensors")
    return ModelShapes(_meta_shapes(cfg_path, config), config, "config")


def _meta_shapes(cfg_path: Path, config: dict) -> dict:
    """{name: shape} of transformers' model for ``config`` on the meta device; a tied LM head is left
    out, as a checkpoint leaves it out (the tail then reads the embedding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from swarm.weights.families import FAMILIES

    if config.get("model_type") not in FAMILIES:
        raise ModelError(f"model family {config.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    try:
        cfg = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelError(f"cannot build the model of {cfg_path}: {exc}") from exc
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        shapes = {n: s for n, s in shapes.items() if not n.startswith("lm_head.")}
    return shapes


def _quantized(name: str, shape: tuple, dtype: str, config: dict) -> int:
    """Bytes of one tensor in a block loaded with ``quantize=dtype``: a decoder layer's Linear weight or an
    untied LM head's held as :mod:`swarm.kernels.quant` holds it where the scheme takes its shape, anything
    else in bfloat16 (GPT-2's Conv1D layers, and a mixture-of-experts model's routers and routed experts,
    which are no Linear modules, stay bfloat16)."""
    from swarm.kernels import quant
    from swarm.weights.families import FAMILIES

    family = FAMILIES.get(config.get("model_type"))
    numel = math.prod(shape)
    linear = (family is not None and config.get("model_type") != "gpt2" and len(shape) == 2
              and name.endswith(".weight") and ".experts." not in name
              and not name.endswith((".gate.weight", ".router.weight"))
              and (name.startswith(f"{family.base}.{family.layers}.") or name.startswith(f"{family.lm_head}.")))
    held = quant.scheme_bytes(dtype, *shape) if linear else None
    return numel * 2 if held is None else held


def tensor_bytes(name: str, shape: tuple, dtype: str, config: dict | None = None) -> int:
    """Bytes of one tensor held in ``dtype`` (one of ``DTYPES``; the quantized ones need the model's
    parsed ``config``)."""
    from swarm.weights.families import FAMILIES

    family = FAMILIES.get((config or {}).get("model_type"))
    if family is not None and family.keeps_float32(name):  # DeepSeek-V3's router: float32 in any dtype
        return math.prod(shape) * 4
    if dtype in FLOAT_BYTES:
        return math.prod(shape) * FLOAT_BYTES[dtype]
    if dtype in QUANTIZED:
        return _quantized(name, shape, dtype, config or {})
    raise ConfigError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")


def range_bytes(model: ModelShapes, layers: LayerRange, dtype: str) -> int:
    """Weight bytes of a stage holding ``layers`` in ``dtype``: the tensors ``select_tensors`` names for
    that range (its decoder layers; the embedding at the head; final norm and LM head at the tail).

    Raises:
        ConfigError: the range lies outside ``[0, L)`` or the dtype is unknown. ModelError: as ``select_tensors``.
    """
    from swarm.weights.select import select_tensors

    names = select_tensors(model.shapes, model.config, layers)
    return sum(tensor_bytes(n, model.shapes[n], dtype, model.config) for n in names)


def kv_elements_per_token_layer(config) -> int:
    """Elements one position takes in one layer's KV cache, for a parsed config.json (dict) or a
    transformers config: keys and values of every KV head (``2 * Hkv * Dh``), or for multi-head latent
    attention (DeepSeek-V3) the cached latent and rotary key (``kv_lora_rank + qk_rope_head_dim``:
    :mod:`swarm.model.mla`).

    Raises:
        ModelError: the config states no heads or hidden size.
    """
    get = config.get if isinstance(config, dict) else (lambda name: getattr(config, name, None))
    if get("kv_lora_rank"):  # multi-head latent attention caches the latent, not per-head K and V
        return int(get("kv_lora_rank")) + int(get("qk_rope_head_dim") or 0)
    heads = get("num_attention_heads") or get("n_head")
    hidden = get("hidden_size") or get("n_embd")
    if not heads or not hidden:
        raise ModelError("config.json states no num_attention_heads / hidden_size")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hidden // heads
    return 2 * int(kv_heads) * int(head_dim)


def kv_bytes_per_token_layer(config: dict, dtype: str) -> int:
    """KV cache bytes one position costs in one layer (:func:`kv_elements_per_token_layer`), in the
    compute dtype (bfloat16 for quantized weights)."""
    return kv_elements_per_token_layer(config) * FLOAT_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class Footprint:
    """Per-layer bytes of a model in one dtype: ``layer`` (the largest decoder layer), ``head`` (what the
    first stage holds besides its layers: embeddings), ``tail`` (what the last stage holds besides its
    layers: final norm and LM head, or the embedding a tied head reads), ``whole`` (what one stage holding
    every layer holds besides them: a tied embedding counts once), ``kv_token_layer`` (KV bytes per
    position per layer), ``per_layer`` (each decoder layer's bytes, in order: DeepSeek-V3's first
    ``first_k_dense_replace`` layers are dense, far smaller than its MoE layers; empty: every layer is
    ``layer``)."""

    dtype: str
    num_layers: int
    layer: int
    head: int
    tail: int
    whole: int
    kv_token_layer: int
    per_layer: tuple[int, ...] = ()

    def layers_bytes(self, layers: LayerRange) -> int:
        """Weight bytes of the decoder layers ``layers`` (no head or tail extras)."""
        if self.per_layer:
            return sum(self.per_layer[layers.start:layers.end])
        return len(layers) * self.layer

    def stage_bytes(self, layers: LayerRange, kv_tokens: int) -> int:
        """Weights plus the KV of ``kv_tokens`` positions of a stage holding ``layers``."""
        if layers.start == 0 and layers.end == self.num_layers:
            extra = self.whole
        else:
            extra = (self.head if layers.start == 0 else 0) + (self.tail if layers.end == self.num_layers else 0)
        return self.layers_bytes(layers) + len(layers) * kv_tokens * self.kv_token_layer + extra

    @property
    def total(self) -> int:
        """Weight bytes of the whole model."""
        return self.layers_bytes(LayerRange(0, self.num_layers)) + self.whole


def footprint(model: ModelShapes, dtype: str) -> Footprint:
    """The :class:`Footprint` of ``model`` in ``dtype``, from the stage's own tensor selection
    (``select_tensors``): the head's and tail's extras are what a stage there loads beyond its layers,
    each layer's bytes are its own tensors' (tensors of layers past ``L``, such as DeepSeek-V3's
    multi-token-prediction layer, are no stage's); :func:`range_bytes` is exact for any range."""
    from swarm.weights.families import FAMILIES
    from swarm.weights.select import select_tensors

    family = FAMILIES[model.config["model_type"]]
    layer_prefix = f"{family.base}.{family.layers}."
    num = model.num_layers

    def extras(a: int, b: int) -> int:
        names = select_tensors(model.shapes, model.config, LayerRange(a, b))
        return sum(tensor_bytes(n, model.shapes[n], dtype, model.config) for n in names
                   if not n.startswith(layer_prefix))

    per_layer = [0] * num
    for n, s in model.shapes.items():
        index = n[len(layer_prefix):].split(".", 1)[0] if n.startswith(layer_prefix) else ""
        if index.isdigit() and int(index) < num:
            per_layer[int(index)] += tensor_bytes(n, s, dtype, model.config)
    whole = extras(0, num)
    head, tail = (extras(0, 1), extras(num - 1, num)) if num > 1 else (whole, 0)
    return Footprint(dtype, num, max(per_layer, default=0), head, tail, whole,
                     kv_bytes_per_token_layer(model.config, dtype), tuple(per_layer))


@dataclass(frozen=True)
class Placement:
    """One card's share of a split: ``card`` (its index), ``capacity`` (bytes given), ``layers``
    (None when it gets none), ``bytes`` (weights + KV it needs)."""

    card: int
    capacity: int
    layers: LayerRange | None
    bytes: int


def split(fp: Footprint, cards: list[int], *, kv_tokens: int, reserve: int = 0) -> list[Placement]:
    """Contiguous blocks of layers over ``cards`` in the order given (card 0 holds the head, the last
    card holding layers the tail), filling every card to the same smallest fraction of its memory.

    A card holds a block if the block's weights, the head's or tail's extras where it sits, and the KV
    of ``kv_tokens`` positions per layer fit ``capacity - reserve``. For a fill fraction ``f``, giving
    each card in turn as many layers as fit ``f`` of its room places the most layers any split can
    (a layer moved to an earlier card never costs a later one), so a bisection on ``f`` finds the
    least ``f`` that places all ``L``: no card is filled past that fraction, a bigger card takes more.

    Args:
        fp: the model's footprint in the dtype the cards will run.
        cards: bytes per card, in ring order. kv_tokens: KV positions budgeted per stage (sessions x
            context). reserve: bytes per card kept for the runtime (CUDA context, activations).
    Returns:
        one :class:`Placement` per card (``layers`` None for a card left without any).
    Raises:
        ConfigError: no cards, or the layers do not fit (the message says by how much and what to try).
    """
    if not cards:
        raise ConfigError("no cards to split over: give --gpus, e.g. --gpus 24GB,24GB,12GB")
    small = [i for i, c in enumerate(cards) if c <= reserve]
    if small:
        raise ConfigError(f"--reserve {human(reserve)} leaves nothing of card {small[0]} ({human(cards[small[0]])}): "
                          "give a smaller --reserve")
    room = [c - reserve for c in cards]

    def fill(f: float) -> list[int]:
        counts, a = [], 0
        for r in room:
            n = 0
            while a + n < fp.num_layers and fp.stage_bytes(LayerRange(a, a + n + 1), kv_tokens) <= f * r:
                n += 1
            counts.append(n)
            a += n
        return counts

    counts = fill(1.0)
    if sum(counts) < fp.num_layers:
        left = fp.num_layers - sum(counts)
        whole = LayerRange(0, fp.num_layers)
        need = (fp.stage_bytes(whole, kv_tokens) if len(cards) == 1 else  # split: head and tail on two cards
                fp.stage_bytes(whole, kv_tokens) - fp.whole + fp.head + fp.tail) + reserve * len(cards)
        raise ConfigError(
            f"the {fp.num_layers} layers in {fp.dtype} do not fit these cards in this order: "
            f"{left} {'layer is' if left == 1 else 'layers are'} left over; the model needs about {human(need)} "
            f"with {kv_tokens} KV positions per stage and {human(reserve)} kept per card, the cards have "
            f"{human(sum(cards))}; add cards, take a smaller dtype, or fewer --ctx/--sessions (or a smaller --reserve)")
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sum(fill(mid)) >= fp.num_layers:
            hi = mid
        else:
            lo = mid
    out, a = [], 0
    for i, n in enumerate(fill(hi)):
        rng = LayerRange(a, a + n) if n else None
        out.append(Placement(i, cards[i], rng, fp.stage_bytes(rng, kv_tokens) if rng else 0))
        a += n
    return out

"""Which tensors and which files a stage needs: pure functions over an index and a config.

Owns: ``select_tensors`` (a layer range's layers; the embedding at 0; the final norm and LM head, or the tied
embedding, at L), ``select_shards`` and ``metadata_files`` (the small files every stage needs). No I/O; names
follow ``swarm.weights.families``, as ``load_block`` reads them (tests check both agree).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from swarm.errors import ModelError
from swarm.weights.families import FAMILIES
from swarm.ranges import LayerRange

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# small files a stage or coordinator reads besides the weights (as resolve's hub patterns)
METADATA_PATTERNS = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                     "vocab.json", "merges.txt", "chat_template*")


@dataclass(frozen=True)
class Selection:
    """What a stage holding ``layers`` needs of a checkpoint.

    ``tensors``: file tensor names, sorted. ``shards``: the safetensors files holding them, sorted.
    """

    layers: LayerRange
    tensors: tuple[str, ...]
    shards: tuple[str, ...]


def num_layers_of(config: dict) -> int:
    """L, the decoder layer count of a parsed config.json.

    Raises:
        ModelError: no positive ``num_hidden_layers`` / ``n_layer``.
    """
    for key in ("num_hidden_layers", "n_layer"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ModelError("config.json states no positive num_hidden_layers (or n_layer)")


def select_tensors(names, config: dict, layers: LayerRange) -> tuple[str, ...]:
    """The tensor names of a checkpoint that a stage holding ``layers`` loads.

    Args:
        names: every tensor name of the checkpoint (an index's weight_map keys, or headers').
        config: the parsed config.json (``model_type``, ``num_hidden_layers`` or ``n_layer``).
        layers: the stage's half-open range ``[start, end)``.
    Returns:
        sorted names: every tensor under a decoder layer of the range; with ``start == 0`` the
        embedding (and GPT-2's position embedding); with ``end == L`` the final norm and the LM
        head, or the embedding weight where the checkpoint has no LM head (tied).
    Raises:
        ModelError: the family is not supported, or the checkpoint has no tensor for one of the
            range's layers, its embedding, final norm or LM head.
        ConfigError: the range lies outside ``[0, L)``.
    """
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ModelError(f"model family {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    num_layers = num_layers_of(config)
    layers.check_within(num_layers)
    layer_prefix = f"{family.base}.{family.layers}."
    head_prefixes = [f"{family.base}.{family.embed}."] + ([f"{family.base}.{family.pos_embed}."]
                                                         if family.pos_embed else [])
    norm_prefix, lm_prefix = f"{family.base}.{family.norm}.", f"{family.lm_head}."
    tied = f"{family.base}.{family.embed}.weight"
    names = set(names)
    head, tail = layers.start == 0, layers.end == num_layers
    out: set[str] = set()
    seen_layers: set[int] = set()
    for name in names:
        if name.startswith(layer_prefix):
            index = name[len(layer_prefix):].split(".", 1)[0]
            if index.isdigit() and layers.start <= int(index) < layers.end:
                out.add(name)
                seen_layers.add(int(index))
        elif head and any(name.startswith(p) for p in head_prefixes):
            out.add(name)
        elif tail and (name.startswith(norm_prefix) or name.startswith(lm_prefix)):
            out.add(name)
    missing = [i for i in range(layers.start, layers.end) if i not in seen_layers]
    if missing:
        raise ModelError(f"the checkpoint has no tensor of layer {missing[0]} ({layer_prefix}{missing[0]}.*), "
                         f"needed by layers {layers}")
    if head and not any(n.startswith(head_prefixes[0]) for n in out):
        raise ModelError(f"the checkpoint has no embedding ({head_prefixes[0]}*), needed by layers {layers}")
    if tail:
        if not any(n.startswith(norm_prefix) for n in out):
            raise ModelError(f"the checkpoint has no final norm ({norm_prefix}*), needed by layers {layers}")
        if not any(n.startswith(lm_prefix) for n in out):
            if tied not in names:
                raise ModelError(f"the checkpoint has neither {lm_prefix}weight nor the embedding it may be tied to "
                                 f"({tied}), needed by layers {layers}")
            out.add(tied)  # tied LM head: the tail reads the embedding matrix (as load_block does)
    return tuple(sorted(out))


def select_shards(weight_map: dict[str, str], config: dict, layers: LayerRange) -> Selection:
    """The shard files of a checkpoint that hold a stage's tensors.

    Args:
        weight_map: ``{tensor name: shard file name}`` (an index's ``weight_map``; a one-file
            checkpoint maps every name to ``model.safetensors``).
        config, layers: as for ``select_tensors``.
    Returns:
        the Selection (tensors and the sorted set of files holding them).
    Raises:
        ModelError / ConfigError: as ``select_tensors``.
    """
    tensors = select_tensors(weight_map, config, layers)
    return Selection(layers=layers, tensors=tensors, shards=tuple(sorted({weight_map[n] for n in tensors})))


def metadata_files(files) -> list[str]:
    """The small non-weight files of a repo or checkpoint directory a stage fetches, sorted.

    Args:
        files: file names at the top of the repo (hub siblings' ``rfilename``) or directory.
    Returns:
        those matching ``METADATA_PATTERNS`` (config, generation config, tokenizer files, chat
        template); never weights, the safetensors index, or files in subfolders.
    """
    return sorted(f for f in set(files) if "/" not in f and not f.endswith(".safetensors") and f != INDEX_NAME
                  and any(fnmatch.fnmatchcase(f, p) for p in METADATA_PATTERNS))

"""A stage's tensors read straight from a GGUF file, the block formats kept as they are.

Owns: the GGUF header (:func:`read_index`: names, GGML types, shapes and offsets), :func:`read_layer_tensors` (a layer
range, memory-mapped copy-on-write), llama.cpp's tensor names in Hugging Face's spelling, and its rope permutation of
``attn_q`` / ``attn_k`` rows undone on the block bytes. What is a view and what a copy: docs/kernels.md.
"""

from __future__ import annotations

import logging
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swarm.errors import ModelError
from swarm.kernels.qblocks import FORMATS, QWeight
from swarm.ranges import LayerRange

log = logging.getLogger(__name__)

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types with a fixed size: type id -> struct format (little-endian)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_F32, _F16, _BF16 = 0, 1, 30
_FLOAT_DTYPES = {_F32: np.float32, _F16: np.float16, _BF16: np.int16}  # bf16 goes through int16 (numpy has none)
_BLOCK_BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}

# llama.cpp's per-layer tensor names -> the module under model.layers.N in transformers
_LAYER_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_NORMS = {"attn_norm", "ffn_norm"}  # the linear layers may also carry a bias (Qwen2: attn_q/k/v)
_REQUIRED = tuple(f"{part}.weight" for part in _LAYER_MODULES)
# GGUF architectures whose converter permuted attn_q / attn_k rows for llama.cpp's rope layout
# (transformers' TENSOR_PROCESSORS maps only "llama" to LlamaTensorProcessor, which undoes it)
_PERMUTED_ARCHS = {"llama"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in a GGUF file.

    Attributes:
        name: llama.cpp's name (``blk.3.attn_q.weight``).
        ggml_type: the GGML type id (``gguf.GGMLQuantizationType``).
        shape: torch order, outermost first: (N, K) for a matrix (GGUF lists K first).
        offset: absolute byte offset of the data in the file.
        n_bytes: bytes of data; None for a GGML type this gguf package does not know.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int | None


@dataclass(frozen=True)
class GGUFIndex:
    """A GGUF file's header: its scalar metadata and where each tensor lies.

    Attributes:
        path: the file.
        arch: ``general.architecture`` (``llama``, ``qwen2``...).
        fields: metadata key -> value, scalars and strings only (arrays such as the vocabulary are skipped).
        tensors: name -> its place, in file order.
    """

    path: Path
    arch: str
    fields: dict
    tensors: dict[str, GGUFTensorInfo]


def read_index(gguf_path: Path) -> GGUFIndex:
    """Read a GGUF file's header (metadata and tensor table) without reading tensor data.

    Parses the header itself: ``gguf.GGUFReader`` builds an object per vocabulary entry and takes
    ~4 s on SmolLM2's 49k-token header, this ~0.1 s.

    Args:
        gguf_path: a GGUF v2 or v3 file, little-endian.
    Returns:
        the header.
    Raises:
        ModelError: the file is missing, not GGUF, big-endian, of another version, truncated, or a
            tensor's data lies past its end.
    """
    path = Path(gguf_path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(path, mm)
    except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
        raise ModelError(f"cannot read GGUF {path}: {type(e).__name__}: {e}") from e
    except struct.error as e:
        raise ModelError(f"GGUF {path} is truncated or corrupt: its header ends early ({e})") from e


def read_layer_tensors(gguf_path: Path, config, layer_range: LayerRange, *, head: bool,
                       tail: bool) -> dict[str, QWeight | torch.Tensor]:
    """Read the tensors of decoder layers ``[start, end)`` (and the head's or tail's) from a GGUF file.

    Matrices in a block format of `FORMATS` stay in it (`QWeight`, rows in the Linear's order);
    F32/F16/BF16 tensors become float32. Only the named tensors are mapped; nothing is dequantized.

    Args:
        gguf_path: the GGUF file (Llama family names; Qwen2-style attention biases when present).
        config: the model's transformers config (``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``tie_word_embeddings``).
        layer_range: the decoder layers to read.
        head: also read the token embedding (``model.embed_tokens.weight``).
        tail: also read the final norm and LM head (``model.norm.weight``, ``lm_head.weight``: the
            token embedding itself when ``config.tie_word_embeddings``).
    Returns:
        Hugging Face parameter name (``model.layers.3.self_attn.q_proj.weight``) -> `QWeight` (uint8
        block bytes; a view of the file's pages except attn_q / attn_k of a ``llama`` file, whose rows
        are gathered into a copy) or float32 tensor (a view of the file for F32).
    Raises:
        ConfigError: the range lies outside ``config.num_hidden_layers``.
        ModelError: the file is unreadable, a needed tensor is missing, has a GGML type other than
            F32/F16/BF16 or a block format of `FORMATS` (or a block format but not 2-D), a layer holds
            a tensor with no Hugging Face name here (an MoE or other family), or the file's head
            counts differ from the config's.
    """
    layer_range.check_within(config.num_hidden_layers)
    index = read_index(gguf_path)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    _check_heads(index, n_head, n_kv)
    permute = index.arch in _PERMUTED_ARCHS
    wanted: dict[str, str] = {}  # HF name -> GGUF name
    for layer in range(layer_range.start, layer_range.end):
        wanted |= _layer_names(index, layer)
    if head:
        wanted["model.embed_tokens.weight"] = "token_embd.weight"
    if tail:
        wanted["model.norm.weight"] = "output_norm.weight"
        tied = getattr(config, "tie_word_embeddings", False)
        wanted["lm_head.weight"] = "token_embd.weight" if tied else "output.weight"
    missing = sorted({g for g in wanted.values() if g not in index.tensors})
    if missing:
        raise ModelError(f"GGUF {index.path} lacks {', '.join(missing)} (needed for layers {layer_range}"
                         f"{' and the head' if head else ''}{' and the tail' if tail else ''})")
    out: dict[str, QWeight | torch.Tensor] = {}
    read: dict[str, QWeight | torch.Tensor] = {}  # a tied head and tail share one tensor
    with index.path.open("rb") as f:
        for hf_name, gguf_name in wanted.items():
            if gguf_name not in read:
                t = _read_tensor(f, index, index.tensors[gguf_name])
                part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
                if permute and part in ("attn_q", "attn_k"):
                    t = _unpermute(t, gguf_name, n_head if part == "attn_q" else n_kv)
                read[gguf_name] = t
            out[hf_name] = read[gguf_name]
    log.debug("model.gguf.read file=%s layers=%s tensors=%d bytes=%d", index.path.name, layer_range,
              len(read), sum(_nbytes(t) for t in read.values()))
    return out


def type_name(ggml_type: int) -> str:
    """GGML's name of a type id (``Q4_K``), or ``type <id>`` for one this gguf package does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _layer_names(index: GGUFIndex, layer: int) -> dict[str, str]:
    """HF name -> GGUF name for one layer: the required weights and whatever biases the file has."""
    prefix = f"blk.{layer}."
    names = {f"model.layers.{layer}.{_LAYER_MODULES[p.split('.')[0]]}.weight": prefix + p for p in _REQUIRED}
    for gguf_name in index.tensors:
        if not gguf_name.startswith(prefix):
            continue
        part, _, suffix = gguf_name[len(prefix):].partition(".")
        if part in _LAYER_MODULES and (suffix == "weight" or suffix == "bias" and part not in _NORMS):
            names[f"model.layers.{layer}.{_LAYER_MODULES[part]}.{suffix}"] = gguf_name
        else:
            raise ModelError(f"GGUF {index.path} ({index.arch}) has {gguf_name}, which no Llama-family layer "
                             f"holds here: only {', '.join(_LAYER_MODULES)} (weights; biases on the linear ones)")
    return names


def _check_heads(index: GGUFIndex, n_head: int, n_kv: int) -> None:
    """The permutation groups rows by the config's head counts: refuse a config of another model."""
    for key, want in (("attention.head_count", n_head), ("attention.head_count_kv", n_kv)):
        have = index.fields.get(f"{index.arch}.{key}")
        if isinstance(have, int) and have != want:
            raise ModelError(f"GGUF {index.path} has {index.arch}.{key}={have} but the config says {want}: "
                             f"the config is not this file's model")


def _read_tensor(f, index: GGUFIndex, info: GGUFTensorInfo) -> QWeight | torch.Tensor:
    """Map one tensor copy-on-write: a `QWeight` over its block bytes, or a float32 tensor."""
    fmt = _BLOCK_BY_TYPE.get(info.ggml_type)
    if fmt is None and info.ggml_type not in _FLOAT_DTYPES:
        raise ModelError(f"GGUF tensor {info.name} is {type_name(info.ggml_type)}: a stage reads F32, F16, BF16 "
                         f"or the block formats {', '.join(f.upper() for f in FORMATS)}")
    if fmt is not None and len(info.shape) != 2:
        raise ModelError(f"GGUF tensor {info.name} is {type_name(info.ggml_type)} of shape {info.shape}: "
                         f"a block-format tensor must be a 2-D matrix here")
    if info.n_bytes == 0:
        raw = np.zeros(0, dtype=np.uint8)  # mmap refuses a zero length
    else:
        # mode "c" (MAP_PRIVATE) gives writable arrays, so torch.from_numpy shares the pages without
        # warning; a read-only map would need a copy or a warning about non-writable tensors
        raw = np.memmap(f, dtype=np.uint8, mode="c", offset=info.offset, shape=(info.n_bytes,))
    if fmt is not None:
        n, k = info.shape
        return QWeight(fmt.name, n, k, torch.from_numpy(raw.reshape(n, k // fmt.block * fmt.block_bytes)))
    t = torch.from_numpy(raw.view(_FLOAT_DTYPES[info.ggml_type]).reshape(info.shape))
    if info.ggml_type == _BF16:
        t = t.view(torch.bfloat16)
    return t if t.dtype == torch.float32 else t.float()


def _unpermute(t: QWeight | torch.Tensor, name: str, n_head: int) -> QWeight | torch.Tensor:
    """Undo llama.cpp's rope permutation of attn_q / attn_k rows (a weight or its bias).

    llama.cpp's convert_hf_to_gguf.py ``permute`` reshaped rows (n_head, 2, d, ...) and swapped the
    middle axes; transformers' ``LlamaTensorProcessor._reverse_permute_weights`` reshapes (n_head, d, 2,
    ...) and swaps them back. Rows are output features and a row's blocks run along K, so the same
    gather applies to the block bytes unchanged.
    """
    rows = t.n if isinstance(t, QWeight) else t.shape[0]
    if rows % (2 * n_head):
        raise ModelError(f"GGUF tensor {name} has {rows} rows, not a multiple of 2 x {n_head} heads: "
                         f"cannot undo llama.cpp's rope permutation")
    order = np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)
    # numpy's gather: torch's index_select over freshly mapped pages took ~1 s for SmolLM2's 60 q/k
    # matrices on two threads (0.1 s on one); numpy's takes 0.05 s
    if isinstance(t, QWeight):
        return QWeight(t.fmt, t.n, t.k, torch.from_numpy(t.data.numpy()[order]))
    return torch.from_numpy(t.numpy()[order])


def _nbytes(t: QWeight | torch.Tensor) -> int:
    return t.nbytes if isinstance(t, QWeight) else t.numel() * t.element_size()


def _parse(path: Path, mm) -> GGUFIndex:
    """Walk the header of a mapped GGUF file (struct.error when it ends early)."""
    if mm[:4] != _MAGIC:
        raise ModelError(f"{path} is not a GGUF file (magic {bytes(mm[:4])!r})")
    (version,) = struct.unpack_from("<I", mm, 4)
    if version not in (2, 3):
        swapped = struct.unpack_from(">I", mm, 4)[0]
        why = "big-endian GGUF files are not supported" if swapped in (2, 3) else "only versions 2 and 3 are read"
        raise ModelError(f"{path} is GGUF version {version}: {why}")
    n_tensors, n_fields = struct.unpack_from("<QQ", mm, 8)
    pos = 24
    fields: dict = {}
    for _ in range(n_fields):
        key, pos = _string(mm, pos)
        (vtype,) = struct.unpack_from("<I", mm, pos)
        value, pos = _value(mm, pos + 4, vtype)
        if vtype != _ARRAY:
            fields[key] = value
    raw = []
    for _ in range(n_tensors):
        name, pos = _string(mm, pos)
        (n_dims,) = struct.unpack_from("<I", mm, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw.append((name, ggml_type, tuple(reversed(dims)), offset))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelError(f"GGUF {path} has general.alignment={alignment!r}")
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, ggml_type, shape, offset in raw:
        info = GGUFTensorInfo(name, ggml_type, shape, data_start + offset, _data_bytes(ggml_type, shape))
        if info.n_bytes is not None and info.offset + info.n_bytes > len(mm):
            raise ModelError(f"GGUF {path} is truncated: {name} ends at byte {info.offset + info.n_bytes}, "
                             f"the file has {len(mm)}")
        tensors[name] = info
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"GGUF {path} has no general.architecture")
    return GGUFIndex(path=path, arch=arch, fields=fields, tensors=tensors)


def _string(mm, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", mm, pos)
    end = pos + 8 + n
    if end > len(mm):
        raise struct.error(f"a string of {n} bytes at {pos} runs past the end")
    return bytes(mm[pos + 8:end]).decode("utf-8", errors="replace"), end


def _value(mm, pos: int, vtype: int):
    """One metadata value at ``pos`` -> (value, position after it); arrays are skipped (value None)."""
    if vtype in _SCALAR:
        return struct.unpack_from(_SCALAR[vtype], mm, pos)[0], pos + struct.calcsize(_SCALAR[vtype])
    if vtype == _STRING:
        return _string(mm, pos)
    if vtype != _ARRAY:
        raise ValueError(f"metadata value of unknown type {vtype} at byte {pos}")  # read_index names the file
    etype, count = struct.unpack_from("<IQ", mm, pos)
    pos += 12
    if etype in _SCALAR:
        return None, pos + count * struct.calcsize(_SCALAR[etype])
    for _ in range(count):  # strings (a vocabulary: ~50 ms for 100k entries) or nested arrays
        if etype == _STRING:
            (n,) = struct.unpack_from("<Q", mm, pos)
            pos += 8 + n
        else:
            _, pos = _value(mm, pos, etype)
    return None, pos


def _data_bytes(ggml_type: int, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor's data, from gguf's table of block sizes (None: a type it does not know)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    return int(np.prod(shape, dtype=np.int64)) // block * block_bytes
